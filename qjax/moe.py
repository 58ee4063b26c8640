"""Sparse MoE: softmax-then-top-k routing with unconditional renormalisation, SwiGLU experts stacked ``[E, …]``.

The routed-expert computation itself lives in :mod:`qjax.kernels` (plain-JAX reference and Pallas kernels), for
unquantized experts as for packed ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .kernels import moe_experts
from .kernels.reference import dense_meta
from .layers import MLP, Linear, _normal, make_linear


def route(router_logits: jnp.ndarray, top_k: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Softmax over all experts in fp32, top-k, renormalise (no ``norm_topk_prob`` flag: always on).

    Args:
      router_logits: ``[N, E]`` in the model dtype.
    Returns:
      weights ``[N, k]`` in the model dtype, expert indices ``[N, k]`` int32.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(router_logits.dtype), idx.astype(jnp.int32)


class Experts(nnx.Module):
    """Stacked SwiGLU experts: ``gate_up_proj [E, 2I, H]`` (rows ``:I`` gate, ``I:`` up), ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, std: float, rngs: nnx.Rngs | None):
        self.gate_up_proj = nnx.Param(_normal(rngs, (num_experts, 2 * inter, hidden), std, dtype))
        self.down_proj = nnx.Param(_normal(rngs, (num_experts, hidden, inter), std, dtype))

    def __call__(self, x: jnp.ndarray, idx: jnp.ndarray, weights: jnp.ndarray, group=None) -> jnp.ndarray:
        """``group``: the weights carry a leading layer-stack axis ``[G, E, …]`` and this is layer ``group`` (read in
        place by the kernels; see :func:`qjax.kernels.moe_experts`)."""
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        (n_gu, h), (_, n_dn) = gu.shape[-2:], dn.shape[-2:]
        return moe_experts(x, idx, weights, (gu, None, None, dense_meta(n_gu, h, gu.dtype)),
                           (dn, None, None, dense_meta(h, n_dn, dn.dtype)), group=group)


class SparseMoeBlock(nnx.Module):
    """Router → routed experts, plus a sigmoid-gated shared expert on every token (MODEL.md §2.6)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):
        from .quant.layers import QuantExperts

        h, std, quant = cfg.hidden_size, cfg.initializer_range, quant or {}
        self.top_k = cfg.num_experts_per_tok
        self.mesh_plan = None  # a qjax.sharding.MeshPlan once the model is placed on a mesh
        self.gate = Linear(h, cfg.num_experts, dtype=dtype, std=std, rngs=rngs)  # router: never quantized
        if "mlp.experts.gate_up_proj" in quant or "mlp.experts.down_proj" in quant:
            self.experts = QuantExperts(cfg.num_experts, quant.get("mlp.experts.gate_up_proj"),
                                        quant.get("mlp.experts.down_proj"), hidden=h,
                                        inter=cfg.moe_intermediate_size, dtype=dtype)
        else:
            self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype=dtype, std=std, rngs=rngs)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype=dtype, std=std, rngs=rngs,
                                 quant=quant, prefix="mlp.shared_expert.")
        self.shared_expert_gate = make_linear("mlp.shared_expert_gate", h, 1, quant, dtype=dtype, std=std, rngs=rngs)

    def __call__(self, x: jnp.ndarray, group=None) -> jnp.ndarray:
        """``x [B, T, H]`` → ``[B, T, H]``; ``group``: see :meth:`Experts.__call__`."""
        b, t, h = x.shape
        xf = x.reshape(b * t, h)
        with jax.named_scope("router"):
            weights, idx = route(self.gate(xf, group), self.top_k)
        with jax.named_scope("experts"):
            if self.mesh_plan is not None:
                from .sharding import expert_parallel

                routed = expert_parallel(self.experts, xf, idx, weights, self.mesh_plan)
            else:
                routed = self.experts(xf, idx, weights) if group is None else self.experts(xf, idx, weights, group)
        with jax.named_scope("shared_expert"):
            shared = jax.nn.sigmoid(self.shared_expert_gate(xf, group)) * self.shared_expert(xf, group)
        return (routed.astype(x.dtype) + shared).reshape(b, t, h)
