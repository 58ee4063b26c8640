"""One decode step of the gated delta rule as a single Pallas (Triton backend) kernel, beside its plain-JAX reference.

At batch-1 decode a Gated DeltaNet layer's recurrence is tiny (32 heads × a 128×128 fp32 state) but XLA splits it
into five kernels (the q/k l2-norms, the decay, ``Sᵀk``, the update, ``Sᵀq``) that each read the 2 MB state; the
step is launch-bound (docs/kernels.md: "batch 1 is latency-bound"). Here one program per (row, value head, block of
``BV`` value columns) does it all on a ``[Dk, BV]`` tile of the state held in registers — the columns of the state
are independent in the delta rule:

    q̂ = q / ‖q‖ · Dk^−½,  k̂ = k / ‖k‖     (ε = 1e-6 inside the root, FLA's and transformers' l2norm)
    S ← e^g · S;   S ← S + k̂ ⊗ β (v − Sᵀk̂);   o = Sᵀq̂

Value head ``h`` reads q/k head ``h // (Hv / Hk)`` (repeat-interleave, docs/model.md §8.11). Everything is fp32; ``o``
is returned in q's dtype, the new state in fp32. The reference is :func:`.gdn_reference.gated_delta_step_reference` (the
recurrence for one token (same contract, same op order; the fp32 sums differ in order only).

:func:`gated_delta_decode_pallas` is the model's whole decode token after the input projections in one kernel (the
unfused path was seven launches per layer: the conv step, the q/k/v split (two), the decay, β, the recurrence and the
window's write into the cache stack): the causal conv step of every channel from the window and the new input, SiLU,
``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)``, the recurrence above, and the conv window and state
written in place inside their ``[L, …]`` stacks. Its reference is
:func:`.gdn_reference.gated_delta_decode_reference` (the model's unfused ops, in their order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .gdn_reference import decode_heads, gated_delta_decode_reference, gated_delta_step_reference

__all__ = ["decode_supported", "gated_delta_decode_pallas", "gated_delta_decode_reference", "gated_delta_step_pallas",
           "gated_delta_step_reference", "lowering_cases", "supported"]

_BV = 32  # value columns per program: a [128, 32] fp32 tile is 16 KB of registers for 4 warps


def supported(q_shape, v_shape) -> bool:
    """Power-of-two head dims (Triton tensors) with at least 16 elements, and value heads a multiple of qk heads."""
    dk, hk, hv, dv = q_shape[-1], q_shape[-2], v_shape[-2], v_shape[-1]
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and hv % hk == 0


def _kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, eps: float, bv: int):
    """Program (b, h, j): value head h of row b, value columns ``[j·BV, (j+1)·BV)``; the state is the whole
    ``[L, B, Hv, Dk, Dv]`` stack (aliased to ``s_out_ref``), indexed at the asked layer: read and written in place."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lyr = layer_ref[0]
    q = q_ref[0, 0, :].astype(jnp.float32)  # [Dk]
    k = k_ref[0, 0, :].astype(jnp.float32)
    v = v_ref[0, 0, :].astype(jnp.float32)  # [BV]
    g = g_ref[0, 0].astype(jnp.float32)
    beta = beta_ref[0, 0].astype(jnp.float32)
    q = q * lax.rsqrt(jnp.sum(q * q) + eps)
    q = q * (q.shape[0] ** -0.5)
    k = k * lax.rsqrt(jnp.sum(k * k) + eps)
    rows = lax.iota(jnp.int32, q.shape[0])[:, None]
    cols = (j * bv + lax.iota(jnp.int32, bv))[None, :]
    s = plgpu.load(s_ref.at[lyr, b, h, rows, cols]) * jnp.exp(g)  # [Dk, BV]
    kv_mem = jnp.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o_ref[0, 0, :] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    plgpu.store(s_out_ref.at[lyr, b, h, rows, cols], s)


