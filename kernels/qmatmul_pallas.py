"""Pallas (Triton backend) dequant-matmul: ``x [..., K] @ dequant(W)ᵀ`` with the weight kept packed in HBM.

Same contract as :func:`kernels.qmatmul_reference.qmatmul` (the oracle), see that module for the weight formats:

- ``fmt == "int"``: ``packed`` int32 ``[N, ceil(K·b/32)]`` (b ∈ {2, 4, 8}, LSB first, +2^(b−1) offset), ``scale``
  ``[N, G]`` (groups of a power-of-two size, or ``G == 1`` for channel, or ``[1, 1]`` for tensor), optional
  ``zero`` int8 ``[N, G]``;
- ``fmt == "mxfp8"``: ``packed`` float8_e4m3fn ``[N, K]``, ``scale`` uint8 E8M0 ``[N, K/32]``;
- ``fmt == "dense"`` (:func:`matmul_pallas`): an unquantized float weight ``[N, K]``, no scale. It exists for one
  reason: XLA's dot takes a layer sliced out of a ``[G, N, K]`` stack as a copy, while this kernel reads it in
  place (``layer=``), so the model's layer scan does not copy its BF16 projections on every decode step.

Each weight element is dequantized in fp32 registers right before the MMA — ``(q − zp)·scale`` (MXFP8:
``w·2^(s−127)``) — rounded once to ``meta.scale_dtype`` (bf16 for MXFP8), cast to ``x.dtype``; products accumulate
in fp32 and the output has ``x.dtype``.

Two paths, chosen statically from the (static) shapes, one kernel body, grid ``(M/bm, N/bn, S)``:

- **GEMV path** (``M ≤ 16``): a single M block (M padded to 16 for the tensor-core dot; ``M == 1`` uses a
  multiply-and-row-reduce instead, no MMA padding), so every weight byte is streamed exactly once; split-K ``S > 1``
  when ``N/bn`` alone would leave most of the 132 SMs idle.
- **GEMM path** (prefill, ``M > 16``): ``bm × bn`` tiles, ``lax.fori_loop`` over K in ``bk`` chunks; tiles shrink
  and K is split (``S ≤ 4``) while the grid is below one wave.

Layer stacks (``layer=``, how the model's layer scan calls every projection): ``packed`` / ``scale`` / ``zero``
are ``[L, N, ·]`` and are passed whole, flattened to ``[L·N, ·]`` (a bitcast), with the layer index an ``int32[1]``
operand; the grid is one layer's ``(M/bm, N/bn, S)`` and each program adds ``layer·N`` to its row offset — a runtime
scalar in the pointer arithmetic, so each weight byte of the layer is still streamed once and nothing is copied
(Pallas-Triton has no scalar prefetch: a BlockSpec's block index cannot follow a runtime layer). A layer whose N or K
would need padding is sliced out instead (:func:`_in_stack_ok`).

Each K chunk applies its group scales / zero points to the dequantized ``[bn, bk]`` tile: ``bk`` a multiple of the
group (``bk/g`` scales per row) or a divisor of it (one scale column per chunk); channel / tensor scales are one
per row. With ``S > 1`` the kernel writes ``S`` fp32 partials, reduced by a second (XLA) pass. Block sizes:
:func:`choose_config`; ``config=`` overrides them.

Triton-lowering rules honoured (docs/kernels.md §3–§4): every loaded / computed tile is a power of two (M, N and K are
zero-padded outside the kernel to block multiples, so odd shapes work); no captured constants (shifts come from
``broadcasted_iota``); int2/int4/int8 are unpacked from int32 words with shifts and masks; E8M0 bytes are loaded as
uint8 and turned into powers of two by bit-casting ``e << 23`` (``e == 0`` → 2^−127 built as 2^−63·2^−64 so no
subnormal intermediate is needed, ``e == 255`` → +inf, exactly like ``2^(e−127)`` in fp32); the dot never sees
unsigned ints; ``plgpu.CompilerParams(num_warps, num_stages)`` is always passed (the default GPU backend of
``pallas_call`` differs between jax 0.10 and 0.11+).

Interpret mode (CPU tests) runs the same body; only the two roundings use ``lax.reduce_precision`` there (see
:func:`_round`).

``qmatmul_pallas`` is a ``jax.custom_vjp``: the backward pass is ``g @ dequant(W)`` with the plain-JAX
:func:`kernels.qmatmul_reference.dequantize`; ``packed`` / ``scale`` / ``zero`` get no cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import indexing, tiles
from . import qmatmul_reference as reference
from .quant_meta import QuantMeta, dense_meta

__all__ = ["KernelConfig", "choose_config", "dense_meta", "lowering_cases", "matmul_pallas", "qmatmul_pallas",
           "supported"]

# jax 0.10.2 … 0.12 export ``CompilerParams``; older releases called it ``TritonCompilerParams``.
_CompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

NUM_SMS = 132  # H200
# A GEMV whose whole weight is at most this many bytes is not split along K: the split's second pass (XLA's sum of
# the fp32 partials) is one more launch, and at batch-1 decode a launch (~1–2 µs in a CUDA graph) costs as much as
# streaming 64 KiB through the one wave of programs the split would add (the GDN layers' 32-row in_proj_a / in_proj_b:
# 32 KiB of INT4; −2 launches per GDN layer). A measured tile (kernels/tiles.json) overrides it.
SPLIT_MIN_BYTES = 64 * 1024
SMEM_BUDGET = 160 * 1024  # stay well under the 232,448 B opt-in limit per block
GEMV_MAX_M = 16
_DOT_MIN = 16  # tensor-core dot: every dim ≥ 16


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static launch configuration (hashable; chosen by :func:`choose_config` unless given explicitly)."""

    path: str  # "gemv" | "gemm"
    bm: int  # rows of x per program (gemv: the one padded M block)
    bn: int  # output features per program
    bk: int  # K chunk per fori_loop step
    split_k: int = 1  # K ranges on the third grid axis; their fp32 partials are summed by a second pass
    num_warps: int = 4
    num_stages: int = 3


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group(meta: QuantMeta, num_scale_cols: int | None) -> int | None:
    """Columns per scale inside the kernel: ``None`` = one scale per row (channel / tensor / one group) or none."""
    if meta.fmt == "dense":
        return None
    if meta.fmt == "mxfp8":
        return 32
    if num_scale_cols == 1:
        return None
    return meta.group_size


