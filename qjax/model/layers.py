"""Small building blocks: linear layers, the two RMSNorms, the SwiGLU MLP.

Weights keep Hugging Face's ``[out, in]`` layout so checkpoint tensors (and later their packed quantized forms, which
pack along ``in``) map one to one. Matmuls accumulate in float32 and return the activation dtype, as torch's CPU and
cuBLAS bf16 GEMMs do; the norms' reductions run in float32 too. A float64 model does all of it in float64
(:func:`qjax.kernels.accum_dtype`, the one place that rule is stated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.kernels import QuantMeta, accum_dtype, matmul, matmul_accumulated, qmatmul, silu
from qjax.model.quant_layers import init_packed, packed_arrays


def init_normal(rngs: nnx.Rngs | None, shape, std: float, dtype) -> jnp.ndarray:
    """``N(0, std²)`` initial values drawn in float32 (zeros without ``rngs``: the loader overwrites them)."""
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """Bias-free linear layer ``[out, in]`` (HF ``nn.Linear``), its weight dense or packed.

    Dense: ``weight [out, in]`` (an ``nnx.Param``). Packed (``meta`` given): ``weight_packed`` / ``weight_scale`` /
    ``weight_zero_point`` as compressed-tensors stores them (:func:`qjax.model.quant_layers.init_packed`). Which kernel
    runs follows from the weight: :func:`qjax.kernels.matmul` or :func:`qjax.kernels.qmatmul`. On a mesh whose
    ``tensor`` axis splits a packed weight (``tp_split`` "col" or "row", set by :func:`qjax.model.sharding.set_plan`),
    the kernel runs per device on its own shard: a Pallas call under plain GSPMD would see the gathered weight.
    """

    def __init__(self, d_in: int, d_out: int, *, dtype, std: float = 0.02, rngs: nnx.Rngs | None = None,
                 meta: QuantMeta | None = None):
        if meta is None:
            self.meta = None
            self.weight = nnx.Param(init_normal(rngs, (d_out, d_in), std, dtype))
            return
        if (meta.out_features, meta.in_features) != (d_out, d_in):
            raise ValueError(f"quantized shape {[meta.out_features, meta.in_features]} != {[d_out, d_in]}")
        init_packed(self, meta)
        self.mesh_plan = None
        self.tp_split = None

    def arrays(self) -> tuple:
        """A packed weight's ``(packed, scale, zero or None)``."""
        return packed_arrays(self)

    def __call__(self, x: jnp.ndarray, layer=None) -> jnp.ndarray:
        """``x [..., in]`` → ``[..., out]`` in x's dtype (fp32 accumulation). ``layer``: the weight is the layer
        scan's ``[L, out, in]`` stack and this is layer ``layer``."""
        if self.meta is None:
            return matmul(x, self.weight[...], layer=layer)
        if self.tp_split is not None:
            return self.mesh_plan.qmatmul(x, self.arrays(), self.meta, self.tp_split)
        return qmatmul(x, *self.arrays(), self.meta, layer=layer)

    def accumulated(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x @ Wᵀ`` returned in the accumulation dtype (the lm_head's logits: float32, float64 for a float64
        model) — the same accumulation, without the rounding to x's dtype.

        A packed weight goes through :func:`qjax.kernels.qmatmul` like every other packed linear (on a GPU the
        Pallas kernel reads the packed words; dequantizing the whole weight first would write and read it again in
        x's dtype, more bytes than the BF16 head it replaces). The kernel returns x's dtype, so x enters in the
        accumulation dtype: the same values (bf16 → float32 is exact, the dequantized weight is rounded to its
        scale dtype either way), and at one row — the batch-1 decode step — the kernel multiplies in float32
        whatever x's dtype. More rows run a float32 dot (slower than bf16 on tensor cores, but memory-bound up to
        a few rows)."""
        if self.meta is None:
            return matmul_accumulated(x, self.weight[...].astype(x.dtype))
        x = x.astype(accum_dtype(x.dtype))
        if self.tp_split is not None:  # the vocabulary split over tensor: each device's rows of the logits
            return self.mesh_plan.qmatmul(x, self.arrays(), self.meta, self.tp_split)
        return qmatmul(x, *self.arrays(), self.meta)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: ``cast(rms(f32 x) · (1 + f32 w))`` — the weight is an offset initialised to 0 (f32: the
    accumulation dtype)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        acc = accum_dtype(x.dtype)
        xf = x.astype(acc)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # multiply in fp32 before the cast (not Llama's cast-then-multiply)
        return (y * (1.0 + self.weight[...].astype(acc))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: plain weight (initialised to 1), normalise, then gate with ``silu(z)``.

    The order of casts follows transformers: normalise in fp32, cast, scale by w in the model dtype, gate in fp32.
    """

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray, z: jnp.ndarray) -> jnp.ndarray:
        dt, acc = x.dtype, accum_dtype(x.dtype)
        xf = x.astype(acc)
        n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(dt)
        n = self.weight[...].astype(dt) * n
        return (n.astype(acc) * silu(z.astype(acc))).astype(dt)


class MLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) · up(x))`` (the shared expert) of three :class:`Linear` s."""

    def __init__(self, gate_proj: Linear, up_proj: Linear, down_proj: Linear):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x: jnp.ndarray, layer=None) -> jnp.ndarray:
        return self.down_proj(silu(self.gate_proj(x, layer)) * self.up_proj(x, layer), layer)
