"""Quantized layer containers: the packed words, scales and zero points exactly as the checkpoint stores them.

Nothing is dequantized at load. Layers call the entry points of :mod:`qjax.kernels`; those decide how (plain JAX on
CPU, Pallas kernels on GPU). Variables are :class:`Packed`, not ``nnx.Param``: gradients and optimizers skip them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from qjax.kernels import QuantMeta, moe_experts, qmatmul
from qjax.kernels.reference import dense_meta


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
        self.meta = meta
        n = meta.out_features
        self.weight_packed = Packed(jnp.zeros((*lead, n, meta.packed_cols), _packed_dtype(meta)))
        self.weight_scale = Packed(jnp.ones((*lead, *meta.scale_shape), jnp.dtype(meta.scale_dtype)))
        self.weight_zero_point = (None if meta.symmetric or meta.fmt == "mxfp8"
                                  else Packed(jnp.zeros((*lead, *meta.scale_shape), jnp.int8)))

    def arrays(self):
        zp = None if self.weight_zero_point is None else self.weight_zero_point[...]
        return self.weight_packed[...], self.weight_scale[...], zp


class QuantLinear(PackedWeight):
    """Drop-in for :class:`qjax.layers.Linear` with a packed weight.

    On a mesh whose ``tensor`` axis splits this weight (``tp_split`` "col" or "row", set by
    :func:`qjax.sharding.set_plan`), the kernel runs per device on its own shard
    (:func:`qjax.sharding.tensor_parallel_qmatmul`): a Pallas call under plain GSPMD would see the gathered weight.
    """

    def __init__(self, meta: QuantMeta, *, lead: tuple[int, ...] = ()):
        super().__init__(meta, lead=lead)
        self.mesh_plan = None
        self.tp_split = None

    def __call__(self, x: jnp.ndarray, group=None) -> jnp.ndarray:
        """``group``: the arrays carry a leading layer-stack axis ``[G, N, ·]`` and this is layer ``group``."""
        if self.tp_split is not None:
            from qjax.sharding import tensor_parallel_qmatmul

            return tensor_parallel_qmatmul(x, self.arrays(), self.meta, self.tp_split, self.mesh_plan)
        return qmatmul(x, *self.arrays(), self.meta, group=group)


class QuantExperts(nnx.Module):
    """Drop-in for :class:`qjax.moe.Experts`: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` packed.

    One side may stay dense (its meta None, a plain ``nnx.Param``): auto-round and llm-compressor leave a projection
    in float when its input dimension is not a multiple of the group size (W4G128 on a model with I = 64 quantizes
    gate/up but not down). Both sides go through the kernel entry point, a dense one as ``fmt="dense"``.
    """

    def __init__(self, num_experts: int, gate_up: QuantMeta | None, down: QuantMeta | None, *, hidden: int,
                 inter: int, dtype):
        if gate_up is None and down is None:
            raise ValueError("QuantExperts needs at least one packed projection (use qjax.moe.Experts)")
        self.gate_up_proj = (PackedWeight(gate_up, lead=(num_experts,)) if gate_up is not None
                             else nnx.Param(jnp.zeros((num_experts, 2 * inter, hidden), dtype)))
        self.down_proj = (PackedWeight(down, lead=(num_experts,)) if down is not None
                          else nnx.Param(jnp.zeros((num_experts, hidden, inter), dtype)))

    def __call__(self, x: jnp.ndarray, idx: jnp.ndarray, weights: jnp.ndarray, group=None) -> jnp.ndarray:
        """``group``: the arrays carry a leading layer-stack axis ``[G, E, …]`` and this is layer ``group`` (read in
        place by the kernels; see :func:`qjax.kernels.moe_experts`)."""
        return moe_experts(x, idx, weights, _expert_operand(self.gate_up_proj), _expert_operand(self.down_proj),
                           group=group)


def _expert_operand(w) -> tuple:
    """``(packed, scale, zero, meta)`` for the kernels: a packed stack's arrays, or a dense stack as ``fmt="dense"``."""
    if isinstance(w, PackedWeight):
        return (*w.arrays(), w.meta)
    a = w[...]
    return (a, None, None, dense_meta(*a.shape[-2:], a.dtype))


def fake_quant_fp8(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``e4m3(clamp(x / s, ±448)) · s`` in fp32, back in x's dtype. ``scale`` broadcasts over x (per tensor or head)."""
    codes = quantize_fp8(x, scale)
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)).astype(x.dtype)


def quantize_fp8(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """float8_e4m3fn codes of ``x / scale``, saturated at ±448 as compressed-tensors and vLLM clamp before casting."""
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)
    return jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn)


__all__ = ["Packed", "PackedWeight", "QuantLinear", "QuantExperts", "fake_quant_fp8", "quantize_fp8"]
