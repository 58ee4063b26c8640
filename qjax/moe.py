"""Sparse MoE: softmax-then-top-k routing with unconditional renormalisation, SwiGLU experts stacked ``[E, …]``.

Two ways to run the routed experts, picked statically from the number of token-slots ``N·k``:
- *gather* (decode): fetch the k expert matrices each token needs — reads only those weights;
- *grouped* (prefill): sort token-slots by expert and run ``ragged_dot`` — one grouped matmul per projection.
Both contract the weights in their stored ``[out, in]`` layout, so no transposed copy of the experts is made.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import MLP, Linear, _normal


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


def _dot_out_in(x: jnp.ndarray, w: jnp.ndarray, spec: str) -> jnp.ndarray:
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.einsum(spec, x, w.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)


WeightFn = Callable[[jnp.ndarray | None], jnp.ndarray]  # expert indices (or None: all) → dense [..., out, in]


def experts_gather(x, idx, weights, gate_up: WeightFn, down: WeightFn):
    """Routed experts by gathering each token's k expert matrices (cheap when N·k is small).

    Args:
      x: ``[N, H]``; idx, weights: ``[N, k]``.
      gate_up, down: give the dense ``[N, k, 2I, H]`` / ``[N, k, H, I]`` matrices of the selected experts.
    Returns:
      ``[N, H]`` float32 (the weighted sum over the k experts).
    """
    gu = _dot_out_in(x, gate_up(idx), "nh,nkoh->nko").astype(x.dtype)  # [N, k, 2I]
    inter = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :inter]) * gu[..., inter:]).astype(x.dtype)
    out = _dot_out_in(act, down(idx), "nki,nkhi->nkh")  # [N, k, H]
    return jnp.einsum("nkh,nk->nh", out, weights.astype(jnp.float32))


def experts_grouped(x, idx, weights, gate_up: WeightFn, down: WeightFn, num_experts: int):
    """Routed experts by sorting token-slots by expert and running two ``ragged_dot`` s (same contract as gather)."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = x[token]  # [N·k, H] sorted by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    # contract lhs dim 1 with the stored "in" dim (2) of [E, out, in]; rhs dim 0 is the group dim
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gu = jax.lax.ragged_dot_general(xs, gate_up(None).astype(x.dtype), sizes, dn, precision=precision,
                                    preferred_element_type=jnp.float32).astype(x.dtype)
    inter = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(x.dtype)
    out = jax.lax.ragged_dot_general(act, down(None).astype(x.dtype), sizes, dn, precision=precision,
                                     preferred_element_type=jnp.float32)
    w_sorted = weights.reshape(-1)[order].astype(jnp.float32)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(out * w_sorted[:, None])


def routed_experts(x, idx, weights, gate_up: WeightFn, down: WeightFn, *, num_experts: int):
    """Dispatch on the static token count: gather when the token-slots touch fewer matrices than exist."""
    if idx.shape[0] * idx.shape[1] <= num_experts:
        return experts_gather(x, idx, weights, gate_up, down)
    return experts_grouped(x, idx, weights, gate_up, down, num_experts)


class Experts(nnx.Module):
    """Stacked SwiGLU experts: ``gate_up_proj [E, 2I, H]`` (rows ``:I`` gate, ``I:`` up), ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, std: float, rngs: nnx.Rngs | None):
        self.gate_up_proj = nnx.Param(_normal(rngs, (num_experts, 2 * inter, hidden), std, dtype))
        self.down_proj = nnx.Param(_normal(rngs, (num_experts, hidden, inter), std, dtype))

    def __call__(self, x: jnp.ndarray, idx: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        return routed_experts(x, idx, weights, lambda sel: gu if sel is None else gu[sel],
                              lambda sel: dn if sel is None else dn[sel], num_experts=gu.shape[0])


class SparseMoeBlock(nnx.Module):
    """Router → routed experts, plus a sigmoid-gated shared expert on every token (MODEL.md §2.6)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):
        from .model import make_linear
        from .quant.layers import QuantExperts

        h, std, quant = cfg.hidden_size, cfg.initializer_range, quant or {}
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(h, cfg.num_experts, dtype=dtype, std=std, rngs=rngs)  # router: never quantized
        if "mlp.experts.gate_up_proj" in quant:
            self.experts = QuantExperts(cfg.num_experts, quant["mlp.experts.gate_up_proj"],
                                        quant["mlp.experts.down_proj"])
        else:
            self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype=dtype, std=std, rngs=rngs)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype=dtype, std=std, rngs=rngs,
                                 quant=quant, prefix="mlp.shared_expert.")
        self.shared_expert_gate = make_linear("mlp.shared_expert_gate", h, 1, quant, dtype=dtype, std=std, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x [B, T, H]`` → ``[B, T, H]``."""
        b, t, h = x.shape
        xf = x.reshape(b * t, h)
        weights, idx = route(self.gate(xf), self.top_k)
        routed = self.experts(xf, idx, weights)
        shared = jax.nn.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return (routed.astype(x.dtype) + shared).reshape(b, t, h)
