"""Plain-JAX reference of the routed-expert computation (dense or quantized experts), the oracle of the Pallas
MoE kernels.

Two ways, picked statically from the number of token-slots ``N·k``:
- *gather* (decode): fetch the k expert matrices each token needs — reads only those weights;
- *grouped* (prefill): sort token-slots by expert and run ``ragged_dot`` — one grouped matmul per projection.
Both contract the weights in their stored ``[out, in]`` layout, so no transposed copy of the experts is made.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .precision import accum_dtype, dot_precision, silu
from .qmatmul_reference import dequantize_experts
from .quant_meta import QuantMeta


def _dot_out_in(x: jnp.ndarray, w: jnp.ndarray, spec: str) -> jnp.ndarray:
    return jnp.einsum(spec, x, w.astype(x.dtype), precision=dot_precision(x.dtype),
                      preferred_element_type=accum_dtype(x.dtype))


WeightFn = Callable[[jnp.ndarray | None], jnp.ndarray]  # expert indices (or None: all) → dense [..., out, in]


def experts_gather(x, idx, weights, gate_up: WeightFn, down: WeightFn, num_experts: int | None = None):
    """Routed experts token by token, slot by slot, reading only the k selected expert matrices (decode).

    Each expert is indexed with a scalar inside a loop, which XLA turns into a dynamic slice of the stacked weights
    (a view): gathering ``gate_up[idx]`` for all slots at once made XLA:CPU copy the selected experts into a
    transposed layout on every step (6–7× slower at decode).

    Args:
      x: ``[N, H]``; idx, weights: ``[N, k]`` (an id outside ``[0, E)`` drops its slot).
      gate_up, down: called with a scalar expert id, give the dense ``[2I, H]`` / ``[H, I]`` matrices.
      num_experts: E (None: every id is taken as valid).
    Returns:
      ``[N, H]`` in the accumulation dtype (float32; float64 for float64 x): the weighted sum over the k experts.
    """
    k = idx.shape[1]
    acc_dtype = accum_dtype(x.dtype)

    def token(xn, en, wn):
        def slot(j, acc):
            e = en[j] if num_experts is None else jnp.clip(en[j], 0, num_experts - 1)
            gu = _dot_out_in(xn, gate_up(e), "h,oh->o").astype(x.dtype)  # [2I]
            inter = gu.shape[-1] // 2
            act = (silu(gu[:inter]) * gu[inter:]).astype(x.dtype)
            y = _dot_out_in(act, down(e), "i,hi->h") * wn[j].astype(acc_dtype)
            if num_experts is not None:
                y = jnp.where((en[j] >= 0) & (en[j] < num_experts), y, 0.0)
            return acc + y
        return jax.lax.fori_loop(0, k, slot, jnp.zeros((x.shape[1],), acc_dtype))

    return jax.vmap(token)(x, idx, weights)


def experts_grouped(x, idx, weights, gate_up: WeightFn, down: WeightFn, num_experts: int):
    """Routed experts by sorting token-slots by expert and running two ``ragged_dot`` s (same contract as gather)."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(valid, flat, num_experts)  # dropped slots sort last, in no group (ragged_dot gives 0 there)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = x[token]  # [N·k, H] sorted by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    precision, acc_dtype = dot_precision(x.dtype), accum_dtype(x.dtype)
    # contract lhs dim 1 with the stored "in" dim (2) of [E, out, in]; rhs dim 0 is the group dim
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gu = jax.lax.ragged_dot_general(xs, gate_up(None).astype(x.dtype), sizes, dn, precision=precision,
                                    preferred_element_type=acc_dtype).astype(x.dtype)
    inter = gu.shape[-1] // 2
    act = (silu(gu[:, :inter]) * gu[:, inter:]).astype(x.dtype)
    out = jax.lax.ragged_dot_general(act, down(None).astype(x.dtype), sizes, dn, precision=precision,
                                     preferred_element_type=acc_dtype)
    w_sorted = jnp.where(valid[order], weights.reshape(-1)[order].astype(acc_dtype), 0.0)
    return jnp.zeros((n, x.shape[1]), acc_dtype).at[token].add(out * w_sorted[:, None])


