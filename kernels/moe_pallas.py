"""Pallas (Triton backend) routed-expert MoE with packed weights: the GPU twin of :func:`.moe_reference.moe_experts`.

Same contract as the reference: ``moe_experts_pallas(x, idx, weights, gate_up, down) → [N, H] float32``.

Pipeline (vLLM ``fused_moe`` / ``moe_align_block_size`` style; docs/kernels.md §7.3, §10.4):

1. *Align* (plain JAX): the ``S = N·k`` token-slots are grouped by expert (stable: slot order kept inside an
   expert) and each expert's run is padded to a multiple of the M-block ``bm``, so every M-block of the padded row
   space belongs to exactly one expert and empty experts own no block.  Arrays: ``blk_expert [B]`` (expert of each
   M-block, −1 for blocks past the used rows: those programs return at once), ``row_slot [R]`` (token-slot
   ``n·k + j`` of each padded row, ``S`` on padding rows, which the kernels mask to zero) and ``slot_row [N, k]``
   (padded row of each slot).  ``B = ⌊(S + min(E, S)·(bm − 1)) / bm⌋`` is a static bound on the M-blocks,
   ``R = B·bm``.  One token (batch-1 decode, launch-bound): block j is slot j and nothing is sorted (one fused
   elementwise op).  Up to 1024 slots the alignment is compares + reductions only (no sort, no scatter: 7 small XLA
   kernels at decode); beyond, a stable argsort + bincount + two scatters.
2. *gate_up kernel*, grid ``(B, ⌈I/bn⌉)``: program (b, j) gathers the ``bm`` token rows of block b, streams K = H in
   ``bk`` chunks (token = slot // k), dequantizes the gate rows ``j·bn + [0, bn)`` and the up rows
   ``I + j·bn + [0, bn)`` of the block's expert in registers and accumulates both dots in fp32; epilogue
   ``silu(gate)·up`` rounded to x.dtype exactly as the reference's elementwise chain → ``act [R, I]``.
3. *down kernel*, grid ``(B, ⌈H/bn⌉)``: ``act`` rows of block b × dequantized down rows, K = I; epilogue multiplies
   by the row's routing weight (``weights.flat[slot]``) → ``y [R, H]`` fp32.
4. *Combine* (plain JAX): ``out[n] = Σ_k y[slot_row[n, k]]`` (a gather + sum: deterministic, no atomics, padding
   rows never read).

Dequantization happens in registers right before each dot and rounds exactly like :func:`.qmatmul_reference.dequantize`:
fp32 ``(q − zp)·scale`` → ``meta.scale_dtype`` (bf16 for MXFP8) → x.dtype.  Ints are unpacked from int32 words with
logical shifts and masks (LSB first); MXFP8 scales (E8M0 bytes) become ``2^(s−127)`` by bit-casting ``s << 23``
(s = 255 → +inf as ``ldexp`` gives; s = 0 → the subnormal 2^−127, bits ``0x00400000``).

All in-kernel indexing is gather-style (integer index arrays built from iota, never ``pl.ds``): the Triton lowering
turns them into the same pointer arithmetic as slices (make_range + splat: contiguity along the last dim stays
visible to Triton's axis analysis), while interpret mode — which cannot mix array and slice indexers — turns them
into clamped gathers whose out-of-range positions the masks (with ``other=``) replace.  All tensors inside the
kernels have power-of-two shapes; odd H / I / group sizes are handled by masks.

Unquantized experts (``fmt="dense"``, :func:`.quant_meta.dense_meta`: the weight stack itself, no scales) take the
same kernels, the tile loaded as it is instead of dequantized: the BF16 model's experts run fused like packed ones.

Gradients: ``jax.custom_vjp`` with the backward through the plain-JAX reference (cotangents for ``x``, the routing
``weights`` and dense expert weights; none for ids or packed weights).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import moe_reference
from .quant_meta import QuantMeta, dense_meta

__all__ = ["MoEConfig", "lowering_cases", "moe_config", "moe_experts_pallas", "moe_routed_pallas",
           "routes_inside"]

_E8M0_ZERO_BITS = 0x00400000  # fp32 bits of 2^-127 (subnormal): E8M0 code 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------------------------
# Static configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of one call (all powers of two)."""

    bm: int  # rows (token-slots) per M-block; every M-block belongs to one expert
    gu_bn: int  # gate_up: output columns per program (of gate and of up each)
    gu_bk: int  # gate_up: K (= H) chunk
    dn_bn: int  # down: output columns (of H) per program
    dn_bk: int  # down: K (= I) chunk
    num_warps: int = 4
    num_stages: int = 2


def _bk_for(k: int, meta: QuantMeta, want: int) -> int:
    """K chunk: a power of two ≥ 16 (tl.dot) and ≥ the values per int32 word, ≤ ``want`` unless K is smaller."""
    floor = max(16, meta.pack_factor if meta.fmt == "int" else 1)
    return max(floor, min(want, _next_pow2(k)))


