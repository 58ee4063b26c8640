"""qjax.runtime.sampling: the per-row sampler draws, row for row, exactly what qjax.generate's one-key sampler draws for
a batch of one — the property the serving engine's exactness rests on — and filters like transformers' warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.runtime.generate import next_token
from qjax.runtime.sampling import SamplingArrays, filter_logits, sample, split_keys, token_logprobs


@pytest.mark.parametrize("vocab", [7, 300, 4096])
def test_rows_draw_what_generate_draws_alone(vocab):
    rng = np.random.default_rng(vocab)
    settings = [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 20, 0.95), (1.0, vocab + 3, 0.5), (1.0, 1, 1.0)]
    logits = jnp.asarray(rng.normal(size=(len(settings), vocab)).astype(np.float32) * 3)
    seeds = [int(s) for s in rng.integers(0, 2 ** 31, len(settings))]
    t, k, p = (np.array(x) for x in zip(*settings))
    params = SamplingArrays.make(np.ones(len(settings), bool), t, k, p)
    keys = jnp.stack([jax.random.key(s) for s in seeds])
    for step in range(4):  # the key sequence: split once per token, as generate's decode loop does
        keys, sub = split_keys(keys)
        got = np.asarray(sample(logits, sub, params))
        for r, (temp, top_k, top_p) in enumerate(settings):
            key = jax.random.key(seeds[r])
            for _ in range(step + 1):
                key, ref_sub = jax.random.split(key)
            ref = next_token(logits[r:r + 1], ref_sub, do_sample=True, temperature=float(temp), top_k=int(top_k),
                             top_p=float(top_p))
            assert got[r] == int(ref[0]), (step, r, settings[r])


def test_greedy_rows_take_the_argmax_and_mix_with_sampled_rows():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32))
    params = SamplingArrays.make([False, True, False], [1.0, 0.5, 1.0], 0, 1.0)
    keys = jnp.stack([jax.random.key(i) for i in range(3)])
    got = np.asarray(sample(logits, keys, params))
    assert got[0] == int(np.argmax(logits[0])) and got[2] == int(np.argmax(logits[2]))
    alone = sample(logits[1:2], keys[1:2], SamplingArrays.make([True], 0.5, 0, 1.0))
    assert got[1] == int(alone[0])


def test_settings_that_are_off_leave_logits_unchanged():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32))
    out = filter_logits(x, SamplingArrays.make([True, True], 1.0, [0, 64], 1.0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_token_logprobs_from_raw_logits():
    x = np.random.default_rng(2).normal(size=(3, 40)).astype(np.float32)
    toks = np.array([0, 7, 39])
    lp, ids, top = token_logprobs(jnp.asarray(x), jnp.asarray(toks), 5)
    x64 = x.astype(np.float64)
    ref = x64 - np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x64.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(3), toks], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-x, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(top), np.sort(ref, axis=-1)[:, ::-1][:, :5], atol=2e-6)