def _forward(q, k, v, g, beta, state, layer, interpret: bool):
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    bv = min(_BV, dv)
    qk_spec = pl.BlockSpec((1, 1, dk), lambda i, h, j: (i, h // rep, 0))
    whole = pl.BlockSpec(state.shape, lambda i, h, j: (0,) * state.ndim)
    o, s = pl.pallas_call(
        functools.partial(_kernel, eps=1e-6, bv=bv),
        out_shape=(jax.ShapeDtypeStruct((b, hv, dv), q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        grid=(b, hv, dv // bv),
        in_specs=[pl.BlockSpec((1,), lambda i, h, j: (0,)), qk_spec, qk_spec,
                  pl.BlockSpec((1, 1, bv), lambda i, h, j: (i, h, j)),
                  pl.BlockSpec((1, 1), lambda i, h, j: (i, h)),
                  pl.BlockSpec((1, 1), lambda i, h, j: (i, h)),
                  whole],
        out_specs=(pl.BlockSpec((1, 1, bv), lambda i, h, j: (i, h, j)), whole),
        input_output_aliases={6: 1},  # the state stack is updated in place: only this layer's tiles are written
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qjax_gdn_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, g, beta, state)
    return o, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _step(q, k, v, g, beta, state, layer, interpret):
    return _forward(q, k, v, g, beta, state, layer, interpret)


def _step_fwd(q, k, v, g, beta, state, layer, interpret):
    return _forward(q, k, v, g, beta, state, layer, interpret), (q, k, v, g, beta, state, layer)


def _step_bwd(interpret, res, cts):
    del interpret
    *args, layer = res
    _, vjp = jax.vjp(lambda *a: gated_delta_step_reference(*a, layer=layer), *args)
    return (*vjp(cts), None)


_step.defvjp(_step_fwd, _step_bwd)


def gated_delta_step_pallas(q, k, v, g, beta, state, *, layer=None, interpret: bool = False):
    """:func:`gated_delta_step_reference`'s contract through one Pallas kernel (``interpret=True``: on CPU).

    ``layer``: ``state`` is a ``[L, B, Hv, Dk, Dv]`` stack and this is layer ``layer`` (an int32 scalar, may be
    traced): its state is read and written inside the stack (aliased: no copy of the layer out or back in) and the
    stack is returned. Differentiable (backward through the reference). Shapes the kernel cannot take (see
    :func:`supported`) raise.
    """
    b, hk, dk = q.shape
    lead = () if layer is None else state.shape[:1]
    if k.shape != q.shape or v.shape[0] != b or g.shape != v.shape[:2] or beta.shape != g.shape \
            or state.shape != (*lead, b, v.shape[1], dk, v.shape[2]) or state.dtype != jnp.float32:
        raise ValueError(f"gated delta step: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                         f"state {state.shape} {state.dtype} do not fit q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta "
                         "[B, Hv], float32 state [(L,) B, Hv, Dk, Dv]")
    if not supported(q.shape, v.shape):
        raise ValueError(f"gated delta step kernel: head dims {dk}/{v.shape[2]} must be powers of two ≥ 16 and "
                         f"{v.shape[1]} value heads a multiple of {hk} qk heads")
    if layer is None:
        o, s = _step(q, k, v, g, beta, state[None], jnp.zeros((), jnp.int32), bool(interpret))
        return o, s[0]
    return _step(q, k, v, g, beta, state, jnp.asarray(layer, jnp.int32), bool(interpret))


# ---------------------------------------------------------------------------------------------------------------------
# The fused decode token: conv step + SiLU + decay + β + recurrence + window and state written back, one kernel
# ---------------------------------------------------------------------------------------------------------------------
# fp32 state elements a program updates at once: a [128, 64] tile (half a value head of Qwen3.6) is 32 KB, 32
# registers a thread with 8 warps, leaving room for the products the sums over Dk reduce
_TILE = 128 * 64


def decode_supported(conv_channels: int, recurrent_shape, kernel: int) -> bool:
    """The fused decode kernel takes power-of-two head dims ≥ 16 (Triton tensors), value heads a multiple of the qk
    heads, and a conv of at least 2 taps."""
    try:
        decode_heads(conv_channels, recurrent_shape)
    except ValueError:
        return False
    dk, dv = recurrent_shape[-2:]
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    return pow2(dk) and pow2(dv) and kernel >= 2


def _decode_kernel(layer_ref, weight_layer_ref, keep_ref, x_ref, a_ref, b_ref, w_ref, a_log_ref, dt_bias_ref, conv_ref,
                   s_ref, o_ref, conv_out_ref, s_out_ref, *, rep: int, key_dim: int, bv: int, eps: float,
                   barrier: bool):
    """Program (b, h): row b, qk head h and its ``rep`` value heads — every conv channel this group reads (q and k
    of head h, v of its value heads) and no other, so each window channel and state tile is read and written by this
    program alone and the window can be updated in place. (A grid over (row, value head, column block), as
    :func:`gated_delta_step_pallas`'s, has Hv/Hk · Dv/BV programs reading each q/k channel: whichever wrote its new
    window first would feed the others a half-shifted one.)

    Within the program a barrier separates the window's reads from its writes: a Triton tensor may be held by several
    threads (replicas in other warps), and without it one thread could store a channel's new window before a replica
    has loaded the old one. The interpreter runs sequentially and has no barrier.

    The states are ``[L, …]`` stacks read at ``layer_ref[0]``, the conv weight, A_log and dt_bias ``[L', …]`` stacks
    read at ``weight_layer_ref[0]``.
    """
    bi, hk = pl.program_id(0), pl.program_id(1)
    lyr, wl = layer_ref[0], weight_layer_ref[0]
    keep = plgpu.load(keep_ref.at[bi])  # bool: loaded as stored (a convert outside would be one more launch)
    dtype, f32 = o_ref.dtype, jnp.float32
    taps = w_ref.shape[-1]
    dk, dv = s_ref.shape[-2:]

    def conv_silu(ch):
        """The conv step of channels ``ch`` (int32 ``[n]``) → (its SiLU ``[n]`` in the model dtype, the K inputs
        ``[n]``: window then new), rounded where the unfused path rounds: the taps summed in fp32 in order, then the
        sum and the SiLU each rounded to the model dtype."""
        xs = [plgpu.load(conv_ref.at[lyr, bi, i, ch]).astype(dtype) for i in range(taps - 1)]
        xs.append(plgpu.load(x_ref.at[bi, ch]))
        y = 0.0
        for i in range(taps):
            y = y + xs[i].astype(f32) * plgpu.load(w_ref.at[wl, ch, i]).astype(f32)
        y = y.astype(dtype).astype(f32)
        return (y / (1 + jnp.exp(-y))).astype(dtype), xs

    def store_window(ch, xs):
        """The window shifted by the new input (as it was on a padding row)."""
        for i in range(taps - 1):
            plgpu.store(conv_out_ref.at[lyr, bi, i, ch],
                        jnp.where(keep, xs[i + 1], xs[i]).astype(conv_out_ref.dtype))

    def normed(x):
        x = x.astype(f32)
        return x * lax.rsqrt(jnp.sum(x * x) + eps)

    iq = lax.iota(jnp.int32, dk)
    q_ch, k_ch = hk * dk + iq, key_dim + hk * dk + iq
    q, q_in = conv_silu(q_ch)
    k, k_in = conv_silu(k_ch)
    q = normed(q) * (dk ** -0.5)
    k = normed(k)
    if barrier:
        plgpu.debug_barrier()
    store_window(q_ch, q_in)
    store_window(k_ch, k_in)
    rows = iq[:, None]
    for r in range(rep):
        h = hk * rep + r
        x = plgpu.load(a_ref.at[bi, h]).astype(f32) + plgpu.load(dt_bias_ref.at[wl, h]).astype(f32)
        softplus = jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))  # jax.nn.softplus's formula
        g = -jnp.exp(plgpu.load(a_log_ref.at[wl, h]).astype(f32)) * softplus
        b = plgpu.load(b_ref.at[bi, h]).astype(f32)
        beta = (1 / (1 + jnp.exp(-b))).astype(b_ref.dtype).astype(f32)  # sigmoid, rounded as the unfused path
        g = jnp.where(keep, g, 0.0)
        beta = jnp.where(keep, beta, 0.0)
        for j in range(dv // bv):
            cols = j * bv + lax.iota(jnp.int32, bv)
            v_ch = 2 * key_dim + h * dv + cols
            v, v_in = conv_silu(v_ch)
            s = plgpu.load(s_ref.at[lyr, bi, h, rows, cols[None, :]]) * jnp.exp(g)  # [Dk, BV]
            kv_mem = jnp.sum(s * k[:, None], axis=0)
            delta = (v.astype(f32) - kv_mem) * beta
            s = s + k[:, None] * delta[None, :]
            o = jnp.sum(s * q[:, None], axis=0)
            if barrier:
                plgpu.debug_barrier()
            plgpu.store(o_ref.at[bi, h, cols], o.astype(dtype))
            plgpu.store(s_out_ref.at[lyr, bi, h, rows, cols[None, :]], s)
            store_window(v_ch, v_in)


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))


def _decode_forward(x, a, b, conv, w, a_log, dt_bias, s, layer, weight_layer, keep, interpret: bool):
    bsz = x.shape[0]
    hk, hv, dk, dv = decode_heads(x.shape[1], s.shape)
    index = lambda i: jnp.reshape(i, (1,)).astype(jnp.int32)
    operands = (index(layer), index(weight_layer), keep, x, a, b, w, a_log, dt_bias, conv, s)
    return pl.pallas_call(
        functools.partial(_decode_kernel, rep=hv // hk, key_dim=hk * dk, bv=min(dv, max(16, _TILE // dk)), eps=1e-6,
                          barrier=not interpret),
        out_shape=(jax.ShapeDtypeStruct((bsz, hv, dv), x.dtype), jax.ShapeDtypeStruct(conv.shape, conv.dtype),
                   jax.ShapeDtypeStruct(s.shape, jnp.float32)),
        grid=(bsz, hk),
        in_specs=[_whole(op.shape) for op in operands],
        out_specs=(_whole((bsz, hv, dv)), _whole(conv.shape), _whole(s.shape)),
        input_output_aliases={9: 1, 10: 2},  # the window and state stacks: only this layer's entries are written
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="qjax_gdn_decode_fused",
    )(*operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _decode(x, a, b, conv, w, a_log, dt_bias, s, layer, weight_layer, keep, interpret):
    return _decode_forward(x, a, b, conv, w, a_log, dt_bias, s, layer, weight_layer, keep, interpret)


def _decode_fwd(x, a, b, conv, w, a_log, dt_bias, s, layer, weight_layer, keep, interpret):
    args = (x, a, b, conv, w, a_log, dt_bias, s, layer, weight_layer, keep)
    return _decode_forward(*args, interpret), args


def _decode_bwd(interpret, res, cts):
    del interpret
    *args, layer, weight_layer, keep = res
    _, vjp = jax.vjp(lambda *a: gated_delta_decode_reference(*a, layer=layer, weight_layer=weight_layer,
                                                             keep=keep), *args)
    return (*vjp(cts), None, None, None)


_decode.defvjp(_decode_fwd, _decode_bwd)


def gated_delta_decode_pallas(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, *,
                              layer=None, weight_layer=None, keep=None, interpret: bool = False):
    """:func:`gated_delta_decode_reference`'s contract through one Pallas kernel (``interpret=True``: on CPU).

    Grid ``(B, Hk)``: a program per row and qk head, owning the conv channels of that head's q and k and of its
    Hv/Hk value heads (their window entries: read and written by it alone) and those value heads' states, updated in
    ``[Dk, min(Dv, 8192/Dk)]`` fp32 tiles. ``layer``: the window ``[L, B, K-1, C]`` and the state
    ``[L, B, Hv, Dk, Dv]`` are layer stacks (aliased to the outputs: read and written in place) and this is layer
    ``layer``;
    ``weight_layer``: the conv weight ``[L', C, K]``, A_log and dt_bias ``[L', Hv]`` are stacks read at that entry
    (no copy of the layer's slice). Both int32 scalars, may be traced. Differentiable (backward through the
    reference). Shapes the kernel cannot take (see :func:`decode_supported`) raise.
    """
    bsz, c = mixed_qkv.shape
    lead = () if layer is None else recurrent_state.shape[:1]
    wlead = () if weight_layer is None else conv_weight.shape[:1]
    kernel = conv_weight.shape[-1]
    hv = recurrent_state.shape[-3]
    if (a.shape != (bsz, hv) or b.shape != a.shape or conv_weight.shape != (*wlead, c, kernel)
            or conv_state.shape != (*lead, bsz, kernel - 1, c) or A_log.shape != (*wlead, hv)
            or dt_bias.shape != A_log.shape or recurrent_state.shape[:len(lead) + 2] != (*lead, bsz, hv)
            or recurrent_state.ndim != len(lead) + 4 or recurrent_state.dtype != jnp.float32
            or (keep is not None and keep.shape != (bsz,))):
        raise ValueError(f"gated delta decode: mixed_qkv {mixed_qkv.shape}, a {a.shape}, b {b.shape}, conv_state "
                         f"{conv_state.shape}, conv_weight {conv_weight.shape}, A_log {A_log.shape}, dt_bias "
                         f"{dt_bias.shape}, recurrent_state {recurrent_state.shape} {recurrent_state.dtype}, keep "
                         f"{None if keep is None else keep.shape} do not fit mixed_qkv [B, C], a/b [B, Hv], "
                         "conv_state [(L,) B, K-1, C], conv_weight [(L',) C, K], A_log/dt_bias [(L',) Hv], float32 "
                         "recurrent_state [(L,) B, Hv, Dk, Dv], keep [B]")
    if not decode_supported(c, recurrent_state.shape, kernel):
        raise ValueError(f"gated delta decode kernel: {c} conv channels, state {recurrent_state.shape}, {kernel} "
                         "taps: the channels must split into q, k [Hk·Dk] and v [Hv·Dv] with Hv a multiple of Hk, "
                         "head dims powers of two ≥ 16, at least 2 taps")
    keep = jnp.ones((bsz,), jnp.bool_) if keep is None else keep.astype(jnp.bool_)
    zero = jnp.zeros((), jnp.int32)
    if weight_layer is None:
        conv_weight, A_log, dt_bias = conv_weight[None], A_log[None], dt_bias[None]
    weight_layer = zero if weight_layer is None else jnp.asarray(weight_layer, jnp.int32)
    if layer is None:
        o, conv, s = _decode(mixed_qkv, a, b, conv_state[None], conv_weight, A_log, dt_bias, recurrent_state[None],
                             zero, weight_layer, keep, bool(interpret))
        return o, conv[0], s[0]
    return _decode(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state,
                   jnp.asarray(layer, jnp.int32), weight_layer, keep, bool(interpret))


def lowering_cases() -> list[tuple[str, Callable, tuple[jax.ShapeDtypeStruct, ...]]]:
    """Qwen3.6-35B-A3B's GDN decode (16 qk heads, 32 value heads, Dk = Dv = 128, conv kernel 4 over 8192 channels,
    bf16; states and weights read inside 10-layer stacks) at batch 1, 8, 64: the recurrence alone
    (:func:`gated_delta_step_pallas`) and the fused token (:func:`gated_delta_decode_pallas`, with a padding mask)."""
    sds = jax.ShapeDtypeStruct
    cases = []
    for b in (1, 8, 64):
        specs = (sds((b, 16, 128), jnp.bfloat16), sds((b, 16, 128), jnp.bfloat16), sds((b, 32, 128), jnp.bfloat16),
                 sds((b, 32), jnp.float32), sds((b, 32), jnp.bfloat16), sds((10, b, 32, 128, 128), jnp.float32),
                 sds((), jnp.int32))

        def fn(q, k, v, g, beta, state, layer):
            return gated_delta_step_pallas(q, k, v, g, beta, state, layer=layer, interpret=False)
        cases.append((f"gdn_decode_b{b}", fn, specs))
    for b in (1, 8, 64):
        specs = (sds((b, 8192), jnp.bfloat16), sds((b, 32), jnp.bfloat16), sds((b, 32), jnp.bfloat16),
                 sds((10, b, 3, 8192), jnp.bfloat16), sds((10, 8192, 4), jnp.bfloat16), sds((10, 32), jnp.float32),
                 sds((10, 32), jnp.float32), sds((10, b, 32, 128, 128), jnp.float32), sds((), jnp.int32),
                 sds((b,), jnp.bool_))

        def fused(x, a, b_in, conv, w, a_log, dt_bias, state, layer, keep):
            return gated_delta_decode_pallas(x, a, b_in, conv, w, a_log, dt_bias, state, layer=layer,
                                             weight_layer=layer, keep=keep, interpret=False)
        cases.append((f"gdn_decode_fused_b{b}", fused, specs))
    return cases
