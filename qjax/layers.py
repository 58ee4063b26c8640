"""Small building blocks: linear layers, the two RMSNorms, the SwiGLU MLP.

Weights keep Hugging Face's ``[out, in]`` layout so checkpoint tensors (and later their packed quantized forms, which
pack along ``in``) map one to one. Matmuls accumulate in float32 and return the activation dtype, as torch's CPU and
cuBLAS bf16 GEMMs do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .kernels import matmul
from .quant.layers import QuantLinear


def _normal(rngs: nnx.Rngs | None, shape, std: float, dtype) -> jnp.ndarray:
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """Bias-free linear layer, ``weight [out, in]`` (HF ``nn.Linear``)."""

    def __init__(self, d_in: int, d_out: int, *, dtype, std: float = 0.02, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(_normal(rngs, (d_out, d_in), std, dtype))

    def __call__(self, x: jnp.ndarray, group=None) -> jnp.ndarray:
        """``x [..., in]`` → ``[..., out]`` in x's dtype (fp32 accumulation). ``group``: the weight is the layer
        scan's ``[G, out, in]`` stack and this is layer ``group``."""
        return matmul(x, self.weight[...], group=group)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: ``cast(rms(f32 x) · (1 + f32 w))`` — the weight is an offset initialised to 0."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # multiply in fp32 before the cast (not Llama's cast-then-multiply)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: plain weight (initialised to 1), normalise, then gate with ``silu(z)``.

    The order of casts follows transformers: normalise in fp32, cast, scale by w in the model dtype, gate in fp32.
    """

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray, z: jnp.ndarray) -> jnp.ndarray:
        dt = x.dtype
        xf = x.astype(jnp.float32)
        n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(dt)
        n = self.weight[...].astype(dt) * n
        return (n.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)


class MLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) · up(x))`` (the shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, std: float, rngs: nnx.Rngs | None,
                 quant: dict | None = None, prefix: str = ""):
        lin = lambda name, i, o: make_linear(prefix + name, i, o, quant or {}, dtype=dtype, std=std, rngs=rngs)
        self.gate_proj = lin("gate_proj", hidden, intermediate)
        self.up_proj = lin("up_proj", hidden, intermediate)
        self.down_proj = lin("down_proj", intermediate, hidden)

    def __call__(self, x: jnp.ndarray, group=None) -> jnp.ndarray:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, group)) * self.up_proj(x, group), group)


def make_linear(name: str, d_in: int, d_out: int, quant: dict, *, dtype, std: float, rngs: nnx.Rngs | None):
    """A dense :class:`Linear`, or a :class:`QuantLinear` when ``quant`` (relative name → QuantMeta) lists ``name``."""
    meta = quant.get(name)
    if meta is None:
        return Linear(d_in, d_out, dtype=dtype, std=std, rngs=rngs)
    if (meta.out_features, meta.in_features) != (d_out, d_in):
        raise ValueError(f"{name}: quantized shape {[meta.out_features, meta.in_features]} != {[d_out, d_in]}")
    return QuantLinear(meta)
