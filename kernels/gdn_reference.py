"""The gated delta rule's exact token-by-token recurrence (docs/model.md §2.5), the reference of the GDN kernels.

:func:`gated_delta_decode_reference` is one whole decode token of a Gated DeltaNet layer after its input
projections — the causal conv step and its window, SiLU, the decay and β, then the recurrence — in exactly the ops
and order of the model's unfused path, the reference of the fused decode kernel.

Everything runs in the accumulation dtype (:mod:`.precision`: float32, float64 for a float64 model) — a bf16
recurrent state corrupts long decodes (docs/model.md §8.3) — and every matmul asks for full precision so a GPU never
silently drops to TF32. The chunked form the model uses for multi-token
calls (:mod:`qjax.gdn`) builds on :func:`prepare` and is tested against :func:`recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import indexing
from .precision import accum_dtype, sigmoid, silu

HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    """``x · rsqrt(Σx² + eps)`` over the last axis: eps inside the sqrt, as FLA and transformers do."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare(q, k, v, g, beta):
    """Repeat qk heads onto v heads, move heads before time, go to the accumulation dtype, l2-normalise q/k and scale
    q.

    In: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; g, beta ``[B, T, Hv]``.
    Out: q, k ``[B, Hv, T, Dk]``; v ``[B, Hv, T, Dv]``; g, beta ``[B, Hv, T]`` — all in ``accum_dtype(q.dtype)``.
    """
    acc = accum_dtype(q.dtype)
    hk, hv = q.shape[2], v.shape[2]
    q, k, v, g, beta = (jnp.moveaxis(x.astype(acc), 2, 1) for x in (q, k, v, g, beta))
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    if hv != hk:
        # v head j reads qk head j // (hv/hk): repeat_interleave, not tile (docs/model.md §8.11). After the norm,
        # not before as transformers does: the same values (the norm is per head row), but the backward sums the
        # copies' cotangents before the norm's backward, which then runs on hk heads, not hv
        q = jnp.repeat(q, hv // hk, axis=1)
        k = jnp.repeat(k, hv // hk, axis=1)
    return q, k, v, g, beta


def zero_state(q, v):
    """The initial state ``[B, Hv, Dk, Dv]`` of prepared ``q``, ``v`` (in their dtype, the accumulation dtype)."""
    b, h, _, dk = q.shape
    return jnp.zeros((b, h, dk, v.shape[-1]), q.dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, all_states: bool = False):
    """Exact recurrence ``S ← e^g S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq``.

    Args:
      q, k: ``[B, T, Hk, Dk]``; v: ``[B, T, Hv, Dv]``; g (log decay, ≤ 0), beta: ``[B, T, Hv]``.
      initial_state: ``[B, Hv, Dk, Dv]`` in the accumulation dtype, or None (zeros).
      all_states: also return the state after every token (speculative decoding keeps them to roll back to the
        last accepted one).
    Returns:
      o ``[B, T, Hv, Dv]`` in q's dtype, final state ``[B, Hv, Dk, Dv]`` in the accumulation dtype; with
      ``all_states`` a third result, the states after each token ``[B, T, Hv, Dk, Dv]``.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta)
    s0 = zero_state(q, v) if initial_state is None else initial_state.astype(q.dtype)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, D] / [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)
        return s, ((o_t, s) if all_states else o_t)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    s, ys = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(ys[0] if all_states else ys, 0, 2)  # [B, H, T, Dv]
    o = jnp.moveaxis(o, 1, 2).astype(out_dtype)
    return (o, s, jnp.moveaxis(ys[1], 0, 1)) if all_states else (o, s)


def gated_delta_step_reference(q, k, v, g, beta, state, layer=None):
    """One token of the gated delta rule (plain JAX): ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``,
    ``state [B, Hv, Dk, Dv]`` in the accumulation dtype → ``(o [B, Hv, Dv]`` in q's dtype, new state).

    ``layer``: ``state`` is a ``[L, B, Hv, Dk, Dv]`` stack of layers' states and this is layer ``layer`` (int32, may
    be traced); the whole stack is returned with that layer's state replaced.
    """
    s0 = state if layer is None else indexing.take(state, layer)
    o, s = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], s0)
    if layer is not None:
        s = indexing.put(state, layer, s)
    return o[:, 0], s


def decode_heads(conv_channels: int, recurrent_shape) -> tuple[int, int, int, int]:
    """``(Hk, Hv, Dk, Dv)`` of a layer whose conv runs over ``conv_channels`` = ``2·Hk·Dk + Hv·Dv`` channels (q, k,
    then v, head-major: transformers' ``mixed_qkv``) and whose recurrent state is ``[(L,) B, Hv, Dk, Dv]``."""
    hv, dk, dv = recurrent_shape[-3:]
    rest = conv_channels - hv * dv
    if rest <= 0 or rest % (2 * dk) or hv % (rest // (2 * dk)):
        raise ValueError(f"gated delta decode: {conv_channels} conv channels do not split into q, k [Hk·{dk}] and "
                         f"v [{hv}·{dv}] with {hv} value heads a multiple of Hk")
    return rest // (2 * dk), hv, dk, dv


def gated_delta_decode_reference(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state,
                                 layer=None, weight_layer=None, keep=None):
    """One decode token of a Gated DeltaNet layer from its input projections (plain JAX; names as transformers').

    In:
      mixed_qkv ``[B, C]``: ``in_proj_qkv``'s output before the conv, C = 2·Hk·Dk + Hv·Dv (q, k, v head-major), in
        the model dtype; a, b ``[B, Hv]``: ``in_proj_a`` / ``in_proj_b`` (before softplus / sigmoid), model dtype;
      conv_state ``[B, K-1, C]``: the conv window (the last K-1 inputs), model dtype; conv_weight ``[C, K]``;
      A_log, dt_bias ``[Hv]`` (accumulation dtype); recurrent_state ``[B, Hv, Dk, Dv]``, accumulation dtype.
      layer: both states are ``[L, …]`` layer stacks and this is layer ``layer`` (int32, may be traced); the whole
        stacks come back with that layer replaced.
      weight_layer: conv_weight ``[L', C, K]``, A_log and dt_bias ``[L', Hv]`` are stacks (the model's layer scan
        passes them whole, so that the kernel reads them in place) and these are their entry ``weight_layer``.
      keep: ``[B]`` bool, False for a padding row (the serving engine's idle slots): its window and state are left
        as they are (its output is meaningless). None: every row is a token.
    Out: ``(o [B, Hv, Dv]`` in mixed_qkv's dtype, new conv_state, new recurrent_state).

    Op for op the model's unfused t = 1 path (``qjax.model.qwen3_5_moe.Conv1d`` with ``span`` = keep, ``silu``, the
    q/k/v split, ``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)``, β = g = 0 on padding, then
    :func:`gated_delta_step_reference`), so that swapping one for the other changes no bit.
    """
    hk, hv, dk, dv = decode_heads(mixed_qkv.shape[-1], recurrent_state.shape)
    bsz, kernel = mixed_qkv.shape[0], conv_weight.shape[-1]
    if weight_layer is not None:
        conv_weight, A_log, dt_bias = (indexing.take(p, weight_layer) for p in (conv_weight, A_log, dt_bias))
    dtype, acc = mixed_qkv.dtype, accum_dtype(mixed_qkv.dtype)
    window = conv_state if layer is None else indexing.take(conv_state, layer)  # [B, K-1, C]
    xc = jnp.concatenate([window.astype(dtype), mixed_qkv[:, None]], axis=1)  # [B, K, C]
    w = conv_weight.astype(acc)  # [C, K]
    xc32 = xc.astype(acc)
    # the taps in the model's order and rounding: Σ_i in acc (from Python's 0), rounded once to the model dtype
    y = sum(xc32[:, i:i + 1] * w[:, i] for i in range(kernel))  # [B, 1, C]
    mixed = silu(y.astype(dtype))[:, 0]
    new_window = xc[:, 1:] if keep is None else jnp.where(keep[:, None, None], xc[:, 1:], xc[:, :-1])
    q = mixed[:, :hk * dk].reshape(bsz, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(bsz, hk, dk)
    v = mixed[:, 2 * hk * dk:].reshape(bsz, hv, dv)
    g = -jnp.exp(A_log.astype(acc)) * jax.nn.softplus(a.astype(acc) + dt_bias.astype(acc))
    beta = sigmoid(b)
    if keep is not None:
        # β = g = 0 make a padding row's step an exact no-op on its state
        beta = jnp.where(keep[:, None], beta, 0)
        g = jnp.where(keep[:, None], g, 0.0)
    o, recurrent_state = gated_delta_step_reference(q, k, v, g, beta, recurrent_state, layer=layer)
    conv_state = (new_window.astype(conv_state.dtype) if layer is None
                  else indexing.put(conv_state, layer, new_window))
    return o, conv_state, recurrent_state
