"""compressed-tensors' INT min/max RTN as jit-able JAX, for algorithms that quantize inside a search (AWQ, GPTQ).

The host codec :func:`qjax.quant.packing.quantize_int` is the bit-exact reference for what ends up on disk; these are
its device counterparts on float32 weights (llm-compressor's AWQ/GPTQ work in float32 here), written op for op like
it so that the codes agree bit for bit (tested). ``group_size`` g > 0: groups of g input channels (K % g == 0);
g == -1 (or None): one group per output row (compressed-tensors' "channel" strategy).

Shapes: ``w [*lead, N, K]``; ``scale``, ``zero_point`` ``[*lead, N, G]`` with ``G = K // g`` (1 for channel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32
_EPS32 = float(np.finfo(np.float32).eps)  # compressed-tensors' replacement for a zero scale (the dtype's eps)


def int_range(bits: int) -> tuple[int, int]:
    """``(qmin, qmax)`` of signed ``bits``-bit integers."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _groups(k: int, group_size: int | None) -> int:
    if group_size is None or group_size == -1:
        return 1
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    return k // group_size


def expand_groups(q: jax.Array, k: int) -> jax.Array:
    """``[*lead, N, G]`` → ``[*lead, N, K]`` (each group's value repeated over its columns)."""
    return jnp.repeat(q, k // q.shape[-1], axis=-1)


def _div(x: jax.Array, y: jax.Array) -> jax.Array:
    # XLA rewrites x / broadcast(y) into x * (1 / y) (one rounding more, 1 ulp off on ~25% of elements); the barrier
    # keeps a true division like torch's
    return x / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(y, x.dtype), x.shape))


def qparams(w: jax.Array, *, bits: int, symmetric: bool, group_size: int | None) -> tuple[jax.Array, jax.Array]:
    """compressed-tensors' ``calculate_qparams`` on each group's min/max (widened to contain 0).

    Returns f32 ``scale [*lead, N, G]`` (0 replaced by float32 eps) and f32 integral ``zero_point`` (0 when
    symmetric), both jit-able.
    """
    w = w.astype(_F32)
    k = w.shape[-1]
    g = _groups(k, group_size)
    wg = w.reshape(*w.shape[:-1], g, k // g)
    mn = jnp.minimum(jnp.min(wg, axis=-1), 0.0)
    mx = jnp.maximum(jnp.max(wg, axis=-1), 0.0)
    qmin, qmax = int_range(bits)
    rng = np.float32(qmax - qmin)
    if symmetric:
        scale = _div(jnp.maximum(jnp.abs(mn), jnp.abs(mx)), rng / np.float32(2))
        zp = jnp.zeros_like(scale)
    else:
        scale = _div(mx - mn, rng)
        zp = jnp.clip(np.float32(qmin) - _div(mn, scale), qmin, qmax)
    scale = jnp.where(scale == 0, np.float32(_EPS32), scale)
    # an all-zero asymmetric group gives qmin - 0/0 = NaN, which torch casts to int 0
    zp = jnp.round(jnp.nan_to_num(zp, nan=0.0))
    return scale, zp


def quantize_codes(w: jax.Array, scale: jax.Array, zero_point: jax.Array, *, bits: int) -> jax.Array:
    """Integer codes ``clip(round(w / s + zp), qmin, qmax)`` as f32 ``[*lead, N, K]`` (``scale``/``zero_point``
    ``[*lead, N, G]``; compressed-tensors' ``quantize``: divide, add the zero point, clamp, round half to even)."""
    k = w.shape[-1]
    qmin, qmax = int_range(bits)
    scaled = _div(w.astype(_F32), expand_groups(scale, k)) + expand_groups(zero_point, k)
    return jnp.round(jnp.clip(scaled, qmin, qmax))


def fake_quantize(w: jax.Array, scale: jax.Array, zero_point: jax.Array, *, bits: int) -> jax.Array:
    """Quantize-dequantize ``(q - zp) · s`` in f32 ``[*lead, N, K]`` (compressed-tensors' ``fake_quantize``)."""
    k = w.shape[-1]
    q = quantize_codes(w, scale, zero_point, bits=bits)
    return (q - expand_groups(zero_point, k)) * expand_groups(scale, k)


def rtn(w: jax.Array, *, bits: int, symmetric: bool, group_size: int | None) -> jax.Array:
    """Min/max RTN quantize-dequantize of ``w [*lead, N, K]`` (f32 out): llm-compressor's ``memoryless_minmax``
    observer followed by ``fake_quantize``, what AWQ's grid search applies to ``W · s``."""
    scale, zp = qparams(w, bits=bits, symmetric=symmetric, group_size=group_size)
    return fake_quantize(w, scale, zp, bits=bits)
