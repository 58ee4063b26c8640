"""Which implementation runs: Pallas (Triton) kernels on GPU, plain-JAX references elsewhere.

The choice is made when a call is traced: ``impl=`` argument > :func:`use` scope > ``QJAX_KERNELS`` > backend
default. Choices:
- ``reference``: plain JAX (the oracle; what CPUs run by default); routed experts read only the selected experts;
- ``pallas``: the Pallas kernels compiled through the Triton backend (GPU);
- ``interpret``: the same Pallas kernels in interpret mode (runs anywhere; tests use it on CPU);
- ``xla``: the naive plain-XLA baseline benchmarks measure against: each call dequantizes the whole weight — every
  expert of an MoE layer — then runs one dot (dense) or ``ragged_dot`` (experts).

float64 computations run the plain-JAX paths: the Pallas kernels compute in float32, so asking for them with
float64 inputs (``impl=``, :func:`use` or ``QJAX_KERNELS``) is an error naming the dtype, and the GPU default falls
back to the reference instead of rounding to float32 behind the caller's back.

A jitted function traced under one choice keeps it; programs that must differ by implementation take it as a
static argument (as :mod:`qjax.generate` does) or are compiled separately.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp

IMPLS = ("reference", "pallas", "interpret", "xla")

_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("qjax_kernels", default=None)


def _check(choice: str, where: str) -> str:
    if choice not in IMPLS:
        raise ValueError(f"{where} must be one of {IMPLS}, got {choice!r}")
    return choice


def resolve(impl: str | None = None, dtype=None) -> str:
    """The implementation to use for a call traced now on inputs of ``dtype`` (None: not float64)."""
    if impl:
        choice, where = _check(impl, "impl"), "impl="
    elif _SCOPE.get():
        choice, where = _SCOPE.get(), "qjax.kernels.use"
    elif os.environ.get("QJAX_KERNELS"):
        choice, where = _check(os.environ["QJAX_KERNELS"], "QJAX_KERNELS"), "QJAX_KERNELS"
    else:
        choice, where = ("pallas" if jax.default_backend() in ("gpu", "cuda") else "reference"), None
    if dtype is not None and jnp.dtype(dtype) == jnp.float64 and choice in ("pallas", "interpret"):
        if where is None:
            return "reference"
        raise ValueError(f"the Pallas kernels compute in float32 and cannot honour float64 inputs ({where} asked "
                         f"for {choice!r}); use the reference kernels (impl='reference') for float64")
    return choice


@contextlib.contextmanager
def use(impl: str | None):
    """Trace the calls inside this block with ``impl`` (None: leave the choice to ``QJAX_KERNELS``/the backend)."""
    token = _SCOPE.set(None if impl is None else _check(impl, "kernel implementation"))
    try:
        yield
    finally:
        _SCOPE.reset(token)
