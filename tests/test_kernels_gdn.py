"""The GDN decode kernels (kernels/gdn_pallas.py) vs their plain-JAX references: the recurrence step (qjax.model.gdn's
recurrence for one token) and the fused decode token (conv step, SiLU, decay, β and the recurrence; the reference
checked bit for bit against the model's unfused ops).

Interpret mode on CPU, random data (never zeros), every head ratio the kernel takes; the state read and written in
place inside a layer stack; gradients; the lowering for an abstract H200. Tolerances: float32 1e-6 relative (the
kernel and the reference run the same fp32 ops; only the order of the Dk-long sums differs); bf16 activations are
upcast to fp32 inside both, so the output differs by at most one bf16 rounding of nearly equal fp32 values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from h200_util import TRITON_TARGET, lower_for_h200, pallas_grids
from qjax.kernels import gated_delta_decode, gated_delta_step, gdn_pallas, sigmoid, silu
from qjax.kernels.gdn_pallas import (
    gated_delta_decode_pallas,
    gated_delta_decode_reference,
    gated_delta_step_pallas,
    gated_delta_step_reference,
    lowering_cases,
)

from qjax.model.qwen3_5_moe import Conv1d

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated:DeprecationWarning"),
]


def _data(b, hk, hv, dk, dv, dtype, *, layers=None, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, hk, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hk, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hv, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.0, 3.0, (b, hv)), jnp.float32)  # log decay ≤ 0
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, hv)), dtype)
    lead = () if layers is None else (layers,)
    state = jnp.asarray(rng.standard_normal((*lead, b, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("b, hk, hv, dk, dv, dtype", [
    (1, 2, 4, 16, 32, jnp.float32),     # GQA-style value heads 2 per qk head, Dv > Dk, one value block
    (3, 4, 4, 32, 64, jnp.float32),     # one value head per qk head, two value blocks, odd batch
    (2, 2, 8, 64, 16, jnp.bfloat16),    # 4 value heads per qk head, Dv < the 32-column block
    (1, 16, 32, 128, 128, jnp.bfloat16),  # Qwen3.6-35B-A3B
])
def test_matches_reference(b, hk, hv, dk, dv, dtype):
    args = _data(b, hk, hv, dk, dv, dtype, seed=b + hv)
    o, s = jax.jit(lambda *a: gated_delta_step_pallas(*a, interpret=True))(*args)
    o_ref, s_ref = jax.jit(gated_delta_step_reference)(*args)
    assert o.shape == (b, hv, dv) and o.dtype == dtype and s.dtype == jnp.float32
    assert _rel(s, s_ref) <= 1e-6
    assert _rel(o, o_ref) <= (1e-6 if dtype == jnp.float32 else 8e-3)


def test_layer_in_stack():
    """``layer=``: only that layer of the [L, B, …] stack changes, to the reference's state; the others are the same
    bits; through the ops entry point for every implementation."""
    q, k, v, g, beta, stack = _data(2, 2, 4, 16, 32, jnp.float32, layers=3, seed=7)
    want_o, want_s = gated_delta_step_reference(q, k, v, g, beta, stack[1])
    for impl in ("reference", "interpret"):
        o, s = jax.jit(lambda *a: gated_delta_step(*a[:6], layer=a[6], impl=impl))(q, k, v, g, beta, stack,
                                                                                   jnp.int32(1))
        assert s.shape == stack.shape
        assert _rel(o, want_o) <= 1e-6 and _rel(s[1], want_s) <= 1e-6, impl
        np.testing.assert_array_equal(np.asarray(s[0]), np.asarray(stack[0]))
        np.testing.assert_array_equal(np.asarray(s[2]), np.asarray(stack[2]))


@pytest.mark.parametrize("b", [1, 3])
def test_grid_is_one_layer(b):
    """The state stack is read and written whole (aliased), and the grid is one layer's ``(B, Hv, Dv/32)`` programs
    (Qwen3.6's heads), whatever the stack's length: no program of another layer is launched."""
    sds = jax.ShapeDtypeStruct
    specs = (sds((b, 16, 128), jnp.bfloat16), sds((b, 16, 128), jnp.bfloat16), sds((b, 32, 128), jnp.bfloat16),
             sds((b, 32), jnp.float32), sds((b, 32), jnp.bfloat16))
    want = [("qjax_gdn_decode", (b, 32, 4))]
    for lead in ((), (10,), (40,)):
        state = sds((*lead, b, 32, 128, 128), jnp.float32)
        layer = () if not lead else (sds((), jnp.int32),)
        def fn(*a):
            return gated_delta_step_pallas(*a[:6], layer=a[6] if len(a) > 6 else None, interpret=True)

        assert pallas_grids(fn, *specs, state, *layer) == want, lead


def test_grads_match_reference():
    args = _data(2, 2, 4, 16, 32, jnp.float32, seed=3)
    rng = np.random.default_rng(4)
    co = jnp.asarray(rng.standard_normal((2, 4, 32)), jnp.float32)
    cs = jnp.asarray(rng.standard_normal((2, 4, 16, 32)), jnp.float32)

    def loss(f):
        def fn(*a):
            o, s = f(*a)
            return jnp.sum(o * co) + jnp.sum(s * cs)
        return jax.jit(jax.grad(fn, argnums=tuple(range(6))))

    got = loss(lambda *a: gated_delta_step_pallas(*a, interpret=True))(*args)
    want = loss(gated_delta_step_reference)(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_unsupported_shapes():
    q, k, v, g, beta, s = _data(1, 2, 6, 16, 24, jnp.float32)  # Dv 24: not a power of two
    assert not gdn_pallas.supported(q.shape, v.shape)
    with pytest.raises(ValueError, match="head dims 16/24 must be powers of two"):
        gated_delta_step_pallas(q, k, v, g, beta, s, interpret=True)
    # the entry point falls back to the reference for such shapes
    o, _ = gated_delta_step(q, k, v, g, beta, s, impl="interpret")
    assert _rel(o, gated_delta_step_reference(q, k, v, g, beta, s)[0]) == 0
    with pytest.raises(ValueError, match=r"float32 state \[\(L,\) B, Hv, Dk, Dv\]"):
        gated_delta_step_pallas(q, k, v[:, :4, :16], g[:, :4], beta[:, :4], s[:, :4, :, :16].astype(jnp.bfloat16),
                                interpret=True)


@pytest.mark.parametrize("name, fn, specs", [pytest.param(*c, id=c[0]) for c in lowering_cases()])
def test_lowers_for_h200(name, fn, specs):
    text = lower_for_h200(fn, specs)
    assert text.count(TRITON_TARGET) == 1 and "mosaic_gpu" not in text


# ---------------------------------------------------------------------------------------------------------------------
# The fused decode token (gated_delta_decode): conv step + SiLU + decay + β + recurrence, window and state in place
# ---------------------------------------------------------------------------------------------------------------------
def _decode_data(b, hk, hv, dk, dv, dtype, *, layers=3, weight_layers=2, kernel=4, seed=0):
    """Random inputs of one decode token: (mixed_qkv, a, b, conv stack, conv weight stack, A_log / dt_bias stacks,
    state stack, keep) — the window and state stacks of ``layers`` layers, the weights of ``weight_layers``."""
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    x = jnp.asarray(rng.standard_normal((b, c)), dtype)
    a = jnp.asarray(rng.standard_normal((b, hv)), dtype)
    b_in = jnp.asarray(rng.standard_normal((b, hv)), dtype)
    conv = jnp.asarray(rng.standard_normal((layers, b, kernel - 1, c)), dtype)
    w = jnp.asarray(rng.standard_normal((weight_layers, c, kernel)) * kernel ** -0.5, dtype)
    a_log = jnp.asarray(np.log(rng.uniform(0.01, 16.0, (weight_layers, hv))), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((weight_layers, hv)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((layers, b, hv, dk, dv)), jnp.float32)
    keep = jnp.asarray(np.arange(b) % 3 != 1)  # row 1 (of 2 or more) is padding
    return x, a, b_in, conv, w, a_log, dt_bias, state, keep


@pytest.mark.parametrize("b, hk, hv, dk, dv, dtype", [
    (1, 2, 4, 16, 32, jnp.float32),     # 2 value heads per qk head, Dv > Dk
    (3, 4, 4, 32, 64, jnp.float32),     # one value head per qk head, odd batch with a padding row
    (2, 2, 8, 64, 16, jnp.bfloat16),    # 4 value heads per qk head, Dv < Dk
    (2, 1, 2, 128, 128, jnp.bfloat16),  # Qwen3.6's head dims: two [128, 64] column blocks per value head
])
def test_decode_matches_reference(b, hk, hv, dk, dv, dtype):
    """Layer 1 of 3-layer window and state stacks, weights at entry 1 of 2: the kernel's output, window and state
    against the reference; the other layers' entries keep their bits (the window is data movement: exact)."""
    *args, keep = _decode_data(b, hk, hv, dk, dv, dtype, seed=b + hv + dk)
    layer, weight_layer = jnp.int32(1), jnp.int32(1)

    def run(f):
        return jax.jit(lambda *a: f(*a, layer=layer, weight_layer=weight_layer, keep=keep))(*args)

    o, conv, s = run(lambda *a, **kw: gated_delta_decode_pallas(*a, **kw, interpret=True))
    o_ref, conv_ref, s_ref = run(gated_delta_decode_reference)
    assert o.shape == (b, hv, dv) and o.dtype == dtype and conv.dtype == dtype and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(conv), np.asarray(conv_ref))
    assert _rel(s, s_ref) <= (1e-6 if dtype == jnp.float32 else 1e-5)
    assert _rel(o, o_ref) <= (1e-6 if dtype == jnp.float32 else 8e-3)
    for stack, new in ((args[3], conv), (args[7], s)):
        for other in (0, 2):
            np.testing.assert_array_equal(np.asarray(new[other]), np.asarray(stack[other]))
    if b > 1:  # the padding row keeps its window and state
        np.testing.assert_array_equal(np.asarray(conv[1, 1]), np.asarray(args[3][1, 1]))
        np.testing.assert_array_equal(np.asarray(s[1, 1]), np.asarray(args[7][1, 1]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_decode_reference_is_the_unfused_path(dtype, x64):
    """The reference is, bit for bit, what the model computed before the fusion: its Conv1d step (window read and
    shifted by ``span``), SiLU, the q/k/v split, the decay and β (zeroed on padding), then the recurrence."""
    if dtype == jnp.float64:
        jax.config.update("jax_enable_x64", True)
    hk, hv, dk, dv, b, kernel = 2, 4, 16, 32, 3, 4
    x, a, b_in, conv, w, a_log, dt_bias, state, keep = _decode_data(b, hk, hv, dk, dv, dtype, seed=11)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    a_log, dt_bias, state = a_log.astype(acc), dt_bias.astype(acc), state.astype(acc)

    def unfused(x, a, b_in, conv, w, a_log, dt_bias, state, keep):
        layer = 2
        conv1d = Conv1d(x.shape[-1], kernel, dtype=dtype, rngs=None)
        conv1d.weight = nnx.Param(w[layer, :, None, :])
        y, window = conv1d(x[:, None], conv[layer], keep.astype(jnp.int32))
        y = silu(y)
        q = y[..., :hk * dk].reshape(b, 1, hk, dk)
        k = y[..., hk * dk:2 * hk * dk].reshape(b, 1, hk, dk)
        v = y[..., 2 * hk * dk:].reshape(b, 1, hv, dv)
        g = -jnp.exp(a_log[layer].astype(acc)) * jax.nn.softplus(a[:, None].astype(acc) + dt_bias[layer].astype(acc))
        beta = sigmoid(b_in[:, None])
        beta = jnp.where(keep[:, None, None], beta, 0)
        g = jnp.where(keep[:, None, None], g, 0.0)
        o, s = gated_delta_step_reference(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, layer=layer)
        return o, conv.at[layer].set(window), s

    fused = jax.jit(lambda *a: gated_delta_decode_reference(*a[:8], layer=2, weight_layer=2, keep=a[8]))
    got = fused(x, a, b_in, conv, w, a_log, dt_bias, state, keep)
    want = jax.jit(unfused)(x, a, b_in, conv, w, a_log, dt_bias, state, keep)
    for g_, w_ in zip(got, want):
        assert g_.dtype == w_.dtype
        np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))


