"""Which implementation runs: Pallas (Triton) kernels on GPU, plain-JAX references elsewhere.

``QJAX_KERNELS`` (or the ``impl=`` argument) forces a choice:
- ``reference``: plain JAX (the oracle; what CPUs run by default);
- ``pallas``: the Pallas kernels compiled through the Triton backend (GPU);
- ``interpret``: the same Pallas kernels in interpret mode (runs anywhere; tests use it on CPU).
"""

from __future__ import annotations

import os

import jax

IMPLS = ("reference", "pallas", "interpret")


def resolve(impl: str | None = None) -> str:
    """The implementation to use for a call made now (``impl`` > ``QJAX_KERNELS`` > backend default)."""
    choice = impl or os.environ.get("QJAX_KERNELS") or ""
    if not choice:
        return "pallas" if jax.default_backend() in ("gpu", "cuda") else "reference"
    if choice not in IMPLS:
        raise ValueError(f"QJAX_KERNELS / impl must be one of {IMPLS}, got {choice!r}")
    return choice
