"""Bit-exact codecs for compressed-tensors weights: INT packing, RTN quantizers, MXFP8, and a float32 dequantizer.

Layouts (docs/formats.md §4–§5, oracle: ``compressed_tensors.compressors.pack_quantized.helpers`` and
``compressors/mxfp8``):

* **pack-quantized**: signed ``q`` in ``[-2^(b-1), 2^(b-1)-1]`` is offset to ``u = q + 2^(b-1)`` and packed densely,
  LSB first, along the last dim: element ``i`` of a row occupies bits ``[i*b, (i+1)*b)`` of the row's bit stream
  (word ``i*b // 32``). The row is zero-padded to a multiple of 32 elements, then cut to ``ceil(cols*b/32)`` words.
  Zero points are packed the same way along dim -2 (output rows). int32 words are bit patterns.
* **mxfp8-quantized**: ``float8_e4m3fn`` values ``[out, in]`` and uint8 E8M0 scales ``[out, in/32]`` with
  ``scale = 2^(u8 - 127)``.

Host functions: numpy arrays in and out (``ml_dtypes`` for bfloat16 / float8); the device decode of the same layouts
is the kernels' (:mod:`qjax.kernels.qmatmul_reference`), tested against these. Leading dims (e.g. a fused
``[E, N, K]`` expert stack) are allowed wherever a function works on the last dim; compressed-tensors packs each
``[N, K]`` slice independently, which is the same thing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from .config import WeightScheme

__all__ = [
    "pack_int32",
    "pack_words",
    "unpack_words",
    "unpack_int32",
    "pack_zero_point",
    "unpack_zero_point",
    "e8m0_to_float32",
    "e8m0_max_byte",
    "e4m3_to_float32",
    "float32_to_e4m3",
    "quantize_int",
    "quantize_mxfp8",
    "dequantize",
    "E4M3_MAX",
    "MX_GROUP_SIZE",
]

E4M3_MAX = 448.0
MX_GROUP_SIZE = 32
_E8M0_BIAS = 127
# floor(log2(448)): compressed-tensors maps a group's power-of-two amax to 2^8 (mx_utils / mxfp_utils).
_MX_ELEM_OFFSET = 8
_F32 = np.float32


def _check_bits(bits: int) -> None:
    # compressed-tensors packs 1..8 bits; qjax's configs only ever ask for 2, 4 and 8.
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"num_bits must be an integer in [1, 8], got {bits!r}")


def _packed_words(cols: int, bits: int) -> int:
    return math.ceil(cols * bits / 32)


# ---------------------------------------------------------------------------------------------------------------------
# INT packing (host)
# ---------------------------------------------------------------------------------------------------------------------
def pack_int32(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack signed ints ``[..., cols]`` into int32 ``[..., ceil(cols*bits/32)]`` along the last dim.

    Dense, LSB-first, offset ``+2^(bits-1)``; identical to ``pack_to_int32(q, bits)`` (packed_dim=1) of
    compressed-tensors >= 0.18 (and to <= 0.17 for bits 1/2/4/8). Values outside the signed range are an error.
    """
    _check_bits(bits)
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise TypeError(f"pack_int32 expects an integer array, got {q.dtype}")
    if q.ndim < 1:
        raise ValueError("pack_int32 expects at least one dimension")
    offset = 1 << (bits - 1)
    if q.size and (int(q.min()) < -offset or int(q.max()) > offset - 1):
        raise ValueError(f"values outside the signed {bits}-bit range [{-offset}, {offset - 1}]")
    lead, cols = q.shape[:-1], q.shape[-1]
    words = _packed_words(cols, bits)
    padded = math.ceil(cols / 32) * 32
    u = np.zeros((*lead, padded), dtype=np.uint32)
    u[..., :cols] = (q.astype(np.int64) + offset).astype(np.uint32)  # padding fields stay 0 (= -2^(b-1) decoded)
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
        fields = u.reshape(*lead, padded // per_word, per_word) << shifts
        packed = np.bitwise_or.reduce(fields, axis=-1)
    else:
        # Fields straddle words: build the LSB-first bit stream and let packbits do the bookkeeping.
        bit_idx = np.arange(bits, dtype=np.uint32)
        stream = ((u[..., None] >> bit_idx) & 1).astype(np.uint8).reshape(*lead, padded * bits)
        packed = np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)
    return np.ascontiguousarray(packed[..., :words]).view(np.int32)