def test_decode_entry_point_and_unstacked():
    """``qjax.kernels.gated_delta_decode`` for every implementation, and without stacks (``layer`` /
    ``weight_layer`` None, no ``keep``): the same numbers as the stacked reference."""
    x, a, b_in, conv, w, a_log, dt_bias, state, _ = _decode_data(2, 2, 4, 16, 32, jnp.float32, seed=5)
    want = gated_delta_decode_reference(x, a, b_in, conv, w, a_log, dt_bias, state, layer=2, weight_layer=0)
    for impl in ("reference", "interpret"):
        got = jax.jit(lambda *a, impl=impl: gated_delta_decode(*a, impl=impl, layer=2, weight_layer=0))(
            x, a, b_in, conv, w, a_log, dt_bias, state)
        flat = jax.jit(lambda *a, impl=impl: gated_delta_decode(*a, impl=impl))(
            x, a, b_in, conv[2], w[0], a_log[0], dt_bias[0], state[2])
        for g_, f_, w_ in zip(got, flat, want):
            assert _rel(g_, w_) <= 1e-6, impl
        assert _rel(flat[0], want[0]) <= 1e-6 and _rel(flat[2], want[2][2]) <= 1e-6, impl
        np.testing.assert_array_equal(np.asarray(flat[1]), np.asarray(want[1][2]))


