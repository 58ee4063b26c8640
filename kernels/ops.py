"""The public kernel entry points: one signature, dispatched to the reference or the Pallas implementation."""

from __future__ import annotations

import math

import jax.numpy as jnp

from . import attention_pallas, gdn_pallas, indexing, moe_pallas, moe_reference, qmatmul_pallas
from .attention_reference import decode_attention_reference
from . import qmatmul_reference as reference
from .dispatch import resolve
from .gdn_reference import gated_delta_decode_reference, gated_delta_step_reference
from .quant_meta import QuantMeta

# Rows up to which a dense layer inside a [G, N, K] stack is read in place by the Pallas kernel: below ~200 rows a
# BF16 matmul on an H200 is bound by the weight read (989 TFLOP/s ÷ 4.8 TB/s ≈ 206 FLOP/B, a row is 1 FLOP/B), so
# XLA's sliced copy would cost more than the matmul; above, cuBLAS wins and one copy is spread over many rows.
DENSE_IN_STACK_MAX_ROWS = 128


def matmul(x: jnp.ndarray, w: jnp.ndarray, *, impl: str | None = None, layer=None) -> jnp.ndarray:
    """``x [..., K] @ wᵀ`` → ``[..., N]`` in x's dtype (fp32 accumulation) for an unquantized weight ``w [N, K]``.

    ``layer``: ``w`` is a ``[L, N, K]`` layer stack and this is layer ``layer``. With the Pallas kernels, at most
    :data:`DENSE_IN_STACK_MAX_ROWS` rows and N, K on the kernel's blocks the layer is read inside the stack;
    otherwise it is sliced out for XLA's dot (which, up to :data:`.qmatmul_reference.FEW_ROWS` rows, reads it in
    place: :func:`.qmatmul_reference.matmul_accumulated`).
    """
    which = resolve(impl, x.dtype)
    rows = math.prod(x.shape[:-1])
    if layer is not None and which in ("pallas", "interpret") and 0 < rows <= DENSE_IN_STACK_MAX_ROWS:
        # a layer the kernel cannot read in place (N or K off its blocks: the 1-row shared_expert_gate) goes to
        # XLA, which reads such a small slice inside its own fusion: one kernel instead of a pad copy + the kernel
        if qmatmul_pallas.dense_in_stack_ok(rows, *w.shape[1:], w.dtype, x.dtype):
            return qmatmul_pallas.matmul_pallas(x, w, interpret=which == "interpret", layer=layer)
    return reference.matmul(x, w if layer is None else indexing.take(w, layer))


def qmatmul(x: jnp.ndarray, packed, scale, zero, meta: QuantMeta, *, impl: str | None = None,
            layer=None) -> jnp.ndarray:
    """``x [..., K] @ dequant(W)ᵀ`` → ``[..., N]`` in x's dtype, fp32 accumulation (see :mod:`.qmatmul_reference`).

    ``layer``: the arrays carry a leading layer-stack axis ``[L, N, ·]`` and this is layer ``layer`` (the Pallas
    kernel reads it in place; the references index it).
    """
    which = resolve(impl, x.dtype)
    if which in ("reference", "xla"):  # the reference already dequantizes the whole weight, then one dot
        if layer is not None:
            packed, scale, zero = (None if a is None else indexing.take(a, layer) for a in (packed, scale, zero))
        return reference.qmatmul(x, packed, scale, zero, meta)

    return qmatmul_pallas.qmatmul_pallas(x, packed, scale, zero, meta, interpret=which == "interpret", layer=layer)


def _experts_of_layer(gate_up: tuple, down: tuple, layer):
    """``(gate_up, down, num_experts, offset)``: with ``layer``, the ``[L, E, …]`` stacks flattened to ``[L·E, …]``
    (a bitcast) and layer ``layer``'s E experts starting at ``offset``; without, as given (None, None)."""
    if layer is None:
        return gate_up, down, None, None
    stack, num_experts = gate_up[0].shape[:2]
    flat = lambda a: None if a is None else a.reshape(stack * num_experts, *a.shape[2:])  # noqa: E731
    return ((*map(flat, gate_up[:3]), gate_up[3]), (*map(flat, down[:3]), down[3]), num_experts,
            jnp.asarray(layer, jnp.int32) * num_experts)


def moe_experts(x, idx, weights, gate_up: tuple, down: tuple, *, impl: str | None = None,
                layer=None) -> jnp.ndarray:
    """Routed SwiGLU experts with packed ``[E, …]`` weights → ``[N, H]`` in the accumulation dtype (float32; float64
    for float64 x; see :mod:`.moe_reference`); an unquantized stack is ``(w, None, None, dense_meta(...))``.

    ``layer``: the arrays carry a leading layer-stack axis (``[L, E, …]``, as the model's layer scan stores them)
    and this call is layer ``layer`` (an int32 scalar, may be traced). The kernels then read that layer's experts inside
    the stack: slicing it out first would copy all E experts of the layer on every call.
    """
    which = resolve(impl, x.dtype)
    gate_up, down, num_experts, offset = _experts_of_layer(gate_up, down, layer)
    if which == "reference":
        return moe_reference.moe_experts(x, idx, weights, gate_up, down, num_experts=num_experts, offset=offset)
    if which == "xla":
        return moe_reference.moe_experts_dequant_all(x, idx, weights, gate_up, down, num_experts=num_experts,
                                                     offset=offset)

    return moe_pallas.moe_experts_pallas(x, idx, weights, gate_up, down, interpret=which == "interpret",
                              num_experts=num_experts, expert_offset=offset)


