"""The dtypes a model computes in, stated once: what ``load_model(dtype=…)``, ``init_model`` and every CLI
``--dtype`` accept.

A model's dtype is its parameters' and activations' dtype; matmuls, norms, softmaxes, the RoPE angles and the GDN
delta rule accumulate in :func:`qjax.kernels.accum_dtype` of it (float32, or float64 for a float64 model, which then
computes every step in float64 — the ground truth the others are measured against). ``model.dtype`` tells which.

float64 needs JAX's x64 mode (off by default: JAX would otherwise turn every float64 array into float32 without a
word). :func:`model_dtype` switches it on for the process when asked for float64, so that a requested float64 is
never silently computed in float32. Turning x64 on leaves float32 and bfloat16 models computing exactly as before
(tested).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from qjax.kernels import accum_dtype

__all__ = ["MODEL_DTYPES", "DtypeError", "accum_dtype", "check_x64", "enable_x64", "model_dtype"]

log = logging.getLogger(__name__)

# name → dtype, in the order the CLI lists them
MODEL_DTYPES = {"bfloat16": jnp.dtype(jnp.bfloat16), "float16": jnp.dtype(jnp.float16),
                "float32": jnp.dtype(jnp.float32), "float64": jnp.dtype(jnp.float64)}


class DtypeError(ValueError):
    """A dtype the model cannot compute in, or float64 without x64; the message names the dtype and the caller."""


def model_dtype(value, where: str = "dtype", *, switch_x64: bool = True) -> jnp.dtype:
    """The model dtype ``value`` names (a string, numpy / JAX dtype or scalar type), checked; float64 switches JAX's
    x64 mode on (logged once) unless ``switch_x64`` is False. ``where`` names the caller in the error (``"--dtype"``,
    ``"load_model(dtype=…)"``)."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in MODEL_DTYPES:
        raise DtypeError(f"{where}: the model cannot compute in {value!r}; choose one of {', '.join(MODEL_DTYPES)}")
    if dtype == jnp.float64 and switch_x64:
        enable_x64()
    return dtype


def enable_x64() -> None:
    """Switch JAX's x64 mode on for this process (float64 arrays stay float64), if it is not on already."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)
        log.info("float64 requested: jax_enable_x64 switched on for this process")


def check_x64(dtype) -> None:
    """Raise when ``dtype`` is float64 but x64 is off (JAX would silently build float32 arrays instead)."""
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
        raise DtypeError("a float64 model needs JAX's x64 mode, which is off: load it with "
                         "qjax.load_model(path, dtype='float64') or init_model(cfg, dtype='float64'), which switch it "
                         "on, or set JAX_ENABLE_X64=1 / jax.config.update('jax_enable_x64', True) first")
