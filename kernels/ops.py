"""The public kernel entry points: one signature, dispatched to the reference or the Pallas implementation."""

from __future__ import annotations

import jax.numpy as jnp

from . import moe_reference, reference
from .dispatch import resolve
from .reference import QuantMeta


def qmatmul(x: jnp.ndarray, packed, scale, zero, meta: QuantMeta, *, impl: str | None = None) -> jnp.ndarray:
    """``x [..., K] @ dequant(W)ᵀ`` → ``[..., N]`` in x's dtype, fp32 accumulation (see :mod:`.reference`)."""
    which = resolve(impl)
    if which in ("reference", "xla"):  # the reference already dequantizes the whole weight, then one dot
        return reference.qmatmul(x, packed, scale, zero, meta)
    from .qmatmul_pallas import qmatmul_pallas

    return qmatmul_pallas(x, packed, scale, zero, meta, interpret=which == "interpret")


def moe_experts(x, idx, weights, gate_up: tuple, down: tuple, *, impl: str | None = None) -> jnp.ndarray:
    """Routed SwiGLU experts with packed ``[E, …]`` weights → ``[N, H]`` float32 (see :mod:`.moe_reference`)."""
    which = resolve(impl)
    if which == "reference":
        return moe_reference.moe_experts(x, idx, weights, gate_up, down)
    if which == "xla":
        return moe_reference.moe_experts_dequant_all(x, idx, weights, gate_up, down)
    from .moe_pallas import moe_experts_pallas

    return moe_experts_pallas(x, idx, weights, gate_up, down, interpret=which == "interpret")
