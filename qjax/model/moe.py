"""Sparse MoE: softmax-then-top-k routing with unconditional renormalisation (:func:`qjax.kernels.route`), SwiGLU
experts stacked ``[E, …]``.

The routed-expert computation itself lives in :mod:`qjax.kernels` (plain-JAX reference and Pallas kernels), for
unquantized experts as for packed ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.kernels import QuantMeta, moe_experts, moe_routed, route, sigmoid
from qjax.model.layers import MLP, Linear, init_normal
from qjax.model.linears import linear
from qjax.model.quant_layers import PackedWeight, expert_operand
from qjax.model.sharding import expert_parallel


class Experts(nnx.Module):
    """Stacked SwiGLU experts: ``gate_up_proj [E, 2I, H]`` (rows ``:I`` gate, ``I:`` up), ``down_proj [E, H, I]``.

    Each side is a dense ``nnx.Param`` stack or, when its QuantMeta is given, a packed one
    (:class:`qjax.model.quant_layers.PackedWeight`). One side may stay dense while the other is packed: auto-round and
    llm-compressor leave a projection in float when its input dimension is not a multiple of the group size (W4G128
    on a model with I = 64 quantizes gate/up but not down). Both sides go through one kernel entry point, a dense one
    as ``fmt="dense"``.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, std: float, rngs: nnx.Rngs | None,
                 gate_up: QuantMeta | None = None, down: QuantMeta | None = None):
        self.gate_up_proj = (PackedWeight(gate_up, lead=(num_experts,)) if gate_up is not None
                             else nnx.Param(init_normal(rngs, (num_experts, 2 * inter, hidden), std, dtype)))
        self.down_proj = (PackedWeight(down, lead=(num_experts,)) if down is not None
                          else nnx.Param(init_normal(rngs, (num_experts, hidden, inter), std, dtype)))

    def __call__(self, x: jnp.ndarray, idx: jnp.ndarray, weights: jnp.ndarray, layer=None) -> jnp.ndarray:
        """``layer``: the weights carry a leading layer-stack axis ``[L, E, …]`` and this is layer ``layer`` (read in
        place by the kernels; see :func:`qjax.kernels.moe_experts`)."""
        return moe_experts(x, idx, weights, expert_operand(self.gate_up_proj), expert_operand(self.down_proj),
                           layer=layer)

    def routed(self, x: jnp.ndarray, router_logits: jnp.ndarray, top_k: int, layer=None) -> jnp.ndarray:
        """:func:`qjax.kernels.route` then the experts, in one kernel call (:func:`qjax.kernels.moe_routed`: at one
        decode token the kernels route from the logits themselves)."""
        return moe_routed(x, router_logits, top_k, expert_operand(self.gate_up_proj),
                          expert_operand(self.down_proj), layer=layer)


class SparseMoeBlock(nnx.Module):
    """Router → routed experts, plus a sigmoid-gated shared expert on every token (docs/model.md §2.6)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):

        h, std, quant = cfg.hidden_size, cfg.initializer_range, quant or {}
        self.top_k = cfg.num_experts_per_tok
        self.mesh_plan = None  # a qjax.model.sharding.MeshPlan once the model is placed on a mesh
        self.gate = Linear(h, cfg.num_experts, dtype=dtype, std=std, rngs=rngs)  # router: never quantized
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype=dtype, std=std, rngs=rngs,
                               gate_up=quant.get("mlp.experts.gate_up_proj"), down=quant.get("mlp.experts.down_proj"))
        lin = functools.partial(linear, cfg, quant=quant, dtype=dtype, rngs=rngs)  # shapes: qjax.model.linears
        self.shared_expert = MLP(*(lin(f"mlp.shared_expert.{p}_proj") for p in ("gate", "up", "down")))
        self.shared_expert_gate = lin("mlp.shared_expert_gate")

    def __call__(self, x: jnp.ndarray, layer=None) -> jnp.ndarray:
        """``x [B, T, H]`` → ``[B, T, H]``; ``layer``: see :meth:`Experts.__call__`."""
        b, t, h = x.shape
        xf = x.reshape(b * t, h)
        with jax.named_scope("router"):
            logits = self.gate(xf, layer)
        with jax.named_scope("experts"):
            if self.mesh_plan is not None:
                weights, idx = route(logits, self.top_k)
                routed = expert_parallel(self.experts, xf, idx, weights, self.mesh_plan)
            else:
                routed = self.experts.routed(xf, logits, self.top_k, layer)
        with jax.named_scope("shared_expert"):
            shared = sigmoid(self.shared_expert_gate(xf, layer)) * self.shared_expert(xf, layer)
        return (routed.astype(x.dtype) + shared).reshape(b, t, h)
