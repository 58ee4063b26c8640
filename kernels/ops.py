"""The public kernel entry points: one signature, dispatched to the reference or the Pallas implementation."""

from __future__ import annotations

import jax.numpy as jnp

from . import moe_reference, reference
from .dispatch import resolve
from .reference import QuantMeta


def qmatmul(x: jnp.ndarray, packed, scale, zero, meta: QuantMeta, *, impl: str | None = None,
            group=None) -> jnp.ndarray:
    """``x [..., K] @ dequant(W)ᵀ`` → ``[..., N]`` in x's dtype, fp32 accumulation (see :mod:`.reference`).

    ``group``: the arrays carry a leading layer-stack axis ``[G, N, ·]`` and this is layer ``group`` (the Pallas
    kernel reads it in place; the references index it).
    """
    which = resolve(impl)
    if which in ("reference", "xla"):  # the reference already dequantizes the whole weight, then one dot
        if group is not None:
            packed, scale, zero = (None if a is None else a[group] for a in (packed, scale, zero))
        return reference.qmatmul(x, packed, scale, zero, meta)
    from .qmatmul_pallas import qmatmul_pallas

    return qmatmul_pallas(x, packed, scale, zero, meta, interpret=which == "interpret", layer=group)


def moe_experts(x, idx, weights, gate_up: tuple, down: tuple, *, impl: str | None = None,
                group=None) -> jnp.ndarray:
    """Routed SwiGLU experts with packed ``[E, …]`` weights → ``[N, H]`` float32 (see :mod:`.moe_reference`).

    ``group``: the arrays carry a leading layer-stack axis (``[G, E, …]``, as the model's layer scan stores them) and
    this call is layer ``group`` (an int32 scalar, may be traced). The kernels then read that layer's experts inside
    the stack: slicing it out first would copy all E experts of the layer on every call.
    """
    which = resolve(impl)
    num_experts = offset = None
    if group is not None:
        g, num_experts = gate_up[0].shape[:2]
        flat = lambda a: None if a is None else a.reshape(g * num_experts, *a.shape[2:])  # noqa: E731 (a bitcast)
        gate_up = (*map(flat, gate_up[:3]), gate_up[3])
        down = (*map(flat, down[:3]), down[3])
        offset = jnp.asarray(group, jnp.int32) * num_experts
    if which == "reference":
        return moe_reference.moe_experts(x, idx, weights, gate_up, down, num_experts=num_experts, offset=offset)
    if which == "xla":
        return moe_reference.moe_experts_dequant_all(x, idx, weights, gate_up, down, num_experts=num_experts,
                                                     offset=offset)
    from .moe_pallas import moe_experts_pallas

    return moe_experts_pallas(x, idx, weights, gate_up, down, interpret=which == "interpret",
                              num_experts=num_experts, expert_offset=offset)
