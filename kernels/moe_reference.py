"""Plain-JAX reference of the routed-expert computation (dense or quantized experts), the oracle of the Pallas
MoE kernels.

Two ways, picked statically from the number of token-slots ``N·k`` (:func:`routed_experts`):
- *gather* (decode): fetch the k expert matrices each token needs — reads only those weights;
- *blocked* (prefill): sort token-slots by expert into expert-aligned row blocks, one block per scan step.
A third, *grouped* (sort, then ``ragged_dot``), is the plain-XLA baseline the benchmarks compare with. All contract
the weights in their stored ``[out, in]`` layout, so no transposed copy of the experts is made.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .indexing import gather, put, take
from .precision import accum_dtype, dot_precision, silu
from .qmatmul_reference import dequantize_experts
from .quant_meta import QuantMeta


def route(router_logits: jnp.ndarray, top_k: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Softmax over all experts in fp32 (float64 logits: float64), top-k, renormalise (Qwen3.5-MoE has no
    ``norm_topk_prob`` flag: always on).

    Args:
      router_logits: ``[N, E]`` in the model dtype.
    Returns:
      weights ``[N, k]`` in the model dtype, expert indices ``[N, k]`` int32.
    """
    probs = jax.nn.softmax(router_logits.astype(accum_dtype(router_logits.dtype)), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(router_logits.dtype), idx.astype(jnp.int32)


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
    xs = gather(x, token)  # [N·k, H] sorted by expert
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
    w_sorted = jnp.where(gather(valid, order), gather(weights.reshape(-1), order).astype(acc_dtype), 0.0)
    return jnp.zeros((n, x.shape[1]), acc_dtype).at[token].add(out * w_sorted[:, None])


def block_sizes(slots: int, num_experts: int) -> tuple[int, ...]:
    """The row-block sizes of the blocked path, largest first: a power of two near the mean rows per expert
    (8…128), then a quarter of it (not below 8). An expert's rows fill whole blocks of the large size, and its
    remainder (rounded up to the small size) up to three blocks of the small size: padding stays below the small size
    per expert, while most rows still go through the large, efficient matmuls. (With one size of 64 at 512 tokens ×
    top-4 of 32 experts, 3,008 rows were computed for 2,048 routed; with 64/16, 2,304.) Two sizes rather than the
    three of 64/32/16, which pad the same: each size is one more scan (and, under autodiff, one more backward loop)
    to compile — that MoE layer compiled in 1.4 instead of 2.0 s and ran as fast, 16 ms (benchmarks/moe_blocks.py)."""
    block = int(min(128, max(8, 1 << max(0, (-(-slots // num_experts) - 1).bit_length()))))
    return (block, max(8, block // 4)) if block > 8 else (block,)


def _block_layout(idx: jnp.ndarray, num_experts: int, sizes: tuple[int, ...] | None = None
                  ) -> tuple[tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray], ...]:
    """Expert-aligned row blocks (vLLM's ``moe_align_block_size``) in two sizes (:func:`block_sizes`): token-slots
    sorted by expert; each expert's run, padded to a multiple of the small size, is cut into whole blocks of the large
    size and then blocks of the small size for the rest.

    ``sizes``: other block sizes, descending powers of two (benchmarks compare layouts): whole blocks of the first,
    at most one block of each middle size, the rest in blocks of the last.

    Returns one ``(rows [nb·block], blk_expert [nb], used)`` per size: the token-slot of each row (−1: padding), the
    expert owning each block, and how many leading blocks hold rows (int32 scalar). ``nb`` is a static bound; the
    blocks past ``used`` are empty.
    """
    n, k = idx.shape
    s = n * k
    sizes_b = block_sizes(s, num_experts) if sizes is None else tuple(sizes)
    if any(b < 1 or b & (b - 1) for b in sizes_b) or list(sizes_b) != sorted(set(sizes_b), reverse=True):
        raise ValueError(f"block sizes must be descending powers of two, got {sizes_b}")
    unit = sizes_b[-1]
    flat = idx.reshape(-1)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped slots: sorted last, no row
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    e_sorted = gather(flat, order)
    e_safe = jnp.minimum(e_sorted, num_experts - 1)
    local = jnp.arange(s) - gather(jnp.cumsum(sizes) - sizes, e_safe)  # a slot's place in its expert's run
    # block sizes are powers of two and every count here is ≥ 0: rounding by masks and shifts, not jnp's floor
    # division, whose sign fix-ups made the layout take a third longer to compile
    rest = (sizes + (unit - 1)) & -unit  # rows each expert still has to place, padding included
    skip = jnp.zeros_like(sizes)  # rows of each expert's run placed in larger blocks
    out = []
    for i, block in enumerate(sizes_b):
        # static bounds, at least one block so every scan has a step (with one expert and 17–24 slots no expert fills
        # a 32-row block): the rows padded to the small size, cut into these blocks; for the small size also
        # (large / small − 1) blocks per expert at most, what is left under one large block
        nb = max(1, (s + num_experts * (unit - 1)) // block)
        if i == 0:
            n_take = rest & -block
        elif i < len(sizes_b) - 1:
            n_take, nb = jnp.where(rest >= block, block, 0), min(nb, num_experts)
        else:
            n_take = rest
            nb = min(nb, num_experts * (sizes_b[i - 1] // block - 1))
        ends = jnp.cumsum(n_take)
        starts = ends - n_take
        skip_e = gather(skip, e_safe)
        mine = (e_sorted < num_experts) & (local >= skip_e) & (local < skip_e + gather(n_take, e_safe))
        dest = jnp.where(mine, gather(starts, e_safe) + local - skip_e, nb * block)
        rows = jnp.full((nb * block,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
        # compare_all: an [nb, E] comparison, which compiles to one fusion where the default binary search is a loop
        blk_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * block, side="right", method="compare_all"),
                                 num_experts - 1)
        used = jnp.right_shift(ends[-1], block.bit_length() - 1)
        out.append((rows, blk_expert.astype(jnp.int32), used.astype(jnp.int32)))
        rest, skip = rest - n_take, skip + n_take
    return tuple(out)


def _swiglu_block(xb, w_gu, w_dn):
    """One expert on a block of rows: ``xb [T, H]``, ``w_gu [2I, H]``, ``w_dn [H, I]`` → ``[T, H]`` (accum dtype)."""
    gu = _dot_out_in(xb, w_gu, "th,oh->to").astype(xb.dtype)
    inter = gu.shape[-1] // 2
    act = (silu(gu[:, :inter]) * gu[:, inter:]).astype(xb.dtype)
    return _dot_out_in(act, w_dn, "ti,hi->th")


Blocks = tuple[tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray], ...]  # per block size: (token, blk_expert, used)


def _scan_blocks(x, blocks: Blocks, gate_up: WeightFn, down: WeightFn) -> tuple[jnp.ndarray, ...]:
    """Per block size, ``[nb·block, H]``: block b's rows ``x[token[b·block:(b+1)·block]]`` through expert
    ``blk_expert[b]``, one block per scan step; a ``lax.cond`` skips the blocks past ``used`` (zeros)."""
    h = x.shape[1]
    outs = []
    for token, blk_expert, used in blocks:
        nb = blk_expert.shape[0]
        block = token.shape[0] // nb

        # (the closures below are traced at once, inside this iteration: no late binding of the loop variables)
        def run(b):
            e = take(blk_expert, b)
            return _swiglu_block(gather(x, jax.lax.dynamic_slice_in_dim(token, b * block, block)), gate_up(e), down(e))

        def step(carry, b):
            return carry, jax.lax.cond(b < used, run, lambda b: jnp.zeros((block, h), accum_dtype(x.dtype)), b)

        outs.append(jax.lax.scan(step, None, jnp.arange(nb, dtype=jnp.int32))[1].reshape(nb * block, h))
    return tuple(outs)


@jax.custom_vjp
def _scan_blocks_dense(x, blocks: Blocks, w_gu, w_dn):
    """:func:`_scan_blocks` for dense stacks ``w_gu [E, 2I, H]``, ``w_dn [E, H, I]`` (each step reads its expert as
    a view), with its own backward pass. JAX's derivative of the scan adds each step's weight gradient into a zero
    ``[E, 2I, H]`` stack and sums the stacks (cost ∝ blocks × E: an AutoRound iteration of the ``mid`` layer at 32
    experts took 993 instead of 551 ms); here a loop over the used blocks adds each block's gradient into its
    expert's slice in place, and the other blocks cost nothing."""
    return _scan_blocks(x, blocks, lambda e: take(w_gu, e), lambda e: take(w_dn, e))


def _scan_blocks_dense_fwd(x, blocks, w_gu, w_dn):
    return _scan_blocks_dense(x, blocks, w_gu, w_dn), (x, blocks, w_gu, w_dn)


def _scan_blocks_dense_bwd(res, gs):
    x, blocks, w_gu, w_dn = res
    h = x.shape[1]
    acc = accum_dtype(x.dtype)
    d_gu, d_dn, dx = jnp.zeros(w_gu.shape, acc), jnp.zeros(w_dn.shape, acc), jnp.zeros(x.shape, acc)
    for (token, blk_expert, used), g in zip(blocks, gs):
        nb = blk_expert.shape[0]
        block = token.shape[0] // nb
        g = g.reshape(nb, block, h)

        def body(b, carry):
            d_gu, d_dn, dxs = carry
            e = take(blk_expert, b)
            w_gu_e, w_dn_e = take(w_gu, e), take(w_dn, e)
            rows = jax.lax.dynamic_slice_in_dim(token, b * block, block)
            _, vjp = jax.vjp(_swiglu_block, gather(x, rows), w_gu_e, w_dn_e)
            dxb, dgu_e, ddn_e = vjp(take(g, b))

            def add(d, v):
                return put(d, e, take(d, e) + v.astype(acc))

            return add(d_gu, dgu_e), add(d_dn, ddn_e), put(dxs, b, dxb)

        # a while loop over the used blocks only (reverse mode never differentiates this backward pass); the weight
        # gradients run through every block size's loop, so no second E-sized stack is summed
        d_gu, d_dn, dxs = jax.lax.fori_loop(0, used, body, (d_gu, d_dn, jnp.zeros((nb, block, h), acc)))
        dx = dx.at[token].add(dxs.reshape(nb * block, h))
    return dx.astype(x.dtype), None, d_gu.astype(w_gu.dtype), d_dn.astype(w_dn.dtype)


_scan_blocks_dense.defvjp(_scan_blocks_dense_fwd, _scan_blocks_dense_bwd)


def experts_blocked(x, idx, weights, gate_up: WeightFn | jnp.ndarray, down: WeightFn | jnp.ndarray,
                    num_experts: int, sizes: tuple[int, ...] | None = None):
    """Routed experts over row blocks, each block owned by one expert, one block per scan step.

    Token-slots are sorted by expert into expert-aligned blocks of a few sizes (:func:`_block_layout`); a
    ``lax.scan`` per size visits the blocks, each step slicing its expert's matrices (a view; quantized experts are
    dequantized one at a time) for two ``[block, ·]`` matmuls, and only the blocks holding rows are computed. So the
    cost follows the routed token-slots, not the expert count, and no ``[blocks, 2I, H]`` copy of gathered weights is
    made (the batched form of the same blocks took 76 vs 43 ms for one MoE layer at 512 tokens × 32 experts on CPU;
    RESULTS.md, issue 24). On CPU this is also much faster than ``ragged_dot`` (which XLA:CPU runs as a dense loop).
    Same contract as :func:`experts_gather`; ``gate_up``/``down`` may also be the dense ``[E, …]`` stacks
    themselves, which makes the weights' gradient cost ∝ routed rows too (:func:`_scan_blocks_dense`).
    ``sizes``: the layout's block sizes (default :func:`block_sizes`; see :func:`_block_layout`).
    """
    n, k = idx.shape
    layout = _block_layout(idx, num_experts, sizes)
    blocks = tuple((jax.lax.div(jnp.maximum(rows, 0), jnp.int32(k)), blk_expert, used)
                   for rows, blk_expert, used in layout)
    if callable(gate_up) or callable(down):
        outs = _scan_blocks(x, blocks, as_weight_fn(gate_up), as_weight_fn(down))
    else:
        outs = _scan_blocks_dense(x, blocks, gate_up, down)
    acc_dtype = accum_dtype(x.dtype)
    y = jnp.zeros((n, x.shape[1]), acc_dtype)
    for (rows, _, _), (token, _, _), out in zip(layout, blocks, outs):
        w = jnp.where(rows >= 0, gather(weights.reshape(-1), jnp.maximum(rows, 0)).astype(acc_dtype), 0.0)
        y = y.at[token].add(out * w[:, None])
    return y


def as_weight_fn(w: WeightFn | jnp.ndarray) -> WeightFn:
    """A :data:`WeightFn` of a dense ``[E, out, in]`` stack (a WeightFn is returned as it is)."""
    if callable(w):
        return w
    return lambda sel: w if sel is None else gather(w, sel)


def routed_experts(x, idx, weights, gate_up: WeightFn | jnp.ndarray, down: WeightFn | jnp.ndarray, *,
                   num_experts: int):
    """Dispatch on the static token count: gather when the token-slots touch fewer matrices than exist, else
    expert-aligned blocks. An id outside ``[0, num_experts)`` drops its slot (adds nothing): expert parallelism
    passes the experts of other devices so. ``gate_up``/``down``: :data:`WeightFn` s or dense ``[E, …]`` stacks."""
    if idx.shape[0] * idx.shape[1] <= num_experts:
        return experts_gather(x, idx, weights, as_weight_fn(gate_up), as_weight_fn(down), num_experts)
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
    if gu_meta.fmt == dn_meta.fmt == "dense" and offset is None:
        gu, dn = gate_up[0], down[0]  # the stacks themselves: their gradient then follows the routed rows too
    else:
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