def supported(meta: QuantMeta, num_scale_cols: int | None = None) -> bool:
    """Whether the Pallas kernel handles this format (else :func:`qmatmul_pallas` falls back to the reference)."""
    if meta.fmt in ("mxfp8", "dense"):
        return True
    if meta.fmt != "int" or meta.bits not in (2, 4, 8):
        return False
    g = _group(meta, meta.scale_shape[-1] if num_scale_cols is None else num_scale_cols)
    return g is None or _is_pow2(g)


def _weight_bits(meta: QuantMeta) -> int:
    return 8 if meta.fmt == "mxfp8" else meta.bits  # dense: the float's width


def _smem_estimate(cfg: KernelConfig, meta: QuantMeta, x_bytes: int) -> int:
    """Per-block shared memory of the Triton pipeline, over-estimated: staged x / packed-weight / scale tiles + the
    dequantized tile's trip to the dot-operand layout (deviceless H200 compiles report less, e.g. 81,920 B for
    bm = bn = 128, bk = 64, 3 stages, int8)."""
    per_stage = cfg.bm * cfg.bk * x_bytes + cfg.bn * cfg.bk * _weight_bits(meta) // 8 + cfg.bn * 8
    return cfg.num_stages * per_stage + cfg.bn * cfg.bk * x_bytes