def experts_blocked(x, idx, weights, gate_up: WeightFn, down: WeightFn, num_experts: int):
    """Routed experts as a batched matmul over fixed-size row blocks, each block owned by one expert.

    Token-slots are sorted by expert and each expert's run padded to a multiple of the block height (vLLM's
    ``moe_align_block_size``); every block gathers its expert's matrices once. On CPU this is ~6× faster than
    ``ragged_dot`` (which XLA:CPU runs as a dense loop) — same contract as :func:`experts_gather`.
    """
    n, k = idx.shape
    s = n * k
    block = int(min(128, max(8, 1 << max(0, (-(-s // num_experts) - 1).bit_length()))))
    nb = (s + num_experts * (block - 1)) // block  # static bound on the number of blocks
    flat = idx.reshape(-1)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped slots: sorted last, no row
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    starts = ends - padded
    first = jnp.cumsum(sizes) - sizes
    e_sorted = flat[order]
    e_safe = jnp.minimum(e_sorted, num_experts - 1)
    dest = jnp.where(e_sorted < num_experts, starts[e_safe] + jnp.arange(s) - first[e_safe], nb * block)
    rows = jnp.full((nb * block,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    blk_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * block, side="right"), num_experts - 1)
    valid = rows >= 0
    token = jnp.where(valid, rows // k, 0)
    xs = x[token].reshape(nb, block, x.shape[1])
    gu = _dot_out_in(xs, gate_up(blk_expert), "bth,boh->bto").astype(x.dtype)
    inter = gu.shape[-1] // 2
    act = (silu(gu[..., :inter]) * gu[..., inter:]).astype(x.dtype)
    out = _dot_out_in(act, down(blk_expert), "bti,bhi->bth").reshape(nb * block, x.shape[1])
    acc_dtype = accum_dtype(x.dtype)
    w = jnp.where(valid, weights.reshape(-1)[jnp.maximum(rows, 0)].astype(acc_dtype), 0.0)
    return jnp.zeros((n, x.shape[1]), acc_dtype).at[token].add(out * w[:, None])


def routed_experts(x, idx, weights, gate_up: WeightFn, down: WeightFn, *, num_experts: int):
    """Dispatch on the static token count: gather when the token-slots touch fewer matrices than exist, else
    expert-aligned blocks. An id outside ``[0, num_experts)`` drops its slot (adds nothing): expert parallelism
    passes the experts of other devices so."""
    if idx.shape[0] * idx.shape[1] <= num_experts:
        return experts_gather(x, idx, weights, gate_up, down, num_experts)
    return experts_blocked(x, idx, weights, gate_up, down, num_experts)


def moe_experts(x, idx, weights, gate_up: tuple, down: tuple, *, num_experts: int | None = None,
                offset=None) -> jnp.ndarray:
    """Routed SwiGLU experts with packed weights: ``Σ_k w_k · down_e(silu(gate_e x) · up_e x)``.

    Args:
      x: ``[N, H]`` activations; idx, weights: ``[N, k]`` expert ids (int32) and routing weights.
      gate_up: ``(packed, scale, zero, meta)`` of the stacked ``[E, 2I, H]`` weight (rows ``:I`` gate, ``I:`` up).
      down: the same for ``[E, H, I]``.
      num_experts, offset: the arrays hold several layers' experts flattened (``[G·E, …]``); this layer's E start at
        ``offset`` (int32 scalar, may be traced); ids stay in ``[0, E)``. Only the experts read are sliced.
    Returns:
      ``[N, H]`` in the accumulation dtype (float32; float64 for float64 x).
    """
    gu_meta: QuantMeta = gate_up[3]
    dn_meta: QuantMeta = down[3]
    num_experts = gate_up[0].shape[0] if num_experts is None else num_experts
    gu = _layer_experts(gate_up[:3], gu_meta, num_experts, offset, x.dtype)
    dn = _layer_experts(down[:3], dn_meta, num_experts, offset, x.dtype)
    return routed_experts(x, idx, weights, gu, dn, num_experts=num_experts)


def _layer_experts(arrays: tuple, meta: QuantMeta, num_experts: int, offset, dtype) -> WeightFn:
    """``sel → dense weights`` of this layer's experts ``sel`` (None: all E of them) in a stack starting at
    ``offset``."""
    def fn(sel):
        if offset is None:
            return dequantize_experts(*arrays, meta, sel, dtype)
        if sel is None:
            part = [None if a is None else jax.lax.dynamic_slice_in_dim(a, offset, num_experts) for a in arrays]
            return dequantize_experts(*part, meta, None, dtype)
        return dequantize_experts(*arrays, meta, sel + offset, dtype)
    return fn


def moe_experts_dequant_all(x, idx, weights, gate_up: tuple, down: tuple, *, num_experts: int | None = None,
                            offset=None) -> jnp.ndarray:
    """The naive baseline (``impl="xla"``): dequantize every expert on every call, then :func:`experts_grouped`.

    Same contract and result as :func:`moe_experts`; it reads and writes all ``E`` experts' dense weights each call,
    which is what a plain-XLA port without kernels does and what the Pallas kernels avoid.
    """
    num_experts = gate_up[0].shape[0] if num_experts is None else num_experts
    dense_gu = _layer_experts(gate_up[:3], gate_up[3], num_experts, offset, x.dtype)(None)
    dense_dn = _layer_experts(down[:3], down[3], num_experts, offset, x.dtype)(None)
    return experts_grouped(x, idx, weights, lambda sel: dense_gu, lambda sel: dense_dn, num_experts=num_experts)