def unpack_int32(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Unpack int32 ``[..., ceil(cols*bits/32)]`` (packed along the last dim) to signed int8 ``[..., cols]``.

    Padding fields are dropped. Matches ``unpack_from_int32(packed, bits, shape)`` of compressed-tensors.
    """
    _check_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise TypeError(f"unpack_int32 expects int32 words, got {packed.dtype}")
    words = _packed_words(cols, bits)
    if packed.ndim < 1 or packed.shape[-1] != words:
        raise ValueError(f"{cols} columns of {bits}-bit values need {words} int32 words, got shape {packed.shape}")
    lead = packed.shape[:-1]
    w = packed.view(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
        u = ((w[..., None] >> shifts) & mask).reshape(*lead, words * per_word)[..., :cols]
    else:
        stream = np.unpackbits(np.ascontiguousarray(w.astype("<u4")).view(np.uint8), axis=-1, bitorder="little")
        fields = stream[..., : cols * bits].reshape(*lead, cols, bits).astype(np.uint32)
        u = (fields << np.arange(bits, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def pack_zero_point(zp: np.ndarray, bits: int) -> np.ndarray:
    """Pack signed zero points ``[..., rows, groups]`` along the rows: int32 ``[..., ceil(rows*bits/32), groups]``.

    compressed-tensors packs zero points with ``packed_dim=0`` (transpose, pack, transpose back), so one word holds
    consecutive output rows of one group.
    """
    zp = np.asarray(zp)
    if zp.ndim < 2:
        raise ValueError(f"zero points must be at least 2-D [rows, groups], got shape {zp.shape}")
    return np.ascontiguousarray(np.swapaxes(pack_int32(np.swapaxes(zp, -1, -2), bits), -1, -2))


def unpack_zero_point(packed: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Inverse of ``pack_zero_point``: int32 ``[..., ceil(rows*bits/32), groups]`` -> int8 ``[..., rows, groups]``."""
    packed = np.asarray(packed)
    if packed.ndim < 2:
        raise ValueError(f"packed zero points must be at least 2-D, got shape {packed.shape}")
    return np.ascontiguousarray(np.swapaxes(unpack_int32(np.swapaxes(packed, -1, -2), bits, rows), -1, -2))


# ---------------------------------------------------------------------------------------------------------------------
# word packing of unsigned b-bit values, LSB first, with the slot order inside a word as an argument (identity:
# compressed-tensors and GPTQ; AWQ interleaves)
# ---------------------------------------------------------------------------------------------------------------------
def pack_words(u: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Unsigned values ``[..., C]`` (``C`` a multiple of 32/b) → int32 ``[..., C·b/32]``; value ``i`` of each run of
    32/b goes to slot ``order[i]`` (bits ``[slot·b, (slot+1)·b)``), identity order when None."""
    per = 32 // bits
    slots = np.arange(per) if order is None else np.asarray(order)
    shifts = (slots * bits).astype(np.uint32)
    fields = u.astype(np.uint32).reshape(*u.shape[:-1], u.shape[-1] // per, per) << shifts
    return np.ascontiguousarray(np.bitwise_or.reduce(fields, axis=-1).astype(np.uint32)).view(np.int32)


def unpack_words(words: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of :func:`pack_words`: int32 ``[..., W]`` → int16 ``[..., W·32/b]`` unsigned values."""
    per = 32 // bits
    slots = np.arange(per) if order is None else np.asarray(order)
    shifts = (slots * bits).astype(np.uint32)
    w = np.ascontiguousarray(words).view(np.uint32)
    u = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return u.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.int16)


# ---------------------------------------------------------------------------------------------------------------------
# float8 helpers (host)
# ---------------------------------------------------------------------------------------------------------------------
def e8m0_to_float32(u8: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> float32 ``2^(u8 - 127)``, exactly.

    u8 = 0 gives 2^-127 (a float32 subnormal); 255 gives +inf, as compressed-tensors' ``2.0 ** (u8 - 127)`` does
    (OCP E8M0 calls 255 NaN; neither tool writes it). Accepts uint8 or ``ml_dtypes.float8_e8m0fnu`` bytes.
    """
    u = np.asarray(u8)
    if u.dtype != np.uint8:
        if u.dtype.itemsize != 1:
            raise TypeError(f"E8M0 scales are single bytes, got {u.dtype}")
        u = u.view(np.uint8)
    bits = u.astype(np.uint32) << np.uint32(23)  # exponent field = u8, mantissa 0
    bits = np.where(u == 0, np.uint32(0x00400000), bits)
    return bits.astype(np.uint32).view(np.float32)


def e8m0_max_byte(dtype=None) -> int:
    """The largest E8M0 scale byte ``e`` that keeps every weight of its group finite once dequantized for a model
    computing in ``dtype`` (None: bfloat16).

    The rule: the kernels dequantize ``w · 2^(e−127)`` in float32, round it once to bfloat16 and cast that to the
    model's dtype (``kernels/qmatmul_reference.dequantize``; the Pallas kernels round the same way), and the largest
    E4M3 value is 448, so ``448 · 2^(e−127)`` must be finite in bfloat16 and in ``dtype``:
    ``e ≤ 127 + floor(log2(max(dtype) / 448))``, which is 246 for bfloat16, float32 and float64 (float32 shares
    bfloat16's exponent range, and bfloat16's bounds float64's), 134 for float16 (65504 / 448 < 2^8), and never more
    than 254 (2^127, the largest finite E8M0 scale; 255 is NaN). A larger byte turns its group — and the logits —
    into infinities and NaN. No producer writes one: a bfloat16 weight's largest amax gives 246."""
    limit = 2 * _E8M0_BIAS  # 254
    for d in (ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16 if dtype is None else dtype)):
        limit = min(limit, _E8M0_BIAS + math.floor(math.log2(float(ml_dtypes.finfo(d).max) / E4M3_MAX)))
    return limit


def e4m3_to_float32(x: np.ndarray) -> np.ndarray:
    """float8_e4m3fn values (or their raw uint8 bytes) -> float32, exactly (0x7F/0xFF -> NaN)."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        x = x.view(ml_dtypes.float8_e4m3fn)
    if x.dtype != ml_dtypes.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn or uint8, got {x.dtype}")
    return x.astype(np.float32)


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to float8_e4m3fn, nearest-even, saturating at ±448 (NaN stays NaN).

    ml_dtypes turns |x| >= 464 into NaN; torch's cast saturates, and compressed-tensors clamps to ±448 first anyway.
    """
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------------------------------
# quantizers (host reference, compressed-tensors RTN semantics)
# ---------------------------------------------------------------------------------------------------------------------
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def _finfo(dtype: np.dtype):
    return ml_dtypes.finfo(dtype) if dtype == np.dtype(ml_dtypes.bfloat16) else np.finfo(dtype)


def _reduce_groups(w32: np.ndarray, strategy: str, group_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-group min and max of float32 ``[..., out, in]``: group -> [..., out, in/G]; channel -> [..., out, 1];
    tensor -> [1]."""
    if strategy == "group":
        if not group_size or group_size <= 0:
            raise ValueError(f"strategy 'group' needs a positive group_size, got {group_size!r}")
        cols = w32.shape[-1]
        if cols % group_size:
            # compressed-tensors refuses too (_process_group: "tensor column shape must be divisible").
            raise ValueError(f"{cols} columns are not divisible by group_size {group_size}")
        g = w32.reshape(*w32.shape[:-1], cols // group_size, group_size)
        return g.min(axis=-1), g.max(axis=-1)
    if strategy == "channel":
        return w32.min(axis=-1, keepdims=True), w32.max(axis=-1, keepdims=True)
    if strategy == "tensor":
        return w32.min().reshape(1), w32.max().reshape(1)
    raise ValueError(f"strategy must be 'group', 'channel' or 'tensor', got {strategy!r}")


def _expand(t: np.ndarray, strategy: str, group_size: int | None, cols: int) -> np.ndarray:
    """Broadcast per-group values ``[..., out, groups]`` (or [..., out, 1] / [1]) over ``[..., out, cols]``."""
    if strategy == "group":
        assert group_size
        return np.repeat(t, group_size, axis=-1)[..., :cols]
    return t


def quantize_int(
    w: np.ndarray,
    bits: int,
    *,
    symmetric: bool = True,
    strategy: str = "group",
    group_size: int | None = None,
    scale_dtype: np.dtype | str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Round-to-nearest INT quantization with compressed-tensors' min/max rule, bit for bit.

    ``w`` is ``[..., out, in]`` float32, bfloat16 or float16; arithmetic happens in ``w``'s dtype exactly as torch
    does it on CPU (each op in float32, rounded to the dtype), because compressed-tensors computes scales and
    ``w / scale`` in the weight dtype and the rounding of ``w / scale`` decides ties. Returns

    * ``q``: int8 ``[..., out, in]`` in ``[-2^(b-1), 2^(b-1)-1]``;
    * ``scale``: ``[..., out, in/G]`` (group), ``[..., out, 1]`` (channel) or ``[1]`` (tensor), in ``scale_dtype``
      (default: ``w``'s dtype, like llmcompressor's ``scale_dtype: null``);
    * ``zp``: int8, same shape as ``scale``, or None when symmetric.

    A ``scale_dtype`` different from ``w``'s dtype needs float32 ``w`` and follows ``QuantizationArgs.scale_dtype``:
    scales are rounded to it (clamped to its range) before quantizing. compressed-tensors' GPU (Triton) path divides
    in float32 instead and can differ on bf16 weights in tie cases; this function mirrors the CPU path.
    """
    _check_bits(bits)
    w = np.asarray(w)
    cd = w.dtype
    if cd not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_int expects float32, bfloat16 or float16 weights, got {cd}")
    sd = cd if scale_dtype is None else np.dtype(scale_dtype)
    if sd not in _FLOAT_DTYPES:
        raise TypeError(f"scale_dtype must be float32, bfloat16 or float16, got {sd}")
    if sd != cd and cd != np.dtype(np.float32):
        raise ValueError(f"a scale_dtype ({sd}) different from the weights' dtype ({cd}) needs float32 weights")

    def rd(x: np.ndarray) -> np.ndarray:  # one torch op's rounding: float32 result -> compute dtype -> float32
        return np.asarray(x, dtype=_F32).astype(cd).astype(_F32)

    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    bit_range = _F32(qmax - qmin)
    w32 = w.astype(_F32)
    mn, mx = _reduce_groups(w32, strategy, group_size)  # min/max are exact in any dtype

    # calculate_qparams: 0 must be representable, so the range always includes it.
    mn, mx = np.minimum(mn, _F32(0)), np.maximum(mx, _F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        if symmetric:
            scale = rd(np.maximum(np.abs(mn), np.abs(mx)) / (bit_range / _F32(2)))
            zp = np.zeros_like(scale)
        else:
            scale = rd(rd(mx - mn) / bit_range)
            zp = np.clip(rd(_F32(qmin) - rd(mn / scale)), qmin, qmax)
    if sd != cd:  # QuantizationArgs.scale_dtype: round the scales to it (clamped to its range), keep computing in cd
        fi = _finfo(sd)
        scale = np.clip(scale, _F32(fi.min), _F32(fi.max)).astype(sd).astype(_F32)
    # Zero scales (all-zero groups) become the scale dtype's eps, so that w / scale is defined.
    scale = np.where(scale == 0, rd(_F32(_finfo(sd).eps)), scale).astype(_F32)
    # All-zero asymmetric groups give zp = qmin - 0/0 = NaN before the eps fix; torch casts that NaN to int8 as 0.
    zp8 = np.rint(np.nan_to_num(zp, nan=0.0)).astype(np.int8)

    cols = w.shape[-1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = rd(w32 / _expand(scale, strategy, group_size, cols))
        # llmcompressor always hands the compressor a zero point (zeros when symmetric): `scaled += zp`.
        scaled = rd(scaled + _expand(zp8.astype(_F32), strategy, group_size, cols))
    q = np.rint(np.clip(scaled, qmin, qmax)).astype(np.int8)
    return q, scale.astype(sd), (None if symmetric else zp8)


def _round_to_power_2(x: np.ndarray) -> np.ndarray:
    """compressed-tensors' ``round_to_power_2`` for MX scales, on float32 values: keep sign+exponent, rounding up
    when the mantissa is >= 1.75 (adds 1 << (mantissa_bits - 2)). Equal for bf16/fp32 inputs since bf16 values
    have zero low bits."""
    bits = x.astype(_F32).view(np.uint32).astype(np.uint64)
    bits = (bits + (1 << 21)) & (((1 << 9) - 1) << 23)
    return bits.astype(np.uint32).view(_F32)


def quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP8 quantization exactly as compressed-tensors' MXFP8 compressor encodes it (docs/formats.md §5).

    ``w`` is ``[..., out, in]`` float32 or bfloat16 with ``in % 32 == 0``. Per 32-column group:
    ``u8 = clip(127 + floor(log2(round_pow2(amax))) - 8, 0, 254)``, values ``e4m3(clip(w / 2^(u8-127), ±448))``.
    Returns (float8_e4m3fn ``[..., out, in]``, uint8 ``[..., out, in/32]``). Bit-exact with compressed-tensors
    except for groups with amax >= 1.75 * 2^127, where it overflows (see below).
    """
    w = np.asarray(w)
    cd = w.dtype
    if cd not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        # float16 scales 2^(u8-127) under- and overflow in compressed-tensors' fp16 arithmetic: not reproduced.
        raise TypeError(f"quantize_mxfp8 expects float32 or bfloat16 weights, got {cd}")
    cols = w.shape[-1]
    if cols % MX_GROUP_SIZE:
        raise ValueError(f"MXFP8 needs the column count to be a multiple of {MX_GROUP_SIZE}, got {cols}")
    w32 = w.astype(_F32)
    mn, mx = _reduce_groups(w32, "group", MX_GROUP_SIZE)
    amax = np.maximum(np.abs(np.minimum(mn, _F32(0))), np.abs(np.maximum(mx, _F32(0))))
    with np.errstate(divide="ignore"):
        exp = np.floor(np.log2(_round_to_power_2(amax).astype(np.float64)))  # -inf for an all-zero group
    # compressed-tensors clamps to [0, 255]; 255 only arises for amax >= 1.75 * 2^127 (beyond bf16-realistic
    # weights), where its scale is inf and it then stores garbage (int32(log2(inf)) wraps to 127) with zeroed values.
    # qjax stops at 254 (2^127, the largest finite E8M0 scale) so such a group still decodes to finite values.
    u8 = np.clip(_E8M0_BIAS + exp - _MX_ELEM_OFFSET, 0, 254).astype(np.uint8)
    scale = e8m0_to_float32(u8)
    with np.errstate(over="ignore"):
        scaled = (w32 / _expand(scale, "group", MX_GROUP_SIZE, cols)).astype(cd).astype(_F32)
    # `scaled += zero_point` with llmcompressor's all-zero float zero point: turns -0.0 into +0.0.
    scaled = scaled + _F32(0)
    return float32_to_e4m3(scaled), u8


# ---------------------------------------------------------------------------------------------------------------------
# dequantization (host oracle)
# ---------------------------------------------------------------------------------------------------------------------
def dequantize(
    scheme: "WeightScheme",
    *,
    packed: np.ndarray | None = None,
    weight: np.ndarray | None = None,
    scale: np.ndarray,
    zero_point: np.ndarray | None = None,
    shape: tuple[int, ...] | np.ndarray,
) -> np.ndarray:
    """Float32 weights ``shape`` (``[..., out, in]``, e.g. the checkpoint's ``weight_shape``) from stored tensors.

    * pack-quantized: ``packed`` int32 ``[..., out, ceil(in*b/32)]``, ``scale`` as stored (bf16/fp16/fp32),
      ``zero_point`` when asymmetric: int32 packed along rows as on disk (group/channel), or int8 values (tensor
      strategy, which compressed-tensors stores unpacked). ``W = (q - zp) * scale``.
    * mxfp8-quantized: ``weight`` float8_e4m3fn (or its uint8 bytes), ``scale`` uint8 E8M0.
      ``W = e4m3(weight) * 2^(scale - 127)``.

    All math is float32 and exact (docs/formats.md §4 'Exactness'): (q - zp) is a small integer and the scale has at
    most 11 significant bits, so one cast of the result to the scale dtype reproduces compressed-tensors' decompression.
    """
    shape = tuple(int(s) for s in np.asarray(shape).reshape(-1))
    if len(shape) < 2:
        raise ValueError(f"weight shape must be at least 2-D [out, in], got {shape}")
    *lead, rows, cols = shape
    strategy, gs = scheme.strategy, scheme.group_size
    scale = np.asarray(scale)
    expected_scale = {
        "group": (*lead, rows, math.ceil(cols / gs) if gs else -1),
        "channel": (*lead, rows, 1),
    }.get(strategy)
    if expected_scale is not None and scale.shape != expected_scale:
        raise ValueError(f"{strategy} scale for weight {shape} must be {expected_scale}, got {scale.shape}")
    if strategy == "tensor" and scale.size != 1:
        raise ValueError(f"tensor scale must hold one value, got shape {scale.shape}")

    if scheme.format == "mxfp8-quantized":
        if weight is None:
            raise ValueError("mxfp8-quantized dequantization needs `weight` (float8_e4m3fn)")
        values = e4m3_to_float32(weight)
        if values.shape != shape:
            raise ValueError(f"MXFP8 weight shape {values.shape} does not match {shape}")
        scale32 = e8m0_to_float32(scale)
    elif scheme.format == "pack-quantized":
        if packed is None:
            raise ValueError("pack-quantized dequantization needs `packed` (int32)")
        values = unpack_int32(packed, scheme.num_bits, cols).astype(_F32)
        if values.shape != shape:
            raise ValueError(f"unpacked weight shape {values.shape} does not match {shape}")
        if not scheme.symmetric:
            if zero_point is None:
                raise ValueError("an asymmetric scheme needs `zero_point`")
            zp = np.asarray(zero_point)
            if zp.dtype == np.int32 and strategy in ("group", "channel"):
                zp = unpack_zero_point(zp, scheme.num_bits, rows)
            if zp.shape != scale.shape and not (strategy == "tensor" and zp.size == 1):
                raise ValueError(f"zero point shape {zp.shape} does not match the scale shape {scale.shape}")
            values = values - _expand(zp.astype(_F32), strategy, gs, cols)
        scale32 = scale.astype(_F32)
    else:
        raise ValueError(f"unsupported format {scheme.format!r}")
    return values * _expand(scale32, strategy, gs, cols)
