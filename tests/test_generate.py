"""Cached generation: prefill + decode vs the full forward, greedy parity with transformers.generate, left-padded
batches, sampling processors against transformers' warpers, stop tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from oracles.hf import hf_generate_greedy

import qjax
from qjax.runtime.generate import process_logits

TOL = 1e-4  # transformers' own cached vs full forward differs by up to 8.3e-5 (docs/model.md §9)


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    return tiny_hf[0], qjax.load_model(tiny_hf[1])


@pytest.mark.parametrize("prefill", [12, 63, 64, 65])
@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_prefill_then_decode_equals_full_forward(tiny, prefill):
    _, model = tiny
    total = prefill + 12
    ids = np.random.default_rng(prefill).integers(0, 512, (2, total)).astype(np.int32)
    full = np.asarray(model(ids))
    cache = model.init_cache(2, total)
    logits, cache = qjax.extend(model, cache, ids[:, :prefill])
    steps = [np.asarray(logits)]
    for t in range(prefill, total):
        logits, cache = qjax.extend(model, cache, ids[:, t:t + 1])
        steps.append(np.asarray(logits))
    assert np.abs(np.concatenate(steps, axis=1) - full).max() <= TOL


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_float64_prefill_then_decode_equals_full_forward(tiny_hf, x64):
    """In float64 the cached path is the full forward to 1e-12 (the chunked vs token-by-token delta rule and the
    cache's K/V and float64 recurrent state are the only differences)."""
    model = qjax.load_model(tiny_hf[1], dtype="float64")
    total, prefill = 78, 65
    ids = np.random.default_rng(5).integers(0, 512, (2, total)).astype(np.int32)
    full = np.asarray(model(ids))
    cache = model.init_cache(2, total)
    assert cache.slots[0].recurrent.dtype == jnp.float64 and cache.slots[0].conv.dtype == jnp.float64
    logits, cache = qjax.extend(model, cache, ids[:, :prefill])
    steps = [np.asarray(logits)]
    for t in range(prefill, total):
        logits, cache = qjax.extend(model, cache, ids[:, t:t + 1])
        steps.append(np.asarray(logits))
    got = np.concatenate(steps, axis=1)
    assert got.dtype == np.float64
    assert np.abs(got - full).max() <= 1e-12
    out = qjax.generate(model, ids[:, :20], max_new_tokens=4, eos_token_id=[])  # greedy on float64 logits
    assert out.shape == (2, 24)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_multi_token_continuation_from_cache(tiny):
    _, model = tiny
    ids = np.random.default_rng(1).integers(0, 512, (1, 90)).astype(np.int32)
    full = np.asarray(model(ids))
    cache = model.init_cache(1, 90)
    a, cache = qjax.extend(model, cache, ids[:, :40])
    b, cache = qjax.extend(model, cache, ids[:, 40:])
    assert np.abs(np.concatenate([np.asarray(a), np.asarray(b)], 1) - full).max() <= TOL


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_greedy_matches_transformers_generate(tiny):
    hf, model = tiny
    prompt = np.array([[172, 47, 117, 192, 323, 251, 195, 359, 9, 211]])
    ours = qjax.generate(model, prompt, max_new_tokens=32)
    theirs = hf_generate_greedy(hf, prompt, 32)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_left_padded_batch_equals_each_prompt_alone(tiny):
    _, model = tiny
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, n) for n in (5, 70, 33)]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    batch = qjax.generate(model, ids, attention_mask=mask, max_new_tokens=16)
    for i, p in enumerate(prompts):
        alone = qjax.generate(model, p[None], max_new_tokens=16)
        np.testing.assert_array_equal(batch[i, width:], alone[0, len(p):])


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_prompt_lengths_and_max_new_tokens_share_one_decode_loop(tiny):
    """The cache is rounded up to whole blocks (cache_length) and the step count is an argument: calls with other
    prompt lengths and max_new_tokens within one block run the decode loop already compiled (its tokens against
    transformers: test_greedy_matches_transformers_generate), and a shorter run is the longer one's start."""
    from qjax.runtime.generate import decode_loop

    _, model = tiny
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 512, (1, 9)).astype(np.int32)
    long = qjax.generate(model, prompt, max_new_tokens=20, eos_token_id=[])
    compiled = decode_loop._cache_size()
    short = qjax.generate(model, prompt, max_new_tokens=3, eos_token_id=[])
    np.testing.assert_array_equal(short, long[:, :12])
    for t, new in ((4, 11), (30, 7)):
        out = qjax.generate(model, rng.integers(0, 512, (1, t)), max_new_tokens=new, eos_token_id=[])
        assert out.shape == (1, t + new)
    assert decode_loop._cache_size() == compiled


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_stop_tokens_and_padding(tiny):
    _, model = tiny
    prompt = np.array([[172, 47, 117, 192, 323, 251, 195, 359, 9, 211]])
    free = qjax.generate(model, prompt, max_new_tokens=12)[0, 10:]
    stop = int(free[3])
    out = qjax.generate(model, prompt, max_new_tokens=12, eos_token_id=[stop], pad_token_id=0)[0, 10:]
    first = int(np.argmax(free == stop))
    np.testing.assert_array_equal(out[:first + 1], free[:first + 1])
    assert len(out) == first + 1  # a single row stops the loop as soon as it emits its stop token


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_stream_yields_the_same_tokens_as_generate(tiny):
    _, model = tiny
    prompt = np.array([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, seed=123)
    streamed = np.stack(list(qjax.stream(model, prompt, **kw)), axis=1)
    np.testing.assert_array_equal(streamed, qjax.generate(model, prompt, **kw)[:, 4:])
    # seeded: same seed same tokens, other seed (almost surely) other tokens
    np.testing.assert_array_equal(qjax.generate(model, prompt, **kw), qjax.generate(model, prompt, **kw))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 20, 1.0), (0.7, 0, 0.8), (1.3, 50, 0.95), (1.0, 1, 1.0)])
def test_logit_processors_match_transformers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32) * 3
    x = torch.from_numpy(logits.copy())
    if temperature != 1.0:
        x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    ours = np.asarray(process_logits(jnp.asarray(logits), temperature=temperature, top_k=top_k, top_p=top_p))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(x.numpy()))
    finite = ~np.isinf(ours)
    np.testing.assert_allclose(ours[finite], x.numpy()[finite], rtol=1e-6)


def test_sampling_follows_the_distribution():
    """Seeded sampling of a fixed 3-way distribution: empirical frequencies within 3σ of the probabilities."""
    from qjax.runtime.generate import next_token

    logits = jnp.log(jnp.array([[0.6, 0.3, 0.1, 1e-9]], jnp.float32)).repeat(4000, axis=0)
    toks = np.asarray(next_token(logits, jax.random.key(0), do_sample=True, temperature=1.0, top_k=0, top_p=1.0))
    freq = np.bincount(toks, minlength=4) / len(toks)
    sigma = np.sqrt(0.6 * 0.4 / len(toks))
    assert abs(freq[0] - 0.6) < 3 * sigma and freq[3] == 0


def test_bad_generation_arguments(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="max_new_tokens"):
        qjax.generate(model, np.array([[1, 2]]), max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids must be in"):
        qjax.generate(model, np.array([[1, 9999]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="left-padded"):
        qjax.generate(model, np.array([[1, 2, 3]]), attention_mask=np.array([[1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        qjax.generate(model, np.array([[1, 2]]), max_new_tokens=2, do_sample=True, top_p=0.0)