def moe_routed(x, router_logits, top_k: int, gate_up: tuple, down: tuple, *, impl: str | None = None,
               layer=None) -> jnp.ndarray:
    """Routing (:func:`.moe_reference.route`) then :func:`moe_experts` → ``[N, H]`` in the accumulation dtype.

    ``router_logits [N, E]``; ``gate_up``, ``down``, ``layer`` as :func:`moe_experts`. With the Pallas kernels and
    one token (batch-1 decode) the kernels route from the logits themselves (:func:`.moe_pallas.moe_routed_pallas`):
    no softmax / top-k kernels between the router and the experts.
    """
    which = resolve(impl, x.dtype)
    if which in ("pallas", "interpret") and moe_pallas.routes_inside(x.shape[0]):
        gate_up, down, _, offset = _experts_of_layer(gate_up, down, layer)
        return moe_pallas.moe_routed_pallas(x, router_logits, top_k, gate_up, down, interpret=which == "interpret",
                                            expert_offset=offset)
    weights, idx = moe_reference.route(router_logits, top_k)
    return moe_experts(x, idx, weights, gate_up, down, impl=which, layer=layer)


def gated_delta_step(q, k, v, g, beta, state, *, impl: str | None = None, layer=None):
    """One decode token of the gated delta rule: ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``, ``state
    [B, Hv, Dk, Dv]`` in the accumulation dtype → ``(o [B, Hv, Dv]`` in q's dtype, new state); see
    :mod:`.gdn_pallas`.

    ``layer``: ``state`` is the ``[L, B, …]`` stack of the layer scan and this is layer ``layer``; the whole stack
    comes back with that layer's state replaced (the kernel writes it in place). With the Pallas kernels (and
    power-of-two head dims) one kernel does the l2-norms, the decay, the delta update and the readout; otherwise the
    reference (:func:`.gdn_reference.gated_delta_step_reference`).
    """
    which = resolve(impl, q.dtype)
    if which in ("pallas", "interpret") and gdn_pallas.supported(q.shape, v.shape):
        return gdn_pallas.gated_delta_step_pallas(q, k, v, g, beta, state, layer=layer,
                                                  interpret=which == "interpret")
    return gated_delta_step_reference(q, k, v, g, beta, state, layer=layer)


def gated_delta_decode(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, *,
                       impl: str | None = None, layer=None, weight_layer=None, keep=None):
    """One decode token of a Gated DeltaNet layer from its input projections: the causal conv step over the window,
    SiLU, the q/k/v split, ``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)`` and the recurrence →
    ``(o [B, Hv, Dv]`` in mixed_qkv's dtype, new conv window, new recurrent state); shapes, ``layer`` (both states
    are ``[L, …]`` stacks, updated in place), ``weight_layer`` (conv_weight, A_log, dt_bias are ``[L', …]`` stacks,
    read in place) and ``keep`` (``[B]`` bool: False leaves a padding row's states as they are) as
    :func:`.gdn_reference.gated_delta_decode_reference`.

    With the Pallas kernels (and power-of-two head dims) one kernel does it all (:func:`.gdn_pallas.
    gated_delta_decode_pallas`); otherwise the reference, the model's unfused ops in their order.
    """
    which = resolve(impl, mixed_qkv.dtype)
    if which in ("pallas", "interpret") and gdn_pallas.decode_supported(mixed_qkv.shape[-1], recurrent_state.shape,
                                                                        conv_weight.shape[-1]):
        return gdn_pallas.gated_delta_decode_pallas(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias,
                                                    recurrent_state, layer=layer, weight_layer=weight_layer,
                                                    keep=keep, interpret=which == "interpret")
    return gated_delta_decode_reference(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state,
                                        layer=layer, weight_layer=weight_layer, keep=keep)


def decode_attention(q, k_stack, v_stack, allowed, *, layer, kv_len: int, impl: str | None = None):
    """One query per row against layer ``layer`` of the ``[G, B, Hkv, S, D]`` K/V cache stacks (the first ``kv_len``
    slots; ``allowed [B, kv_len]`` bool) → ``[B, Hq, D]`` in q's dtype; see
    :func:`.attention_reference.decode_attention_reference`.

    With the Pallas kernels (a power-of-two head dim, ≤ 16 query heads per kv head, the cache in q's dtype) two
    kernels read the layer in place (:func:`.attention_pallas.decode_attention_pallas`); otherwise the reference,
    which slices the layer out (an FP8 cache is dequantized by the caller).
    """
    which = resolve(impl, q.dtype)
    if (which in ("pallas", "interpret") and attention_pallas.supported(q.shape, k_stack.shape)
            and k_stack.dtype == v_stack.dtype == q.dtype):
        return attention_pallas.decode_attention_pallas(q, k_stack, v_stack, allowed, layer=layer, kv_len=kv_len,
                                                        interpret=which == "interpret")
    return decode_attention_reference(q, k_stack, v_stack, allowed, layer=layer, kv_len=kv_len)