def _max_split(k: int, bk: int, group: int | None, want: int) -> int:
    """Largest power-of-two split ≤ ``want`` leaving every split ≥ one K chunk (and ≥ one group when groups > bk)."""
    unit = max(bk, group or 1)
    return max(1, min(_pow2_floor(max(1, want)), _pow2_floor(max(1, k // unit))))


def _measured_config(tile: dict, m: int, n: int, k: int, meta: QuantMeta) -> KernelConfig | None:
    """A GEMV config from a measured tile (:mod:`.tiles`), or None when it does not fit this call's shape (the
    weight must be read in place from a layer stack: N a multiple of ``bn``, K of the split's unit)."""
    cfg = KernelConfig("gemv", _DOT_MIN, tile["bn"], tile["bk"], tile["split_k"], num_warps=tile["num_warps"],
                       num_stages=tile["num_stages"])
    per = 1 if meta.fmt in ("mxfp8", "dense") else 32 // meta.bits
    group = _group(meta, meta.scale_shape[-1])
    unit = cfg.bk * cfg.split_k if group is None or group <= cfg.bk else group * cfg.split_k
    fits = (m <= GEMV_MAX_M and cfg.bk % per == 0 and (meta.fmt != "mxfp8" or cfg.bk % 32 == 0)
            and n % cfg.bn == 0 and k % unit == 0)
    return cfg if fits else None


def choose_config(m: int, n: int, k: int, meta: QuantMeta, x_dtype=jnp.bfloat16, chip: str | None = "auto",
                  table=tiles.TABLE) -> KernelConfig:
    """Block sizes (static): the measured tile of :mod:`.tiles` for ``chip`` (``"auto"``: the device the program is
    traced for; None: none) when the table has this scheme, shape and M bucket and it fits, else the shape rule
    below (see the module docstring for the two paths).

    GEMV (``M ≤ 16``): ``bk`` makes each row's chunk of packed weights 128 B where K allows (int2 512, int4 256,
    int8 / fp8 128 values) and ``bn = 8192 / bk`` keeps the dequantized ``[bn, bk]`` tile at 8K elements for 4 warps;
    split-K brings the grid to about one wave (132 SMs) when ``N / bn`` is smaller, unless the whole weight is at most
    :data:`SPLIT_MIN_BYTES` (its second pass would cost more than it saves).
    GEMM: ``bm ≤ 128``, ``bn ≤ 128``, ``bk`` 128 (≤ 4-bit) or 64 (8-bit), 3 stages; tiles shrink to 64 and then
    K is split (≤ 4) while the grid is below one wave; stages / ``bk`` shrink if the shared-memory estimate
    exceeds :data:`SMEM_BUDGET`.
    """
    tile = tiles.lookup(tiles.current_chip() if chip == "auto" else chip, meta, n, k, m, table)
    measured = None if tile is None else _measured_config(tile, m, n, k, meta)
    if measured is not None:
        return measured
    x_bytes = jnp.dtype(x_dtype).itemsize
    bits = _weight_bits(meta)
    group = _group(meta, meta.scale_shape[-1])
    kp2 = _pow2_ceil(max(k, 16))
    if m <= GEMV_MAX_M:
        bk = min(kp2, max(64, 1024 // bits))
        bn = max(_DOT_MIN, min(_pow2_ceil(n), 8192 // bk))
        nblocks = _cdiv(n, bn)
        small = n * k * bits // 8 <= SPLIT_MIN_BYTES
        split = _max_split(k, bk, group, NUM_SMS // nblocks) if nblocks < NUM_SMS and not small else 1
        return KernelConfig("gemv", _DOT_MIN, bn, bk, split, num_warps=4, num_stages=3)
    bm = min(128, max(_DOT_MIN, _pow2_ceil(m)))
    bn = min(128, max(_DOT_MIN, _pow2_ceil(n)))
    bk = min(kp2, 128 if bits <= 4 else 64)

    def programs():
        return _cdiv(m, bm) * _cdiv(n, bn)

    while programs() < NUM_SMS and bn > 64:
        bn //= 2
    while programs() < NUM_SMS and bm > 64:
        bm //= 2
    split = _max_split(k, bk, group, min(4, NUM_SMS // programs())) if programs() < NUM_SMS // 2 else 1
    warps = 8 if bm * bn >= 128 * 128 else 4
    cfg = KernelConfig("gemm", bm, bn, bk, split, num_warps=warps, num_stages=3)
    while _smem_estimate(cfg, meta, x_bytes) > SMEM_BUDGET and (cfg.num_stages > 2 or cfg.bk > 32):
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        else:
            cfg = dataclasses.replace(cfg, bk=cfg.bk // 2)
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# kernel bodies
# ---------------------------------------------------------------------------------------------------------------------
def _e8m0_factors(e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E8M0 bytes (int32) → (a, b) float32 with ``a·b = 2^(e−127)`` and no subnormal factor (e = 255 → inf)."""
    is_zero = e == 0
    a_bits = jnp.where(is_zero, 64, e) << 23  # e == 0: 2^-63
    # int32 literals: under JAX's x64 mode two Python ints would make an int64, whose bitcast is two float32 words
    b_bits = jnp.where(is_zero, jnp.int32(63), jnp.int32(127)) << 23  # e == 0: 2^-64, else 1
    return lax.bitcast_convert_type(a_bits, jnp.float32), lax.bitcast_convert_type(b_bits, jnp.float32)


def _round(w: jax.Array, scale_dtype, out_dtype, interpret: bool) -> jax.Array:
    """fp32 ``w`` → ``w.astype(scale_dtype).astype(out_dtype)`` (each step round-to-nearest-even).

    Interpret mode rounds with explicit ``reduce_precision`` ops instead: XLA:CPU (``xla_allow_excess_precision``;
    observed in its YNNPACK fusions) may drop a narrowing-then-widening convert pair — even across an
    ``optimization_barrier`` — and so skip the rounding the GPU kernel performs; ``reduce_precision`` is kept.
    """
    if not interpret:
        return w.astype(scale_dtype).astype(out_dtype)
    for dt in (jnp.dtype(scale_dtype), jnp.dtype(out_dtype)):
        if dt != jnp.float32:
            fi = jnp.finfo(dt)
            w = lax.reduce_precision(w, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return w.astype(out_dtype)


def _dequant_tile(w_ref, s_ref, z_ref, c, *, rows, bn: int, meta: QuantMeta, bk: int, group: int | None, out_dtype,
                  interpret: bool) -> jax.Array:
    """K chunk ``c`` (counted from column 0 of ``w_ref``) of this program's rows → dequantized ``[bn, bk]`` tile in
    ``out_dtype``. ``rows``: ``slice(None)`` when the refs are this program's ``[bn, ·]`` blocks, else
    ``pl.ds(row0, bn)`` into the whole ``[L·N, ·]`` stacks (a scalar added to the pointer, not a gather)."""
    if meta.fmt == "dense":
        return w_ref[rows, pl.ds(pl.multiple_of(c * bk, bk), bk)].astype(out_dtype)
    scale_dtype = jnp.bfloat16 if meta.fmt == "mxfp8" else jnp.dtype(meta.scale_dtype)
    rnd = functools.partial(_round, scale_dtype=scale_dtype, out_dtype=out_dtype, interpret=interpret)
    if meta.fmt == "mxfp8":
        v = w_ref[rows, pl.ds(pl.multiple_of(c * bk, bk), bk)].astype(jnp.float32)  # [bn, bk]
        ng = bk // 32
        e = s_ref[rows, pl.ds(pl.multiple_of(c * ng, ng), ng)].astype(jnp.int32)  # [bn, bk/32]
        a, b = _e8m0_factors(e)
        w = (v.reshape(bn, ng, 32) * a[:, :, None]) * b[:, :, None]
        return rnd(w.reshape(bn, bk))

    bits = meta.bits
    per = 32 // bits
    nw = bk // per
    words = w_ref[rows, pl.ds(pl.multiple_of(c * nw, nw), nw)]  # [bn, bk/per] int32
    shifts = lax.broadcasted_iota(jnp.int32, (bn, nw, per), 2) * bits
    u = lax.shift_right_logical(jnp.broadcast_to(words[:, :, None], (bn, nw, per)), shifts) & ((1 << bits) - 1)
    q = (u - (1 << (bits - 1))).astype(jnp.float32)  # [bn, nw, per]
    if group is None:  # one scale (and zero point) per row
        s = s_ref[rows, pl.ds(0, 1)].astype(jnp.float32)  # [bn, 1]
        q = q.reshape(bn, bk)
        if z_ref is not None:
            q = q - z_ref[rows, pl.ds(0, 1)].astype(jnp.float32)
        w = q * s
    elif bk >= group:  # the chunk holds bk/group whole groups
        ng = bk // group
        q = q.reshape(bn, ng, group)
        s = s_ref[rows, pl.ds(pl.multiple_of(c * ng, ng), ng)].astype(jnp.float32)[:, :, None]
        if z_ref is not None:
            q = q - z_ref[rows, pl.ds(pl.multiple_of(c * ng, ng), ng)].astype(jnp.float32)[:, :, None]
        w = (q * s).reshape(bn, bk)
    else:  # the chunk lies inside one group
        gi = (c * bk) // group
        q = q.reshape(bn, bk)
        s = s_ref[rows, pl.ds(gi, 1)].astype(jnp.float32)  # [bn, 1]
        if z_ref is not None:
            q = q - z_ref[rows, pl.ds(gi, 1)].astype(jnp.float32)
        w = q * s
    return rnd(w)


def _kernel(*refs, meta: QuantMeta, cfg: KernelConfig, group: int | None, has_zero: bool, nk: int, reduce_rows: bool,
            interpret: bool, layer_rows: int | None = None):
    """Refs: ``[layer,] x, w[, scale[, zero]], out`` (a dense weight has no scale); program ``(i, j, s)``.

    ``layer_rows is None``: ``w`` / ``scale`` / ``zero`` are this program's ``[bn, ·]`` blocks (BlockSpecs).
    ``layer_rows = N``: they are the whole ``[L·N, ·]`` stacks and ``layer`` an ``int32[1]``; the grid covers one
    layer, so this program reads rows ``layer·N + j·bn + [0, bn)`` and the K chunks of split ``s`` (``s·nk + c``):
    the layer offset is a runtime scalar in the pointer arithmetic (a block index cannot depend on a runtime value
    in Pallas-Triton, which has no scalar prefetch), and no program is idle.
    """
    bn, bk = cfg.bn, cfg.bk
    if layer_rows is None:
        rows, c0 = slice(None), 0
    else:
        layer_ref, *refs = refs
        row0 = layer_ref[0] * layer_rows + pl.program_id(1) * bn  # layer_rows % bn == 0 (_in_stack_ok)
        rows, c0 = pl.ds(pl.multiple_of(row0, bn), bn), pl.program_id(2) * nk
    if meta.fmt == "dense":
        (x_ref, w_ref, o_ref), s_ref, z_ref = refs, None, None
    elif has_zero:
        x_ref, w_ref, s_ref, z_ref, o_ref = refs
    else:
        (x_ref, w_ref, s_ref, o_ref), z_ref = refs, None
    x_dtype = x_ref.dtype
    precision = lax.Precision.HIGHEST if x_dtype == jnp.float32 else None
    tile = functools.partial(_dequant_tile, w_ref, s_ref, z_ref, rows=rows, bn=bn, meta=meta, bk=bk, group=group,
                             out_dtype=x_dtype, interpret=interpret)

    def dequant(c):  # c: this split's chunk (x's block starts at the split); the weight chunk counts from the ref's
        return tile(c + c0)

    if reduce_rows:  # M == 1: multiply + row reduction (no 16-row MMA padding)
        def body(c, acc):
            c = c.astype(jnp.int32)  # int64 under JAX's x64 mode
            xs = x_ref[:, pl.ds(pl.multiple_of(c * bk, bk), bk)].astype(jnp.float32)  # [1, bk]
            w = dequant(c).astype(jnp.float32)  # [bn, bk]
            return acc + jnp.sum(w * xs, axis=1)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bn,), jnp.float32))
        o_ref[...] = acc[None, :].astype(o_ref.dtype)
        return

    def body(c, acc):
        c = c.astype(jnp.int32)  # int64 under JAX's x64 mode
        xs = x_ref[:, pl.ds(pl.multiple_of(c * bk, bk), bk)]  # [bm, bk]
        w = dequant(c)  # [bn, bk]
        return acc + lax.dot_general(xs, w, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad2(a: jax.Array, rows: int, cols: int) -> jax.Array:
    pr, pc = rows - a.shape[0], cols - a.shape[1]
    return a if pr == 0 and pc == 0 else jnp.pad(a, ((0, pr), (0, pc)))


def _qmatmul_2d(x: jax.Array, packed, scale, zero, meta: QuantMeta, cfg: KernelConfig, interpret: bool,
                layer=None) -> jax.Array:
    """``x [M, K]`` → ``[M, N]`` through one pallas_call (+ the split-K reduction).

    ``layer``: packed / scale / zero are a stack of L layers flattened to ``[L·N, ·]`` (a bitcast; no padding
    needed: see :func:`_in_stack_ok`) and this is layer ``layer`` (int32 scalar, may be traced). They go to the
    kernel whole (a BlockSpec of the full array: a raw pointer on the GPU) with the layer as an ``int32[1]``
    operand; the grid is one layer's ``(M/bm, N/bn, S)`` and each program adds ``layer·N`` to its row offset
    (:func:`_kernel`). Slicing the layer out first would copy its weight on every call; a grid over every layer's
    row blocks (a block index cannot depend on a runtime value in Pallas-Triton) would leave L−1 of L programs idle.
    """
    m, k = x.shape
    n = meta.out_features
    dense = meta.fmt == "dense"
    group = _group(meta, None if dense else scale.shape[-1])
    per = 1 if meta.fmt in ("mxfp8", "dense") else 32 // meta.bits
    bm, bn, bk, split = cfg.bm, cfg.bn, cfg.bk, cfg.split_k
    assert _is_pow2(bm) and _is_pow2(bn) and _is_pow2(bk) and _is_pow2(split), cfg
    assert bk % per == 0 and (meta.fmt != "mxfp8" or bk % 32 == 0), (cfg, meta)

    # K per program (one split) is a multiple of bk and, when groups are larger than bk, of the group.
    k_unit = bk * split if group is None or group <= bk else group * split
    kp = _cdiv(k, k_unit) * k_unit
    ks = kp // split
    nk = ks // bk
    mp = _cdiv(m, bm) * bm
    np_ = _cdiv(n, bn) * bn

    # tensor strategy / per-row zero: bring scale and zero to [N, G] (a stack read in place has them per row)
    if layer is None and not dense and scale.shape[0] != n:
        scale = jnp.broadcast_to(scale, (n, scale.shape[-1]))
    if layer is None and zero is not None and zero.shape[0] != n:
        zero = jnp.broadcast_to(zero, (n, zero.shape[-1]))
    xg = _pad2(x, mp, kp)
    if group is None:
        gp, gs = 1, 1
    else:
        gp, gs = kp // group, ks // group  # scale columns in all / in one split
    if layer is None:
        wg = _pad2(packed, np_, kp // per)
        sg = None if dense else _pad2(scale, np_, gp)
        zg = None if zero is None else _pad2(zero, np_, gp)
    else:
        layers = packed.shape[0] // n
        assert np_ == n and packed.shape == (layers * n, kp // per), (packed.shape, cfg)
        assert dense or scale.shape == (layers * n, gp), (scale.shape, cfg)
        assert zero is None or zero.shape == scale.shape, (zero.shape, scale.shape)
        wg, sg, zg = packed, scale, zero

    reduce_rows = cfg.path == "gemv" and m == 1
    if reduce_rows:
        bm, mp = 1, 1
        xg = xg[:1]

    if cfg.path == "gemv":
        assert mp == bm, (m, cfg)
    mb, nb = mp // bm, np_ // bn
    grid = (mb, nb, split)  # one layer's work; program_id(0) fastest: consecutive programs share a weight tile
    x_spec = pl.BlockSpec((bm, ks), lambda i, j, s: (i, s))
    if layer is not None:  # the whole stacks: the kernel adds the layer's row offset itself
        w_spec, s_spec, z_spec = (None if a is None else pl.BlockSpec(a.shape, lambda i, j, s: (0, 0))
                                  for a in (wg, sg, zg))
    else:
        w_spec = pl.BlockSpec((bn, ks // per), lambda i, j, s: (j, s))
        if group is None:
            s_spec = pl.BlockSpec((bn, 1), lambda i, j, s: (j, 0))
        else:
            s_spec = pl.BlockSpec((bn, gs), lambda i, j, s: (j, s))
        z_spec = s_spec
    o_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (s * mb + i, j))  # split s writes rows [s·Mp, (s+1)·Mp)
    out_shape = jax.ShapeDtypeStruct((split * mp, np_), jnp.float32 if split > 1 else x.dtype)

    in_specs = [x_spec, w_spec] + ([s_spec] if sg is not None else []) + ([z_spec] if zg is not None else [])
    args = (xg, wg) + ((sg,) if sg is not None else ()) + ((zg,) if zg is not None else ())
    if layer is not None:
        in_specs = [pl.BlockSpec((1,), lambda i, j, s: (0,))] + in_specs
        args = (jnp.reshape(layer, (1,)).astype(jnp.int32),) + args
    kernel = functools.partial(_kernel, meta=meta, cfg=cfg, group=group, has_zero=zg is not None, nk=nk,
                               reduce_rows=reduce_rows, interpret=bool(interpret),
                               layer_rows=None if layer is None else n)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=o_spec,
        compiler_params=_CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"qmatmul_{cfg.path}_{meta.fmt}{'' if meta.fmt == 'mxfp8' else meta.bits}",
    )(*args)
    if split > 1:  # second pass: reduce the fp32 partials of the K splits
        out = out.reshape(split, mp, np_).sum(axis=0).astype(x.dtype)
    return out[:m, :n]


def _layer_of(arrays: tuple, layer) -> tuple:
    return tuple(None if a is None else indexing.take(a, layer) for a in arrays)


def _in_stack_ok(meta: QuantMeta, cfg: KernelConfig, scale, zero) -> bool:
    """Whether a stacked weight can be read in place: no padding of N or K, one scale row per output row."""
    n, k = meta.out_features, meta.in_features
    group = _group(meta, None if scale is None else scale.shape[-1])
    k_unit = cfg.bk * cfg.split_k if group is None or group <= cfg.bk else group * cfg.split_k
    return (n % cfg.bn == 0 and k % k_unit == 0 and (scale is None or scale.shape[-2] == n)
            and (zero is None or zero.shape[-2] == n))


@functools.partial(jax.jit, static_argnames=("meta", "interpret", "config"))
def _forward(x, packed, scale, zero, layer, meta: QuantMeta, interpret: bool, config: KernelConfig | None):
    k, n = meta.in_features, meta.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((*lead, n), x.dtype)
    if meta.fmt != "dense" and not supported(meta, scale.shape[-1]):
        if layer is not None:
            packed, scale, zero = _layer_of((packed, scale, zero), layer)
        return reference.qmatmul(x, packed, scale, zero, meta)
    cfg = config or choose_config(m, n, k, meta, x.dtype)
    if cfg.path == "gemv" and m > cfg.bm:
        raise ValueError(f"gemv config with bm={cfg.bm} cannot take M={m}")
    if layer is not None:
        if _in_stack_ok(meta, cfg, scale, zero):
            flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])  # noqa: E731 (a bitcast)
            y = _qmatmul_2d(x2, flat(packed), flat(scale), flat(zero), meta, cfg, interpret, layer=layer)
            return y.reshape(*lead, n)
        packed, scale, zero = _layer_of((packed, scale, zero), layer)  # padding needed: a copy of this layer
    y = _qmatmul_2d(x2, packed, scale, zero, meta, cfg, interpret)
    return y.reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _qmatmul(x, packed, scale, zero, layer, meta, interpret, config):
    return _forward(x, packed, scale, zero, layer, meta, interpret, config)


def _qmatmul_fwd(x, packed, scale, zero, layer, meta, interpret, config):
    # a dense weight is trainable: keep x for its gradient
    res = (packed, scale, zero, layer, x if meta.fmt == "dense" else None)
    return _forward(x, packed, scale, zero, layer, meta, interpret, config), res


def _qmatmul_bwd(meta, interpret, config, res, g):
    stack, scale, zero, layer, x = res
    packed = stack
    if layer is not None:
        packed, scale, zero = _layer_of((stack, scale, zero), layer)
    w = packed.astype(g.dtype) if meta.fmt == "dense" else reference.dequantize(packed, scale, zero, meta, g.dtype)
    precision = lax.Precision.HIGHEST if g.dtype == jnp.float32 else None
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    dw = None
    if meta.fmt == "dense":  # dW = gᵀ·x over all rows; into layer `layer` of the stack, zeros elsewhere
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        prec = lax.Precision.HIGHEST if jnp.float32 in (g.dtype, x.dtype) else None
        dw = lax.dot_general(g2, x2.astype(g2.dtype), (((0,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32).astype(stack.dtype)
        if layer is not None:
            dw = lax.dynamic_update_index_in_dim(jnp.zeros_like(stack), dw, layer, 0)
    return dx.astype(g.dtype), dw, None, None, None


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


def qmatmul_pallas(x, packed, scale, zero, meta: QuantMeta, *, interpret: bool = False,
                   config: KernelConfig | None = None, layer=None) -> jax.Array:
    """``x [..., K] @ dequant(W)ᵀ`` → ``[..., N]`` in ``x.dtype`` (fp32 accumulation); Pallas-Triton kernel.

    ``interpret=True`` runs the same kernel in Pallas interpret mode (any backend; call it under ``jax.jit``).
    ``config`` overrides the block sizes / path chosen by :func:`choose_config` (tests, tuning).
    ``layer``: packed / scale / zero carry a leading layer-stack axis ``[L, N, ·]`` and this is layer ``layer`` (int32
    scalar, may be traced); it is read in place when no padding is needed, else sliced out.
    Differentiable w.r.t. ``x`` only (packed weights are not trainable).
    """
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    return _qmatmul(x, packed, scale, zero, layer, meta, bool(interpret), config)


def dense_in_stack_ok(m: int, n: int, k: int, w_dtype, x_dtype) -> bool:
    """Whether :func:`matmul_pallas` reads an ``[L, N, K]`` layer in place for ``m`` rows, with its default blocks
    (otherwise it would slice and pad the layer first: a copy and an extra kernel)."""
    meta = dense_meta(n, k, w_dtype)
    return _in_stack_ok(meta, choose_config(m, n, k, meta, x_dtype), None, None)


def matmul_pallas(x, w, *, interpret: bool = False, config: KernelConfig | None = None, layer=None) -> jax.Array:
    """``x [..., K] @ wᵀ`` → ``[..., N]`` in ``x.dtype`` (fp32 accumulation) for an unquantized weight ``w [N, K]``.

    Only worth it with ``layer``: ``w`` is a ``[L, N, K]`` stack and this reads layer ``layer`` in place, where an
    XLA dot would take a sliced copy. Same paths, blocks and contract as :func:`qmatmul_pallas`; the weight tile is
    cast to ``x.dtype`` in registers. Differentiable w.r.t. ``x`` and ``w`` (plain-JAX backward; ``w``'s
    cotangent is zero outside layer ``layer``), so a model trains the same through it.
    """
    meta = dense_meta(w.shape[-2], w.shape[-1], w.dtype)
    return qmatmul_pallas(x, w, None, None, meta, interpret=interpret, config=config, layer=layer)


# ---------------------------------------------------------------------------------------------------------------------
# GPU lowering cases (docs/kernels.md §6 Level A / B)
# ---------------------------------------------------------------------------------------------------------------------
LAYER_SHAPES = ((8192, 2048), (2048, 4096), (512, 2048), (2048, 512))  # (N, K): q_proj / in_proj_qkv, o_proj /
# out_proj, routed/shared expert gate|up, expert down
LOWERING_M = (1, 8, 64, 512)  # GEMV path (1, 8), GEMM path (64, 512)
_VARIANTS = (
    ("int2_g64", {"fmt": "int", "bits": 2, "group_size": 64}),
    ("int4_g128", {"fmt": "int", "bits": 4, "group_size": 128}),
    ("int4_asym_g128", {"fmt": "int", "bits": 4, "group_size": 128, "symmetric": False}),
    ("int8_g32", {"fmt": "int", "bits": 8, "group_size": 32}),
    ("int8_channel", {"fmt": "int", "bits": 8, "group_size": None, "strategy": "channel"}),
    ("mxfp8", {"fmt": "mxfp8", "bits": 8, "group_size": 32, "scale_dtype": "uint8"}),
)


def _case(name: str, spec: dict, m: int, n: int, k: int, x_dtype=jnp.bfloat16, layers: int | None = None):
    """A packed weight ``[N, ·]``, or with ``layers`` one layer read inside its ``[layers, N, ·]`` stack (how the
    model's layer scan calls it; the layer index is the last argument)."""
    spec = dict(spec)
    if spec.get("group_size") is None:
        spec["group_size"] = k
    meta = QuantMeta(in_features=k, out_features=n, **spec)
    lead = () if layers is None else (layers,)
    sds = jax.ShapeDtypeStruct
    if meta.fmt == "mxfp8":
        w = sds((*lead, n, k), jnp.float8_e4m3fn)
        s = sds((*lead, *meta.scale_shape), jnp.uint8)
    else:
        w = sds((*lead, n, meta.packed_cols), jnp.int32)
        s = sds((*lead, *meta.scale_shape), jnp.dtype(meta.scale_dtype))
    x = sds((m, k), x_dtype)
    zero = None if meta.symmetric else sds((*lead, *meta.scale_shape), jnp.int8)
    args = (x, w, s) + (() if zero is None else (zero,)) + (() if layers is None else (sds((), jnp.int32),))
    n_arrays = 3 if zero is None else 4

    def fn(*a, _meta=meta, _n=n_arrays):
        x, packed, scale, *rest = a
        zero = rest[0] if _n == 4 else None
        layer = rest[-1] if len(a) > _n else None
        return qmatmul_pallas(x, packed, scale, zero, _meta, interpret=False, layer=layer)

    return f"{name}{'' if layers is None else '_stack'}_m{m}_n{n}_k{k}", fn, args


def _dense_stack_case(m: int, n: int, k: int, layers: int = 10):
    """A BF16 projection read inside its ``[G=10, N, K]`` layer stack (the real model's scan length)."""
    sds = jax.ShapeDtypeStruct

    def fn(x, w, layer):
        return matmul_pallas(x, w, interpret=False, layer=layer)

    return (f"dense_bf16_stack_m{m}_n{n}_k{k}", fn,
            (sds((m, k), jnp.bfloat16), sds((layers, n, k), jnp.bfloat16), sds((), jnp.int32)))


def lowering_cases() -> list[tuple[str, Callable, tuple[jax.ShapeDtypeStruct, ...]]]:
    """(name, fn, arg_specs) per kernel variant × path × real layer shape, each alone and inside a 10-layer stack
    (``*_stack_*``: the grid of one layer, the stack read whole); ``fn(*arrays)`` runs the GPU kernel."""
    return ([_case(name, spec, m, n, k, layers=layers) for layers in (None, 10) for name, spec in _VARIANTS
             for m in LOWERING_M for n, k in LAYER_SHAPES]
            + [_dense_stack_case(m, n, k) for m in LOWERING_M for n, k in LAYER_SHAPES])
