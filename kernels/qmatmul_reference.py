"""Plain-JAX references of the matmul kernels, dense and packed weights (used on CPU; the tests' oracle for Pallas).

Weight formats, as compressed-tensors stores them (docs/formats.md §3–§5), all ``[out, in]`` with groups along ``in``:
- ``int``: ``packed`` int32 ``[..., N, ceil(K·b/32)]``, b ∈ {2, 4, 8}, LSB-first, value + 2^(b−1) unsigned;
  ``scale`` ``[..., N, G]`` (G = ceil(K/group); channel: G = 1; tensor: ``[..., 1, 1]``);
  ``zero`` int8 ``[..., N, G]`` or None (symmetric).  W = (q − zp) · scale.
- ``mxfp8``: ``packed`` float8_e4m3fn ``[..., N, K]``; ``scale`` uint8 E8M0 ``[..., N, K/32]``.  W = w · 2^(s − 127).
The dequantized weight is computed in fp32 (exact: small integer × 8–11-bit scale), rounded once to the scale dtype
(bf16 for MXFP8) — exactly compressed-tensors' decompression output — and then cast to the activation dtype (a no-op
for a bf16 model with bf16 scales).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import indexing
from .dispatch import resolve
from .precision import accum_dtype, dot_precision
from .quant_meta import QuantMeta


# Row counts for which :func:`matmul_accumulated` runs one matrix-vector product per row: XLA:CPU turns 2 … 4 rows
# into a GEMM path 13–25× slower than one row (measured, single thread: a [2, 256] × [31040, 256]ᵀ lm_head 23.5 ms vs
# 1.0 ms for one row and 1.8 ms as two matrix-vector products; 8 rows: 8.4 ms vs 6.6 ms), so a speculative verify
# call of k + 1 tokens cost 4–5 decode steps. Per row, the result is bit-identical to a one-row call. Only where the
# reference runs on XLA:CPU: a GPU reads a weight once for all rows in one GEMM, and would read it once per row so.
FEW_ROWS = 8


def matmul_accumulated(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """``x [..., K] @ wᵀ`` for an unquantized ``w [N, K]`` → ``[..., N]`` in :func:`.precision.accum_dtype` (float32 /
    float64 inputs at HIGHEST precision, so no TF32 / bf16 passes)."""
    w = w.astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    if 1 < rows <= FEW_ROWS and jax.default_backend() == "cpu" and resolve(None, x.dtype) == "reference":
        return _per_row(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return _gemm(x, w)


@jax.custom_vjp
def _gemm(x, w):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=dot_precision(x.dtype),
                               preferred_element_type=accum_dtype(x.dtype))


def _gemm_fwd(x, w):
    return _gemm(x, w), (x, w)


def _gemm_bwd(res, g):
    """JAX's own transposes, except the weight's: ``dw = (xᵀ g)ᵀ`` with ``x`` on the left, not ``gᵀ x``. Both
    contract the rows, which are the major dim of both operands, so one of them is transposed before the dot; JAX's
    order transposes ``g`` — on XLA:CPU fused into whatever produces ``g`` (the depthwise conv's backward in a GDN
    layer wrote its result transposed: 18 % of an AutoRound iteration), while ``x`` is a stored residual whose
    transpose is a plain copy."""
    x, w = res
    rows = math.prod(x.shape[:-1])
    x2, g2 = x.reshape(rows, x.shape[-1]), g.reshape(rows, g.shape[-1])
    precision, acc = dot_precision(x.dtype), accum_dtype(x.dtype)
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=acc)
    dw_t = jax.lax.dot_general(x2, g2, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)
    return dx.astype(x.dtype), dw_t.T.astype(w.dtype)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


@jax.custom_vjp
def _per_row(x, w):
    """``x [R, K] @ wᵀ`` as R matrix-vector products (:data:`FEW_ROWS`)."""
    return jnp.stack([jax.lax.dot_general(w, x[i], (((1,), (0,)), ((), ())), precision=dot_precision(x.dtype),
                                          preferred_element_type=accum_dtype(x.dtype)) for i in range(x.shape[0])])


def _per_row_fwd(x, w):
    return _per_row(x, w), (x, w)


def _per_row_bwd(res, g):
    # the GEMM's own gradient: per row, the weight's cotangent would be rounded to its dtype R times (bf16 training)
    _, vjp = jax.vjp(_gemm, *res)
    return vjp(g)


_per_row.defvjp(_per_row_fwd, _per_row_bwd)


def matmul(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """``x [..., K] @ wᵀ`` for an unquantized ``w [N, K]`` → ``[..., N]`` in x's dtype (:func:`matmul_accumulated`
    rounded once)."""
    return matmul_accumulated(x, w).astype(x.dtype)


def unpack_int(packed: jnp.ndarray, bits: int, cols: int) -> jnp.ndarray:
    """``int32 [..., W]`` → signed ``int32 [..., cols]`` (b ∈ {2, 4, 8}: no field straddles a word)."""
    per = 32 // bits
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    u = (packed.astype(jnp.uint32)[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    u = u.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :cols]
    return u.astype(jnp.int32) - (1 << (bits - 1))


def e8m0_to_float32(u8: jnp.ndarray) -> jnp.ndarray:
    """``2^(u8 − 127)`` exactly, by building the float32 bits (``ldexp`` flushes 2^−127 to 0 on XLA:CPU);
    255 → +inf as compressed-tensors decodes it."""
    u = u8.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.where(u == 0, jnp.uint32(0x00400000), u << 23), jnp.float32)


def expand_groups(s: jnp.ndarray, group_size: int, cols: int) -> jnp.ndarray:
    """``[..., N, G]`` per-group values → ``[..., N, cols]``."""
    return jnp.repeat(s, group_size, axis=-1, total_repeat_length=s.shape[-1] * group_size)[..., :cols]


def dequantize(packed, scale, zero, meta: QuantMeta, dtype=jnp.float32) -> jnp.ndarray:
    """Packed weight → dense ``[..., N, K]`` in ``dtype`` (fp32 math, one final rounding)."""
    k = meta.in_features
    if meta.fmt == "dense":
        return packed.astype(dtype)
    if meta.fmt == "mxfp8":
        w = packed.astype(jnp.float32) * expand_groups(e8m0_to_float32(scale), 32, k)
        return w.astype(jnp.bfloat16).astype(dtype)
    q = unpack_int(packed, meta.bits, k).astype(jnp.float32)
    if zero is not None:
        q = q - expand_groups(zero.astype(jnp.float32), meta.group_size, k)
    s = scale.astype(jnp.float32)
    s = jnp.broadcast_to(s, (*q.shape[:-1], s.shape[-1])) if s.shape[-2] == 1 else s
    w = q * expand_groups(s, meta.group_size, k)
    return w.astype(jnp.dtype(meta.scale_dtype)).astype(dtype)


def qmatmul(x: jnp.ndarray, packed, scale, zero, meta: QuantMeta) -> jnp.ndarray:
    """``x [..., K] @ dequant(W)ᵀ`` → ``[..., N]`` in x's dtype (accumulated in :func:`.precision.accum_dtype`)."""
    w = dequantize(packed, scale, zero, meta, x.dtype)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=dot_precision(x.dtype),
                            preferred_element_type=accum_dtype(x.dtype))
    return y.astype(x.dtype)


def dequantize_experts(packed, scale, zero, meta: QuantMeta, idx: jnp.ndarray | None, dtype) -> jnp.ndarray:
    """Dense ``[E or idx.shape…, N, K]`` weights of the experts in ``idx`` (all experts when None)."""
    if idx is not None:  # a scalar id: one dynamic slice; an id array: a gather (indexing.gather)
        if jnp.issubdtype(packed.dtype, jnp.floating) and packed.dtype.itemsize == 1:
            # gather float8 as bytes: XLA:CPU otherwise converts the whole [E, …] stack to float32 before the
            # gather, on every call (MXFP8 decode was 4× slower than INT2 on the CPU for it)
            raw = indexing.gather(jax.lax.bitcast_convert_type(packed, jnp.uint8), idx)
            packed = jax.lax.bitcast_convert_type(raw, packed.dtype)
        else:
            packed = indexing.gather(packed, idx)
        scale = None if scale is None else indexing.gather(scale, idx)
        zero = None if zero is None else indexing.gather(zero, idx)
    return dequantize(packed, scale, zero, meta, dtype)
