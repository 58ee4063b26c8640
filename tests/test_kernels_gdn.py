"""The GDN decode-step kernel (kernels/gdn_pallas.py) vs its plain-JAX reference (qjax.model.gdn's recurrence for one
token).

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
from h200_util import TRITON_TARGET, lower_for_h200, pallas_grids
from qjax.kernels import gated_delta_step, gdn_pallas
from qjax.kernels.gdn_pallas import gated_delta_step_pallas, gated_delta_step_reference, lowering_cases

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
