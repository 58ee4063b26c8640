"""Gated delta rule: chunked vs exact recurrence, and both against transformers' torch reference functions.

Tolerance 1e-5: the two forms compute the same fp32 math in a different order; measured ≈3e-7 (docs/model.md §2.5).
In float64 the two forms agree to 1e-12 (measured ≤ 2e-15).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qjax.model import gdn
from qjax.model.gdn import cumsum_two_float, unit_lower_inverse

# Jitted, as the model runs them: called op by op, each call compiled ~190 small programs (~4 s a test on 2 cores).
chunk_gated_delta_rule = jax.jit(gdn.chunk_gated_delta_rule, static_argnames="chunk_size")
recurrent_gated_delta_rule = jax.jit(gdn.recurrent_gated_delta_rule)


def _inputs(b, t, hk, hv, dk, dv, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hk, dk)).astype(np.float32)
    k = rng.normal(size=(b, t, hk, dk)).astype(np.float32)
    v = rng.normal(size=(b, t, hv, dv)).astype(np.float32)
    g = (-np.abs(rng.normal(size=(b, t, hv))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))).astype(np.float32)
    s0 = (rng.normal(size=(b, hv, dk, dv)) * 0.2).astype(np.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t", [1, 63, 64, 65, 77, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(t, with_state):
    q, k, v, g, beta, s0 = _inputs(2, t, 2, 4, 16, 12, seed=t)
    init = jnp.asarray(s0) if with_state else None
    args = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    o_r, s_r = recurrent_gated_delta_rule(*args, init)
    o_c, s_c = chunk_gated_delta_rule(*args, init)
    assert np.abs(np.asarray(o_r) - np.asarray(o_c)).max() <= 1e-5
    assert np.abs(np.asarray(s_r) - np.asarray(s_c)).max() <= 1e-5


@pytest.mark.parametrize("c", [1, 2, 16, 64])
def test_unit_lower_inverse(c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.normal(size=(3, c, c)).astype(np.float32) * 0.2, -1) + np.eye(c, dtype=np.float32)
    junk = np.triu(rng.normal(size=(3, c, c)).astype(np.float32), 1)  # above the diagonal: must be ignored
    inv = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(a + junk)))
    np.testing.assert_allclose(inv @ a, np.broadcast_to(np.eye(c), a.shape), atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        unit_lower_inverse(jnp.eye(6))


def test_chunked_gradient_matches_recurrent():
    """AutoRound and training differentiate the chunked form: its gradient must be the recurrence's."""
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 4, 8, 8, seed=3)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    w = jnp.asarray(np.random.default_rng(4).normal(size=(1, 70, 4, 8)).astype(np.float32))

    def loss(rule):
        return lambda *a: jnp.sum(rule(*a, jnp.asarray(s0))[0] * w)

    want = jax.jit(jax.grad(loss(recurrent_gated_delta_rule), argnums=(0, 1, 2, 3, 4)))(*args)
    got = jax.jit(jax.grad(loss(chunk_gated_delta_rule), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_against_transformers_reference():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hfm

    q, k, v, g, beta, s0 = _inputs(2, 77, 3, 6, 12, 20, seed=0)
    t = torch.from_numpy
    o_ref, s_ref = hfm.torch_recurrent_gated_delta_rule(
        t(q), t(k), t(v), t(g), t(beta), initial_state=t(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ch, s_ch = hfm.torch_chunk_gated_delta_rule(
        t(q), t(k), t(v), t(g), t(beta), initial_state=t(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    o_r, s_r = recurrent_gated_delta_rule(*args, jnp.asarray(s0))
    o_c, s_c = chunk_gated_delta_rule(*args, jnp.asarray(s0))
    assert np.abs(np.asarray(o_r) - o_ref.numpy()).max() <= 1e-5
    assert np.abs(np.asarray(s_r) - s_ref.numpy()).max() <= 1e-5
    assert np.abs(np.asarray(o_c) - o_ch.numpy()).max() <= 1e-5
    assert np.abs(np.asarray(s_c) - s_ch.numpy()).max() <= 1e-5


def test_zero_beta_and_decay_steps_leave_state_unchanged():
    """Padding is β = g = 0 (and zero q/k/v): the state passes through untouched in both forms."""
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 4, 8, 8, seed=1)
    beta[:] = 0
    g[:] = 0
    args = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        _, s = rule(*args, jnp.asarray(s0))
        assert np.abs(np.asarray(s) - s0).max() <= 1e-6


@pytest.mark.parametrize("t", [63, 65, 130])
def test_chunked_equals_recurrent_in_float64(t, x64):
    jax.config.update("jax_enable_x64", True)
    q, k, v, g, beta, s0 = _inputs(2, t, 3, 6, 12, 20, seed=t)
    args = tuple(jnp.asarray(a, jnp.float64) for a in (q, k, v, g, beta))
    o_r, s_r = recurrent_gated_delta_rule(*args, jnp.asarray(s0, jnp.float64))
    o_c, s_c = chunk_gated_delta_rule(*args, jnp.asarray(s0, jnp.float64))
    assert o_c.dtype == s_c.dtype == jnp.float64
    assert np.abs(np.asarray(o_r) - np.asarray(o_c)).max() <= 1e-12
    assert np.abs(np.asarray(s_r) - np.asarray(s_c)).max() <= 1e-12


def test_chunked_float32_as_accurate_as_the_recurrence(x64):
    """The in-chunk decays exp(γ_i − γ_j) from a two-float cumulative sum: with one float32 cumsum, strongly decaying
    heads (|γ| in the tens) made the chunked output 10× further from the float64 truth than the recurrence (measured
    max 2.7–6.5e-7 against 3–5e-8); now both are ≈4e-8."""
    rng = np.random.default_rng(0)
    b, t, hk, hv, dk, dv = 2, 90, 3, 6, 12, 20
    q, k = rng.normal(size=(b, t, hk, dk)), rng.normal(size=(b, t, hk, dk))
    v = rng.normal(size=(b, t, hv, dv)) * 0.5
    g = -rng.uniform(0.01, 16, hv) * np.log1p(np.exp(rng.normal(size=(b, t, hv)) + 1)) * 0.1
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))
    f32 = [np.asarray(a, np.float32) for a in (q, k, v, g, beta)]
    jax.config.update("jax_enable_x64", True)
    truth = np.asarray(chunk_gated_delta_rule(*(jnp.asarray(a, jnp.float64) for a in f32))[0])
    chunked = np.abs(np.asarray(chunk_gated_delta_rule(*map(jnp.asarray, f32))[0], np.float64) - truth).max()
    recurrent = np.abs(np.asarray(recurrent_gated_delta_rule(*map(jnp.asarray, f32))[0], np.float64) - truth).max()
    assert chunked <= 2 * recurrent, (chunked, recurrent)


def test_cumsum_two_float_carries_twice_the_precision(x64):
    g = -np.abs(np.random.default_rng(1).normal(size=(5, 64)) * 3).astype(np.float32)
    hi, lo = jax.jit(cumsum_two_float)(jnp.asarray(g))
    exact = np.cumsum(g.astype(np.float64), axis=-1)
    got = np.asarray(hi, np.float64) + np.asarray(lo, np.float64)
    # the pair holds the exact sum to ~2^-44 of its size; one float32 cumsum is ~2^-24 off
    assert np.abs(got - exact).max() <= 1e-11 * np.abs(exact).max()
    assert np.abs(np.cumsum(g, axis=-1) - exact).max() > 1e-7 * np.abs(exact).max()
