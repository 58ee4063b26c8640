"""Packed weights: the words, scales and zero points exactly as the checkpoint stores them, and the FP8 K/V codec.

Nothing is dequantized at load. The layers that hold them (:class:`qjax.model.layers.Linear`,
:class:`qjax.model.moe.Experts`) call the entry points of :mod:`qjax.kernels`, which decide how (plain JAX on CPU,
Pallas kernels on GPU). Variables are :class:`Packed`, not ``nnx.Param``: gradients and optimizers skip them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from qjax.kernels import QuantMeta, accum_dtype, dense_meta


class Packed(nnx.Variable):
    """Non-trainable quantized storage (int32 packs, float8 values, scales, zero points, KV scales)."""


def _packed_dtype(meta: QuantMeta):
    return jnp.float8_e4m3fn if meta.fmt == "mxfp8" else jnp.int32


class PackedWeight(nnx.Module):
    """One packed ``[*lead, N, K]`` weight: ``weight_packed``, ``weight_scale`` and (asymmetric) ``weight_zero_point``.

    ``weight_packed``: int32 ``[*lead, N, ceil(K·b/32)]`` or float8_e4m3fn ``[*lead, N, K]`` (MXFP8).
    ``weight_scale``: ``[*lead, N, G]`` (tensor strategy: ``[*lead, 1, 1]``), float or uint8 E8M0.
    ``weight_zero_point``: int8 ``[*lead, N, G]`` — stored unpacked (the checkpoint packs it along N), so rows of
    gate and up projections can be concatenated; it is 1/G of the weight count.
    """

    def __init__(self, meta: QuantMeta, *, lead: tuple[int, ...] = ()):
        init_packed(self, meta, lead)

    def arrays(self):
        return packed_arrays(self)


def init_packed(module: nnx.Module, meta: QuantMeta, lead: tuple[int, ...] = ()) -> None:
    """Give ``module`` the variables of a packed ``[*lead, N, K]`` weight (``meta``; see :class:`PackedWeight`)."""
    module.meta = meta
    n = meta.out_features
    module.weight_packed = Packed(jnp.zeros((*lead, n, meta.packed_cols), _packed_dtype(meta)))
    module.weight_scale = Packed(jnp.ones((*lead, *meta.scale_shape), jnp.dtype(meta.scale_dtype)))
    module.weight_zero_point = (None if meta.symmetric or meta.fmt == "mxfp8"
                                else Packed(jnp.zeros((*lead, *meta.scale_shape), jnp.int8)))


def packed_arrays(module: nnx.Module) -> tuple:
    """``(packed, scale, zero or None)`` of a module holding a packed weight."""
    zp = None if module.weight_zero_point is None else module.weight_zero_point[...]
    return module.weight_packed[...], module.weight_scale[...], zp


def expert_operand(w) -> tuple:
    """``(packed, scale, zero, meta)`` for the kernels: a packed stack's arrays, or a dense stack as ``fmt="dense"``."""
    if isinstance(w, PackedWeight):
        return (*w.arrays(), w.meta)
    a = w[...]
    return (a, None, None, dense_meta(*a.shape[-2:], a.dtype))


def fake_quant_fp8(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``e4m3(clamp(x / s, ±448)) · s`` in fp32 (float64 for float64 x), back in x's dtype. ``scale`` broadcasts over
    x (per tensor or head)."""
    codes = quantize_fp8(x, scale)
    acc = accum_dtype(x.dtype)
    return (codes.astype(acc) * scale.astype(acc)).astype(x.dtype)


def quantize_fp8(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """float8_e4m3fn codes of ``x / scale``, saturated at ±448 as compressed-tensors and vLLM clamp before casting."""
    acc = accum_dtype(x.dtype)
    y = x.astype(acc) / scale.astype(acc)
    return jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn)


__all__ = ["Packed", "PackedWeight", "expert_operand", "fake_quant_fp8", "init_packed", "packed_arrays", "quantize_fp8"]