@pytest.mark.parametrize("b", [1, 3])
def test_decode_grid_is_one_layer(b):
    """One launch of ``(B, Hk)`` programs (Qwen3.6's heads) whatever the stacks' lengths: a program per row and qk
    head, none for other layers."""
    sds = jax.ShapeDtypeStruct
    for layers in (10, 40):
        specs = (sds((b, 8192), jnp.bfloat16), sds((b, 32), jnp.bfloat16), sds((b, 32), jnp.bfloat16),
                 sds((layers, b, 3, 8192), jnp.bfloat16), sds((layers, 8192, 4), jnp.bfloat16),
                 sds((layers, 32), jnp.float32), sds((layers, 32), jnp.float32),
                 sds((layers, b, 32, 128, 128), jnp.float32), sds((), jnp.int32))

        def fn(*a):
            return gated_delta_decode_pallas(*a[:8], layer=a[8], weight_layer=a[8], interpret=True)

        assert pallas_grids(fn, *specs) == [("qjax_gdn_decode_fused", (b, 16))], layers


def test_decode_grads_match_reference():
    *args, keep = _decode_data(2, 2, 4, 16, 32, jnp.float32, seed=9)
    rng = np.random.default_rng(10)
    cots = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 4, 32), args[3].shape, args[7].shape)]

    def grads(f):
        def loss(*a):
            return sum(jnp.sum(o * c) for o, c in zip(f(*a, layer=1, weight_layer=1, keep=keep), cots))
        return jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*args)

    got = grads(lambda *a, **kw: gated_delta_decode_pallas(*a, **kw, interpret=True))
    want = grads(gated_delta_decode_reference)
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-5, atol=1e-6)


def test_decode_unsupported_shapes():
    *args, keep = _decode_data(2, 2, 6, 16, 24, jnp.float32)  # Dv 24: not a power of two
    assert not gdn_pallas.decode_supported(args[0].shape[-1], args[7].shape, 4)
    with pytest.raises(ValueError, match="head dims powers of two"):
        gated_delta_decode_pallas(*args, layer=0, weight_layer=0, keep=keep, interpret=True)
    # the entry point falls back to the reference for such shapes
    got = gated_delta_decode(*args, impl="interpret", layer=0, weight_layer=0, keep=keep)
    want = gated_delta_decode_reference(*args, layer=0, weight_layer=0, keep=keep)
    for g_, w_ in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))
    with pytest.raises(ValueError, match=r"conv_weight \[\(L',\) C, K\]"):
        gated_delta_decode_pallas(*args[:4], args[4][0], *args[5:], layer=0, weight_layer=0, interpret=True)