def moe_config(num_slots: int, num_experts: int, hidden: int, inter: int, gu_meta: QuantMeta,
               dn_meta: QuantMeta) -> MoEConfig:
    """Tiles for ``num_slots = N·k`` token-slots.

    ``bm`` follows the mean rows per expert (×2 for the binomial spread): 16 at decode (``tl.dot`` needs M ≥ 16),
    32 for a 512-token prefill of the 256-expert model, 64 for long prefills.  Decode uses narrower gate_up tiles
    so that a single token's 8 experts still spread over ~128 programs.
    """
    bm = min(64, max(16, _next_pow2(-(-2 * num_slots // num_experts))))
    decode = bm == 16
    gu_bn = max(16, min(32 if decode else 64, _next_pow2(inter)))
    dn_bn = max(16, min(64, _next_pow2(hidden)))
    return MoEConfig(bm=bm, gu_bn=gu_bn, gu_bk=_bk_for(hidden, gu_meta, 128), dn_bn=dn_bn,
                     dn_bk=_bk_for(inter, dn_meta, 128), num_warps=8 if bm >= 64 else 4, num_stages=2)


# ----------------------------------------------------------------------------------------------------------------
# In-kernel dequantization
# ----------------------------------------------------------------------------------------------------------------


def _and(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return jnp.logical_and(a, b)


def _full_mask(mask, shape):
    return None if mask is None else jnp.broadcast_to(mask, shape)


def _group_values(ref, e, rows, row_mask, kk, *, meta: QuantMeta, bk: int, convert: Callable):
    """Per-(row, group) values (scales or zero points) of K chunk ``kk``, broadcastable against ``[bn, bk]``.

    ``ref`` is ``[E, N or 1, G]``; ``convert`` maps the loaded raw values (``[bn, ·]``) to fp32 before expansion.
    """
    bn = rows.shape[0]
    n_groups = ref.shape[2]
    gs = meta.group_size
    srows = rows if ref.shape[1] > 1 else jnp.zeros_like(rows)
    srow_mask = row_mask if ref.shape[1] > 1 else None
    if n_groups == 1 or gs % bk == 0:  # the chunk lies inside one group: one value per row
        g = jnp.zeros((), jnp.int32) if n_groups == 1 else lax.div(kk, jnp.int32(gs // bk))
        mask = _full_mask(None if srow_mask is None else srow_mask[:, None], (bn, 1))
        v = plgpu.load(ref.at[e, srows[:, None], g], mask=mask, other=None if mask is None else 0)
        return convert(v)  # [bn, 1]
    if bk % gs == 0 and gs & (gs - 1) == 0:  # whole power-of-two groups per chunk
        ng = bk // gs
        gcols = kk * ng + lax.iota(jnp.int32, ng)
        gmask = None if n_groups % ng == 0 else gcols < n_groups
        mask = _full_mask(_and(None if srow_mask is None else srow_mask[:, None],
                               None if gmask is None else gmask[None, :]), (bn, ng))
        v = convert(plgpu.load(ref.at[e, srows[:, None], gcols[None, :]], mask=mask,
                               other=None if mask is None else 0))  # [bn, ng]
        return jnp.broadcast_to(v[:, :, None], (bn, ng, gs)).reshape(bn, bk)
    # generic (odd group sizes): one gathered value per column
    cols = kk * bk + lax.iota(jnp.int32, bk)
    gcols = lax.div(cols, jnp.int32(gs))
    mask = _full_mask(_and(None if srow_mask is None else srow_mask[:, None], (gcols < n_groups)[None, :]), (bn, bk))
    return convert(plgpu.load(ref.at[e, srows[:, None], gcols[None, :]], mask=mask, other=0))


def _e8m0_to_f32(s):
    """E8M0 bytes → fp32 ``2^(s − 127)`` (bit-exact with ``ldexp``: 0 → 2^−127 subnormal, 255 → +inf)."""
    b = s.astype(jnp.int32)
    bits = jnp.where(b == 0, jnp.int32(_E8M0_ZERO_BITS), lax.shift_left(b, jnp.int32(23)))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _dequant_tile(packed_ref, scale_ref, zero_ref, e, rows, row_mask, kk, *, meta: QuantMeta, bk: int, dtype):
    """Rows ``rows`` (``[bn]`` int32, of the out dim) × K chunk ``kk`` of expert ``e`` → ``[bn, bk]`` ``dtype``."""
    bn = rows.shape[0]
    k = meta.in_features
    cols = kk * bk + lax.iota(jnp.int32, bk)
    col_mask = None if k % bk == 0 else cols < k
    if meta.fmt == "dense":  # unquantized weights: the tile itself
        mask = _full_mask(_and(None if row_mask is None else row_mask[:, None],
                               None if col_mask is None else col_mask[None, :]), (bn, bk))
        w = plgpu.load(packed_ref.at[e, rows[:, None], cols[None, :]], mask=mask,
                       other=None if mask is None else 0).astype(dtype)
    elif meta.fmt == "int":
        bits, pack = meta.bits, meta.pack_factor
        bkw = bk // pack
        n_words = packed_ref.shape[2]
        wcols = kk * bkw + lax.iota(jnp.int32, bkw)
        wmask = _full_mask(_and(None if row_mask is None else row_mask[:, None],
                                None if n_words % bkw == 0 else (wcols < n_words)[None, :]), (bn, bkw))
        words = plgpu.load(packed_ref.at[e, rows[:, None], wcols[None, :]], mask=wmask,
                           other=None if wmask is None else 0)  # [bn, bkw] int32
        shifts = lax.broadcasted_iota(jnp.int32, (bn, bkw, pack), 2) * bits
        fields = lax.shift_right_logical(jnp.broadcast_to(words[:, :, None], (bn, bkw, pack)), shifts)
        q = (fields & ((1 << bits) - 1)).reshape(bn, bk) - (1 << (bits - 1))
        w = q.astype(jnp.float32)
        if zero_ref is not None:
            w = w - _group_values(zero_ref, e, rows, row_mask, kk, meta=meta, bk=bk,
                                  convert=lambda z: z.astype(jnp.float32))
        w = w * _group_values(scale_ref, e, rows, row_mask, kk, meta=meta, bk=bk,
                              convert=lambda s: s.astype(jnp.float32))
        w = w.astype(jnp.dtype(meta.scale_dtype)).astype(dtype)
    else:  # mxfp8: E4M3 values, E8M0 scale per 32 columns
        mask = _full_mask(_and(None if row_mask is None else row_mask[:, None],
                               None if col_mask is None else col_mask[None, :]), (bn, bk))
        v = plgpu.load(packed_ref.at[e, rows[:, None], cols[None, :]], mask=mask).astype(jnp.float32)
        if mask is not None:  # no `other=` for fp8 loads (Triton lowering cannot cast an int constant to f8)
            v = jnp.where(mask, v, 0.0)
        s = _group_values(scale_ref, e, rows, row_mask, kk, meta=meta, bk=bk, convert=_e8m0_to_f32)
        w = (v * s).astype(jnp.bfloat16).astype(dtype)
    if col_mask is not None:  # columns past K: exact zeros whatever the padding bits / scales hold
        w = jnp.where(col_mask[None, :], w, jnp.zeros((), dtype))
    return w


def _silu_mul(acc_g, acc_u, dtype):
    """``silu(gate) · up`` rounded like the reference's x.dtype chain.

    The reference (:func:`.precision.silu`) rounds gate and up to x.dtype, computes ``g / (1 + exp(−g))`` in fp32
    and rounds it once, then multiplies by up with one rounding to x.dtype (all no-ops for fp32) — torch's bf16 chain.
    """
    def rnd(v):
        return v.astype(dtype).astype(jnp.float32)

    g = rnd(acc_g)
    u = rnd(acc_u)
    return (rnd(g / (1.0 + jnp.exp(-g))) * u).astype(dtype)


def _dot_nt(a, w):
    """``a [m, k] · w [n, k]ᵀ`` → fp32 ``[m, n]`` (IEEE fp32 when a is fp32: Triton's default would be TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


def _pick_slot(logits_ref, offset_ref, b, top_k: int, dtype=None):
    """Slot ``b``'s expert (+ the layer's offset in a stack) and, given ``dtype``, its routing weight in fp32, from
    one token's router logits ``logits_ref [1, E]`` — :func:`.moe_reference.route` computed inside the kernel.

    Every program recomputes the softmax over the E logits and the top-k (k argmax rounds over E values: a few
    hundred flops) instead of reading them from XLA's softmax / sort / select kernels: at batch-1 decode, which is
    launch-bound, that removes three launches per MoE layer. As the reference: softmax in fp32 (``exp(l − max) /
    Σ``), the k largest probabilities, ties to the lower expert id (``lax.top_k``), the weight renormalised over
    the k and rounded to ``dtype`` (the logits' dtype).
    """
    num_experts = logits_ref.shape[1]
    ep = _next_pow2(num_experts)
    cols = lax.iota(jnp.int32, ep)
    inside = cols < num_experts
    logits = plgpu.load(logits_ref.at[0, cols], mask=None if ep == num_experts else inside,
                        other=None if ep == num_experts else 0).astype(jnp.float32)
    logits = jnp.where(inside, logits, -jnp.inf)
    u = jnp.exp(logits - jnp.max(logits))
    left = jnp.where(inside, u / jnp.sum(u), -1.0)  # probabilities ≥ 0: −1 marks a taken or absent expert
    total = jnp.zeros((), jnp.float32)
    expert = jnp.zeros((), jnp.int32)
    prob = jnp.zeros((), jnp.float32)
    for j in range(top_k):  # static: k rounds of argmax (lowest id among equals)
        best = jnp.max(left)
        pick = jnp.min(jnp.where(left == best, cols, ep))
        total = total + best
        expert = jnp.where(b == j, pick, expert)
        prob = jnp.where(b == j, best, prob)
        left = jnp.where(cols == pick, -1.0, left)
    expert = expert + offset_ref[0]
    if dtype is None:
        return expert, None
    return expert, (prob / total).astype(dtype).astype(jnp.float32)


def _per_slot_rows(b, bm: int, num_slots: int):
    """The token-slot of each row of block ``b`` in the per-slot layout (:func:`_align`): row 0 is slot b, the other
    rows padding (``num_slots``)."""
    return jnp.where(lax.iota(jnp.int32, bm) == 0, b, num_slots)


def _weight_refs(refs, has_zero: bool, dense: bool):
    """``(packed, scale, zero)`` refs from the tail of a kernel's weight refs (a dense weight has neither scale nor
    zero)."""
    if dense:
        return refs[0], None, None
    return refs[0], refs[1], refs[2] if has_zero else None


def _gate_up_kernel(*refs, meta: QuantMeta, has_zero: bool, cfg: MoEConfig, inter: int, top_k: int,
                    routed: bool = False):
    route_ref, row_ref, x_ref, *weight_refs, act_ref = refs
    packed_ref, scale_ref, zero_ref = _weight_refs(weight_refs, has_zero, meta.fmt == "dense")
    num_slots = x_ref.shape[0] * top_k
    bm, bn, bk = cfg.bm, cfg.gu_bn, cfg.gu_bk
    hidden = x_ref.shape[1]
    dtype = x_ref.dtype
    b = pl.program_id(0)
    j = pl.program_id(1)
    e = _pick_slot(route_ref, row_ref, b, top_k)[0] if routed else route_ref[b]

    @pl.when(e >= 0)
    def _():
        rows = b * bm + lax.iota(jnp.int32, bm)
        slot = _per_slot_rows(b, bm, num_slots) if routed else plgpu.load(row_ref.at[rows])  # num_slots: padding
        valid = (slot < num_slots)[:, None]
        tok = lax.div(slot, jnp.int32(top_k))
        ncols = j * bn + lax.iota(jnp.int32, bn)
        nmask = None if inter % bn == 0 else ncols < inter

        def body(kk, carry):
            kk = kk.astype(jnp.int32)  # int64 under JAX's x64 mode
            acc_g, acc_u = carry
            cols = kk * bk + lax.iota(jnp.int32, bk)
            xmask = jnp.broadcast_to(valid if hidden % bk == 0 else valid & (cols < hidden)[None, :], (bm, bk))
            xt = plgpu.load(x_ref.at[tok[:, None], cols[None, :]], mask=xmask, other=0)  # padding rows: 0
            deq = functools.partial(_dequant_tile, packed_ref, scale_ref, zero_ref, e, row_mask=nmask, kk=kk,
                                    meta=meta, bk=bk, dtype=dtype)
            acc_g = acc_g + _dot_nt(xt, deq(rows=ncols))
            acc_u = acc_u + _dot_nt(xt, deq(rows=ncols + inter))
            return acc_g, acc_u

        zeros = jnp.zeros((bm, bn), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, pl.cdiv(hidden, bk), body, (zeros, zeros))
        act = _silu_mul(acc_g, acc_u, dtype)
        smask = None if nmask is None else jnp.broadcast_to(nmask[None, :], (bm, bn))
        plgpu.store(act_ref.at[rows[:, None], ncols[None, :]], act, mask=smask)


def _down_kernel(*refs, meta: QuantMeta, has_zero: bool, cfg: MoEConfig, top_k: int, routed: bool = False):
    route_ref, row_ref, weights_ref, act_ref, *weight_refs, y_ref = refs
    packed_ref, scale_ref, zero_ref = _weight_refs(weight_refs, has_zero, meta.fmt == "dense")
    num_slots = top_k if routed else weights_ref.shape[0]
    bm, bn, bk = cfg.bm, cfg.dn_bn, cfg.dn_bk
    inter = act_ref.shape[1]
    hidden = y_ref.shape[1]
    b = pl.program_id(0)
    j = pl.program_id(1)
    if routed:  # weights_ref: the router logits' dtype (the reference rounds the weights to it), never read
        e, slot_weight = _pick_slot(route_ref, row_ref, b, top_k, weights_ref.dtype)
    else:
        e = route_ref[b]

    @pl.when(e >= 0)
    def _():
        rows = b * bm + lax.iota(jnp.int32, bm)
        hcols = j * bn + lax.iota(jnp.int32, bn)
        hmask = None if hidden % bn == 0 else hcols < hidden

        def body(kk, acc):
            kk = kk.astype(jnp.int32)  # int64 under JAX's x64 mode
            cols = kk * bk + lax.iota(jnp.int32, bk)
            amask = None if inter % bk == 0 else jnp.broadcast_to((cols < inter)[None, :], (bm, bk))
            a = plgpu.load(act_ref.at[rows[:, None], cols[None, :]], mask=amask,
                           other=None if amask is None else 0)
            w = _dequant_tile(packed_ref, scale_ref, zero_ref, e, hcols, hmask, kk, meta=meta, bk=bk,
                              dtype=act_ref.dtype)
            return acc + _dot_nt(a, w)

        acc = lax.fori_loop(0, pl.cdiv(inter, bk), body, jnp.zeros((bm, bn), jnp.float32))
        if routed:
            rw = jnp.where(lax.iota(jnp.int32, bm) == 0, slot_weight, 0.0)  # row 0 holds the slot; 0 on padding
        else:
            slot = plgpu.load(row_ref.at[rows])
            rw = plgpu.load(weights_ref.at[slot], mask=slot < num_slots, other=0).astype(jnp.float32)
        smask = None if hmask is None else jnp.broadcast_to(hmask[None, :], (bm, bn))
        plgpu.store(y_ref.at[rows[:, None], hcols[None, :]], acc * rw[:, None], mask=smask)


# ----------------------------------------------------------------------------------------------------------------
# Routing alignment and the forward pass
# ----------------------------------------------------------------------------------------------------------------


def _num_blocks(num_slots: int, num_experts: int, bm: int) -> int:
    """Static bound on Σ_e ⌈count_e / bm⌉ (at most min(E, S) experts are non-empty)."""
    return (num_slots + min(num_experts, num_slots) * (bm - 1)) // bm


_DENSE_ALIGN_MAX_SLOTS = 1024  # up to here the compare-based alignment (no sort, no scatter) is used


def _align(idx, num_experts: int, bm: int, *, dense: bool | None = None, per_slot: bool | None = None):
    """Sort token-slots by expert and pad each expert's run to a multiple of ``bm`` (``moe_align_block_size``).

    Returns ``blk_expert [B]`` (−1 past the used blocks), ``row_slot [R]`` (slot of each padded row, ``S`` on
    padding) and ``slot_row [N, k]`` (padded row of each slot, ``≥ R`` for a dropped slot: an id outside
    ``[0, E)``); within an expert the slots keep their order.

    *per_slot* (default for one token, ``N = 1``; the block bound ``B`` is then exactly ``k``): block j is slot j
    (a token's top-k experts are distinct, so no expert needs two blocks), ``row_slot`` is a constant and
    ``blk_expert`` the ids themselves (−1 for a dropped slot): one fused elementwise op instead of the
    alignment's kernels, at batch-1 decode, which is launch-bound. The blocks are in slot order, not expert order.

    Two formulations with identical results: *dense* (``S ≤ 1024``, decode and short prefills) builds everything
    from compares and reductions over ``[S, S]`` / ``[R, S]`` / ``[B, E]`` — no sort, no scatter, so XLA fuses it
    into a handful of small kernels (decode is launch-bound); *sorted* (long prefills) uses a stable argsort and
    two scatters, O(S log S).
    """
    n, k = idx.shape
    s = n * k
    nb = _num_blocks(s, num_experts, bm)
    r = nb * bm
    flat = idx.reshape(-1).astype(jnp.int32)
    slots = jnp.arange(s, dtype=jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)  # ids outside [0, E) are dropped slots (expert parallelism)
    if per_slot is None:
        per_slot = n == 1 and nb == k
    if per_slot:
        if n != 1 or nb != k:
            raise ValueError(f"the per-slot layout needs one token and B = k blocks (got N={n}, k={k}, B={nb})")
        row_slot = np.full((k, bm), s, np.int32)
        row_slot[:, 0] = np.arange(k)
        return (jnp.where(valid, flat, -1), jnp.asarray(row_slot.reshape(-1)),
                jnp.where(valid, slots * bm, r).reshape(n, k))
    flat = jnp.where(valid, flat, num_experts)  # sorts after every expert, counted by none
    if dense is None:
        dense = s <= _DENSE_ALIGN_MAX_SLOTS
    if dense:
        counts = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :], axis=0,
                         dtype=jnp.int32)
    else:
        counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    padded = (counts + (bm - 1)) // bm * bm
    if dense:  # inclusive prefix sum as a masked reduction (a reduce fusion instead of XLA's reduce-window)
        experts = jnp.arange(num_experts, dtype=jnp.int32)
        pad_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], padded[None, :], 0), axis=1,
                          dtype=jnp.int32)
    else:
        pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    safe = jnp.minimum(flat, num_experts - 1)
    if dense:
        same_before = (flat[:, None] == flat[None, :]) & (slots[None, :] < slots[:, None])
        rank = jnp.sum(same_before, axis=1, dtype=jnp.int32)  # earlier slots of the same expert
        slot_row = jnp.where(valid, pad_start[safe] + rank, r)  # dropped slots: past every row
        hit = slot_row[None, :] == jnp.arange(r, dtype=jnp.int32)[:, None]  # [R, S], ≤ one hit per row
        row_slot = jnp.sum(jnp.where(hit, slots[None, :] - s, 0), axis=1, dtype=jnp.int32) + s
    else:
        cnt_start = jnp.cumsum(counts) - counts
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        e_sorted = flat[order]
        e_safe = jnp.minimum(e_sorted, num_experts - 1)
        # padded row of the i-th sorted slot; dropped slots (sorted last) get distinct rows past the end
        dest = jnp.where(e_sorted < num_experts, pad_start[e_safe] + slots - cnt_start[e_safe], r + slots)
        slot_row = jnp.zeros((s,), jnp.int32).at[order].set(dest, unique_indices=True)
        row_slot = jnp.full((r,), s, jnp.int32).at[dest].set(order, unique_indices=True, mode="drop")
    blk_start = jnp.arange(nb, dtype=jnp.int32) * bm
    blk_expert = jnp.sum(pad_end[None, :] <= blk_start[:, None], axis=1, dtype=jnp.int32)  # searchsorted, right
    blk_expert = jnp.where(blk_expert < num_experts, blk_expert, -1)  # blocks past the last used one
    return blk_expert, row_slot, slot_row.reshape(n, k)


def _compiler_params(cfg: MoEConfig):
    # explicit Triton params: with None, jax 0.10 picks Mosaic GPU and 0.11+ Triton (docs/kernels.md §3); jax ≥ 0.11
    # emits a DeprecationWarning (id jax-pallas-triton) for Triton pallas_calls — callers / tests filter it
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check(x, idx, weights, gate_up, down):
    gu_meta, dn_meta = gate_up[3], down[3]
    n, h = x.shape
    e = gate_up[0].shape[0]  # with an expert offset: every layer's experts, flattened
    inter = gu_meta.out_features // 2
    if gu_meta.in_features != h or dn_meta.out_features != h or dn_meta.in_features != inter:
        raise ValueError(f"MoE shapes disagree: x {x.shape}, gate_up meta {gu_meta}, down meta {dn_meta}")
    if idx.shape != weights.shape or idx.shape[0] != n:
        raise ValueError(f"idx {idx.shape} / weights {weights.shape} must both be [N={n}, k]")
    for name, (packed, scale, zero, meta) in (("gate_up", gate_up), ("down", down)):
        if packed.shape[:2] != (e, meta.out_features):
            raise ValueError(f"{name}: packed {packed.shape} is not [E={e}, {meta.out_features}, ·]")
        if meta.fmt == "dense":
            if scale is not None or zero is not None or packed.shape[2] != meta.in_features:
                raise ValueError(f"{name}: a dense weight is [E, {meta.out_features}, {meta.in_features}] with no "
                                 f"scale or zero, got {packed.shape}")
            continue
        if meta.fmt == "mxfp8" and zero is not None:
            raise ValueError(f"{name}: MXFP8 has no zero points")
        if meta.fmt == "int" and meta.bits not in (2, 4, 8):
            raise ValueError(f"{name}: unsupported bit width {meta.bits}")
        if scale.ndim != 3 or (zero is not None and zero.ndim != 3):
            raise ValueError(f"{name}: scale / zero must be [E, N or 1, G]")


def _kernels(cfg: MoEConfig, gu_meta: QuantMeta, dn_meta: QuantMeta, interpret: bool, top_k: int, nb: int,
             routing: tuple, weights, x, gu_arrays, dn_arrays, *, routed: bool):
    """The gate_up and down calls over ``nb`` M-blocks → ``y [nb·bm, H]`` fp32 (weighted rows). ``routing``:
    ``(blk_expert, row_slot)`` of an alignment, or (``routed``) ``(logits [1, E], offset [1])`` of one token."""
    inter = gu_meta.out_features // 2
    hidden = x.shape[1]
    rows = nb * cfg.bm
    gu_in = tuple(a for a in gu_arrays if a is not None)
    dn_in = tuple(a for a in dn_arrays if a is not None)
    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, meta=gu_meta, has_zero=gu_arrays[2] is not None, cfg=cfg, inter=inter,
                          top_k=top_k, routed=routed),
        out_shape=jax.ShapeDtypeStruct((rows, inter), x.dtype),
        grid=(nb, pl.cdiv(inter, cfg.gu_bn)),
        compiler_params=_compiler_params(cfg),
        interpret=interpret,
        name="qjax_moe_gate_up",
    )(*routing, x, *gu_in)
    return pl.pallas_call(
        functools.partial(_down_kernel, meta=dn_meta, has_zero=dn_arrays[2] is not None, cfg=cfg, top_k=top_k,
                          routed=routed),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
        grid=(nb, pl.cdiv(hidden, cfg.dn_bn)),
        compiler_params=_compiler_params(cfg),
        interpret=interpret,
        name="qjax_moe_down",
    )(*routing, weights, act, *dn_in)


def _forward(gu_meta: QuantMeta, dn_meta: QuantMeta, interpret: bool, config: MoEConfig | None, num_experts: int,
             x, idx, weights, offset, gu_arrays, dn_arrays):
    n, hidden = x.shape
    k = idx.shape[1]
    inter = gu_meta.out_features // 2
    cfg = config or moe_config(n * k, num_experts, hidden, inter, gu_meta, dn_meta)
    blk_expert, row_slot, slot_row = _align(idx, num_experts, cfg.bm)
    # the kernels index the weights with the block's expert: + offset reaches this layer's experts inside a stack
    # of several layers' (no copy of the layer's slice)
    blk_expert = jnp.where(blk_expert >= 0, blk_expert + offset, -1)
    nb = blk_expert.shape[0]
    rows = nb * cfg.bm
    y = _kernels(cfg, gu_meta, dn_meta, interpret, k, nb, (blk_expert, row_slot), weights.reshape(-1), x,
                 gu_arrays, dn_arrays, routed=False)
    # [N, k, H] → [N, H]; weights already applied in the down epilogue. Dropped slots point past the rows (unused
    # blocks are never written, so they are masked with where, not multiplied)
    kept = slot_row < rows
    return jnp.where(kept[..., None], y[jnp.minimum(slot_row, rows - 1)], 0.0).sum(axis=1)


def _forward_routed(gu_meta: QuantMeta, dn_meta: QuantMeta, interpret: bool, config: MoEConfig | None, top_k: int,
                    x, logits, offset, gu_arrays, dn_arrays):
    """One token routed inside the kernels (per-slot layout: block j = slot j, row 0 of each block)."""
    num_experts = logits.shape[1]
    inter = gu_meta.out_features // 2
    cfg = config or moe_config(top_k, num_experts, x.shape[1], inter, gu_meta, dn_meta)
    # the logits ride in the weights' place too: the down kernel rounds the slot weights to their dtype
    y = _kernels(cfg, gu_meta, dn_meta, interpret, top_k, top_k, (logits, offset.reshape(1)),
                 logits.reshape(-1), x, gu_arrays, dn_arrays, routed=True)
    return y.reshape(top_k, cfg.bm, -1)[:, 0].sum(axis=0, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _moe(gu_meta, dn_meta, interpret, config, num_experts, x, idx, weights, offset, gu_arrays, dn_arrays):
    return _forward(gu_meta, dn_meta, interpret, config, num_experts, x, idx, weights, offset, gu_arrays, dn_arrays)


def _moe_fwd(gu_meta, dn_meta, interpret, config, num_experts, x, idx, weights, offset, gu_arrays, dn_arrays):
    out = _forward(gu_meta, dn_meta, interpret, config, num_experts, x, idx, weights, offset, gu_arrays, dn_arrays)
    return out, (x, idx, weights, offset, gu_arrays, dn_arrays)


def _moe_bwd(gu_meta, dn_meta, interpret, config, num_experts, res, g):
    del interpret, config
    x, idx, weights, offset, gu_arrays, dn_arrays = res

    # dense (unquantized) expert weights are trainable and get their cotangent; packed ones get none
    gu_dense, dn_dense = gu_meta.fmt == "dense", dn_meta.fmt == "dense"

    def ref(x_, w_, *dense):
        gu0 = dense[0] if gu_dense else gu_arrays[0]
        dn0 = dense[-1] if dn_dense else dn_arrays[0]
        return moe_reference.moe_experts(x_, idx, w_, (gu0, *gu_arrays[1:], gu_meta), (dn0, *dn_arrays[1:], dn_meta),
                                         num_experts=num_experts, offset=offset)

    dense = ((gu_arrays[0],) if gu_dense else ()) + ((dn_arrays[0],) if dn_dense else ())
    _, vjp = jax.vjp(ref, x, weights, *dense)
    dx, dw, *d_dense = vjp(g)
    none = functools.partial(jax.tree.map, lambda _: None)
    gu_ct = (d_dense[0], None, None) if gu_dense else none(gu_arrays)
    dn_ct = (d_dense[-1], None, None) if dn_dense else none(dn_arrays)
    return dx, None, dw, None, gu_ct, dn_ct


_moe.defvjp(_moe_fwd, _moe_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _moe_routed(gu_meta, dn_meta, interpret, config, top_k, x, logits, offset, gu_arrays, dn_arrays):
    return _forward_routed(gu_meta, dn_meta, interpret, config, top_k, x, logits, offset, gu_arrays, dn_arrays)


def _moe_routed_fwd(gu_meta, dn_meta, interpret, config, top_k, x, logits, offset, gu_arrays, dn_arrays):
    out = _forward_routed(gu_meta, dn_meta, interpret, config, top_k, x, logits, offset, gu_arrays, dn_arrays)
    return out, (x, logits, offset, gu_arrays, dn_arrays)


def _moe_routed_bwd(gu_meta, dn_meta, interpret, config, top_k, res, g):
    """Through the reference routing and :func:`_moe_bwd` (the experts' backward)."""
    x, logits, offset, gu_arrays, dn_arrays = res
    num_experts = logits.shape[1]
    weights, idx = moe_reference.route(logits, top_k)
    dx, _, dw, _, gu_ct, dn_ct = _moe_bwd(gu_meta, dn_meta, interpret, config, num_experts,
                                         (x, idx, weights, offset, gu_arrays, dn_arrays), g)
    _, route_vjp = jax.vjp(lambda lg: moe_reference.route(lg, top_k)[0], logits)
    return dx, route_vjp(dw)[0], None, gu_ct, dn_ct


_moe_routed.defvjp(_moe_routed_fwd, _moe_routed_bwd)


def routes_inside(num_tokens: int) -> bool:
    """Whether :func:`moe_routed_pallas` routes inside the kernels for ``num_tokens`` tokens (one: batch-1 decode, the
    per-slot layout); otherwise it routes with :func:`.moe_reference.route` and calls :func:`moe_experts_pallas`."""
    return num_tokens == 1


def moe_routed_pallas(x, router_logits, top_k: int, gate_up: tuple, down: tuple, *, interpret: bool = False,
                      config: MoEConfig | None = None, expert_offset=None) -> jax.Array:
    """Routing (:func:`.moe_reference.route`: softmax, top-k, renormalised) and the routed experts → ``[N, H]`` fp32.

    ``router_logits [N, E]`` (E: this layer's experts; with ``expert_offset`` the weights hold several layers'
    experts flattened, as :func:`moe_experts_pallas`). One token (batch-1 decode, :func:`routes_inside`): each
    kernel program routes from the logits itself — no softmax / top-k kernels between the router and the experts.
    More tokens: the reference routing, then :func:`moe_experts_pallas`. Differentiable as
    :func:`moe_experts_pallas`, plus the logits (through the reference routing).
    """
    num_experts = router_logits.shape[1]
    offset = jnp.zeros((), jnp.int32) if expert_offset is None else jnp.asarray(expert_offset, jnp.int32)
    if not routes_inside(x.shape[0]):
        weights, idx = moe_reference.route(router_logits, top_k)
        return moe_experts_pallas(x, idx, weights, gate_up, down, interpret=interpret, config=config,
                                  num_experts=num_experts, expert_offset=expert_offset)
    if router_logits.shape[0] != x.shape[0] or not 0 < top_k <= num_experts:
        raise ValueError(f"router logits {router_logits.shape} / top_k {top_k} do not fit x {x.shape}")
    _check(x, jnp.zeros((1, top_k), jnp.int32), jnp.zeros((1, top_k), x.dtype), gate_up, down)
    return _moe_routed(gate_up[3], down[3], bool(interpret), config, int(top_k), x, router_logits, offset,
                       tuple(gate_up[:3]), tuple(down[:3]))


def moe_experts_pallas(x, idx, weights, gate_up: tuple, down: tuple, *, interpret: bool = False,
                       config: MoEConfig | None = None, num_experts: int | None = None,
                       expert_offset=None) -> jax.Array:
    """Routed SwiGLU experts with packed weights: ``Σ_k w_k · down_e(silu(gate_e x) · up_e x)`` → ``[N, H]`` fp32.

    Args:
      x: ``[N, H]`` activations (bf16 / fp16 / fp32).
      idx, weights: ``[N, k]`` expert ids (int32) and routing weights. An id outside ``[0, E)`` drops its slot: it
        adds nothing and costs no block (expert parallelism passes the other devices' experts so).
      gate_up: ``(packed, scale, zero, meta)`` of the stacked ``[E, 2I, H]`` weight (rows ``:I`` gate, ``I:`` up);
        unquantized: ``(w, None, None, dense_meta(2I, H, w.dtype))``.
      down: the same for ``[E, H, I]``.
      interpret: run the Pallas kernels in interpret mode (CPU).
      config: tile override (default :func:`moe_config`'s heuristic), e.g. ``num_stages=1`` if a Triton build
        trips over pipelining the bit-unpacking loop (triton-lang/triton#4906).
      num_experts, expert_offset: the weights hold several layers' experts flattened (``[G·E, …]``); this call's
        layer has ``num_experts`` E of them starting at ``expert_offset`` (an int32 scalar, may be traced). Ids stay
        in ``[0, E)``. Reading a layer inside the stack this way avoids copying its slice out (a scan over stacked
        layers would otherwise copy every expert of the layer on every step).
    Differentiable w.r.t. ``x``, ``weights`` and dense expert weights (backward through
    :func:`.moe_reference.moe_experts`).
    """
    _check(x, idx, weights, gate_up, down)
    gu_arrays = tuple(gate_up[:3])
    dn_arrays = tuple(down[:3])
    if config is not None:
        tiles = dataclasses.astuple(config)[:5]
        if any(t < 16 or t & (t - 1) for t in tiles):
            raise ValueError(f"MoE tiles must be powers of two ≥ 16: {config}")
    num_experts = gu_arrays[0].shape[0] if num_experts is None else int(num_experts)
    offset = jnp.zeros((), jnp.int32) if expert_offset is None else jnp.asarray(expert_offset, jnp.int32)
    return _moe(gate_up[3], down[3], bool(interpret), config, num_experts, x, idx.astype(jnp.int32), weights,
                offset, gu_arrays, dn_arrays)


# ----------------------------------------------------------------------------------------------------------------
# GPU lowering cases (the real Qwen3.6-35B-A3B MoE layer)
# ----------------------------------------------------------------------------------------------------------------

QWEN36_HIDDEN = 2048
QWEN36_INTER = 512
QWEN36_EXPERTS = 256
QWEN36_TOP_K = 8

_SCHEMES = {  # name: (fmt, bits, group, symmetric, scale dtype) as the real checkpoints store them (docs/formats.md §9)
    "int2_g64": ("int", 2, 64, True, "float16"),
    "int4_g128": ("int", 4, 128, False, "bfloat16"),  # asymmetric: exercises the zero-point path
    "int8_g32": ("int", 8, 32, True, "bfloat16"),
    "mxfp8": ("mxfp8", 8, 32, True, "uint8"),
    "bf16": ("dense", 16, 0, True, "bfloat16"),  # the unquantized (BF16 original) model's experts
}


def _weight_specs(meta: QuantMeta, num_experts: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    e, n = num_experts, meta.out_features
    if meta.fmt == "dense":
        return (jax.ShapeDtypeStruct((e, n, meta.in_features), jnp.dtype(meta.scale_dtype)),)
    if meta.fmt == "mxfp8":
        return (jax.ShapeDtypeStruct((e, n, meta.in_features), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((e, n, meta.num_groups), jnp.uint8))
    specs = (jax.ShapeDtypeStruct((e, n, meta.packed_cols), jnp.int32),
             jax.ShapeDtypeStruct((e, *meta.scale_shape), jnp.dtype(meta.scale_dtype)))
    if not meta.symmetric:
        specs += (jax.ShapeDtypeStruct((e, *meta.scale_shape), jnp.int8),)
    return specs


def lowering_cases() -> list[tuple[str, Callable, tuple[jax.ShapeDtypeStruct, ...]]]:
    """``(name, fn, arg_specs)`` for the Qwen3.6-35B-A3B MoE layer (H 2048, I 512, E 256, top-8, bf16) ×
    {int2 g64, int4 g128 asym, int8 g32, mxfp8, unquantized bf16} × {decode N = 1, 8; prefill N = 512; one token
    routed inside the kernels from its router logits (``*_routed_decode1``, ``fn(x, logits, *arrays)``)}.

    ``fn(x, idx, weights, *gate_up_arrays, *down_arrays)`` calls :func:`moe_experts_pallas` (``interpret=False``)
    with the metas closed over; ``gate_up_arrays`` is ``(packed, scale[, zero])``.
    """
    h, i, e, k = QWEN36_HIDDEN, QWEN36_INTER, QWEN36_EXPERTS, QWEN36_TOP_K
    cases = []
    for scheme, (fmt, bits, group, sym, sdt) in _SCHEMES.items():
        if fmt == "dense":
            gu_meta, dn_meta = dense_meta(2 * i, h, jnp.bfloat16), dense_meta(h, i, jnp.bfloat16)
        else:
            gu_meta = QuantMeta(fmt, bits, group, h, 2 * i, sym, "group", sdt)
            dn_meta = QuantMeta(fmt, bits, group, i, h, sym, "group", sdt)
        gu_specs, dn_specs = _weight_specs(gu_meta, e), _weight_specs(dn_meta, e)
        n_gu = len(gu_specs)

        def fn(x, idx, weights, *arrays, _gm=gu_meta, _dm=dn_meta, _ng=n_gu):
            gu, dn = arrays[:_ng], arrays[_ng:]
            gu = (*gu, None, None)[:3]
            dn = (*dn, None, None)[:3]
            return moe_experts_pallas(x, idx, weights, (*gu, _gm), (*dn, _dm), interpret=False)

        for label, n in (("decode1", 1), ("decode8", 8), ("prefill512", 512)):
            specs = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int32),
                     jax.ShapeDtypeStruct((n, k), jnp.bfloat16), *gu_specs, *dn_specs)
            cases.append((f"moe_{scheme}_{label}", fn, specs))

        def routed(x, logits, *arrays, _gm=gu_meta, _dm=dn_meta, _ng=n_gu):
            gu, dn = (*arrays[:_ng], None, None)[:3], (*arrays[_ng:], None, None)[:3]
            return moe_routed_pallas(x, logits, k, (*gu, _gm), (*dn, _dm), interpret=False)

        cases.append((f"moe_{scheme}_routed_decode1", routed,
                      (jax.ShapeDtypeStruct((1, h), jnp.bfloat16), jax.ShapeDtypeStruct((1, e), jnp.bfloat16),
                       *gu_specs, *dn_specs)))
    return cases
