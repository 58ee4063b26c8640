"""Which implementation runs: Pallas (Triton) kernels on GPU, plain-JAX references elsewhere.

The choice is made when a call is traced: ``impl=`` argument > :func:`use` scope > ``QJAX_KERNELS`` > backend
default. Choices:
- ``reference``: plain JAX (the oracle; what CPUs run by default); routed experts read only the selected experts;
- ``pallas``: the Pallas kernels compiled through the Triton backend (GPU);
- ``interpret``: the same Pallas kernels in interpret mode (runs anywhere; tests use it on CPU);
- ``xla``: the naive plain-XLA baseline benchmarks measure against: each call dequantizes the whole weight — every
  expert of an MoE layer — then runs one dot (dense) or ``ragged_dot`` (experts).

A jitted function traced under one choice keeps it; programs that must differ by implementation take it as a
static argument (as :mod:`qjax.generate` does) or are compiled separately.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

IMPLS = ("reference", "pallas", "interpret", "xla")

_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("qjax_kernels", default=None)


def _check(choice: str, where: str) -> str:
    if choice not in IMPLS:
        raise ValueError(f"{where} must be one of {IMPLS}, got {choice!r}")
    return choice


def resolve(impl: str | None = None) -> str:
    """The implementation to use for a call traced now."""
    if impl:
        return _check(impl, "impl")
    if _SCOPE.get():
        return _SCOPE.get()
    choice = os.environ.get("QJAX_KERNELS") or ""
    if not choice:
        return "pallas" if jax.default_backend() in ("gpu", "cuda") else "reference"
    return _check(choice, "QJAX_KERNELS")


@contextlib.contextmanager
def use(impl: str | None):
    """Trace the calls inside this block with ``impl`` (None: leave the choice to ``QJAX_KERNELS``/the backend)."""
    token = _SCOPE.set(None if impl is None else _check(impl, "kernel implementation"))
    try:
        yield
    finally:
        _SCOPE.reset(token)
