"""qjax.model.cache: rows at their own lengths, addressed by row, in right-padded chunks: a forward on any subset of a
cache's rows (in any order, with padding rows and a shorter attention window) gives each row the logits of its
sequence run alone, and leaves the other rows untouched."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.model.cache import CACHE_GRANULE, cache_length

TOL = 1e-4  # the cached-vs-full tolerance of tests/test_generate.py


@pytest.fixture(scope="module")
def model():
    return qjax.load_model(default_model_dir(), dtype=jnp.float32)


def test_cache_length_is_whole_blocks():
    assert [cache_length(t, n) for t, n in ((1, 1), (10, 118), (10, 119), (4000, 96), (4000, 97))] == [
        CACHE_GRANULE, 128, 256, 4096, 4224]
    assert CACHE_GRANULE == 128


@functools.partial(jax.jit, static_argnums=(0, 6))
def _fwd(graphdef, state, cache, ids, mask, rows, kv_len):
    out = nnx.merge(graphdef, state).forward(ids, attention_mask=mask, cache=cache, cache_rows=rows, kv_len=kv_len)
    return out.logits, out.cache


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_rows_in_chunks_equal_each_sequence_alone(model):
    g, s = nnx.split(model)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 4000, 45).tolist(), rng.integers(0, 4000, 11).tolist()
    cache = model.init_cache(3, 128)

    def chunk(rows_tokens, width, rows, kv_len=64):
        nonlocal cache
        ids = np.zeros((len(rows_tokens), width), np.int32)
        mask = np.zeros((len(rows_tokens), width), np.int32)
        for i, toks in enumerate(rows_tokens):
            ids[i, :len(toks)], mask[i, :len(toks)] = toks, 1
        logits, cache = _fwd(g, s, cache, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(rows, jnp.int32), kv_len)
        return np.asarray(logits)

    # row 0: a in chunks of 32 and 13 (right-padded to 32); row 2: b alone; the last batch row is padding (index 3)
    first = chunk([a[:32], b, []], 32, [0, 2, 3])
    second = chunk([a[32:]], 32, [0])
    full_a, full_b = np.asarray(model(np.asarray([a])))[0], np.asarray(model(np.asarray([b])))[0]
    assert np.abs(first[0] - full_a[:32]).max() <= TOL
    assert np.abs(second[0, :13] - full_a[32:]).max() <= TOL
    assert np.abs(first[1, :11] - full_b).max() <= TOL
    assert np.asarray(cache.lengths).tolist() == [45, 0, 11] and not np.asarray(cache.key_valid)[1].any()
    # decode both, listed in the other order and next to a padding row, each at its own position
    na, nb = int(full_a[-1].argmax()), int(full_b[-1].argmax())
    step = chunk([[nb], [na], []], 1, [2, 0, 3])
    want_a = np.asarray(model(np.asarray([a + [na]])))[0, -1]
    want_b = np.asarray(model(np.asarray([b + [nb]])))[0, -1]
    assert np.abs(step[1, 0] - want_a).max() <= TOL and np.abs(step[0, 0] - want_b).max() <= TOL
    assert np.asarray(cache.positions).tolist() == [46, 0, 12]
    # row 1 was never written: its GDN states are still zero
    for slot in cache.slots:
        for leaf in jax.tree.leaves(slot):
            if leaf.dtype == jnp.float32 and leaf.ndim >= 4 and not hasattr(slot, "k"):
                assert not np.asarray(leaf[:, 1]).any()


def test_reset_rows_empties_only_those_rows(model):
    cache = model.init_cache(3, 16)
    cache = cache.replace(lengths=jnp.array([5, 6, 7]), positions=jnp.array([5, 6, 7]),
                          key_valid=jnp.ones((3, 16), bool),
                          slots=tuple(jax.tree.map(jnp.ones_like, sl) for sl in cache.slots))
    out = cache.reset_rows(jnp.array([1, 3]))  # 3: out of range, ignored
    assert np.asarray(out.lengths).tolist() == [5, 0, 7] and np.asarray(out.positions).tolist() == [5, 0, 7]
    assert np.asarray(out.key_valid).sum(1).tolist() == [16, 0, 16]
    for sl in out.slots:
        if hasattr(sl, "conv"):
            assert not np.asarray(sl.recurrent[:, 1]).any() and np.asarray(sl.recurrent[:, 0]).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_accept_rolls_each_row_back_to_its_last_kept_token(dtype, x64):
    """A speculative verify call of n tokens (forward(keep_steps=True)) then Cache.accept(consumed): each row's GDN
    recurrent state and conv window, length and position equal those of plain decoding of its kept tokens alone,
    and a next token continues it with the same logits. float64: to 1e-12 of the largest entry (the logic is exact);
    float32: the verify call's projections run n rows at once where decoding runs one, a different matmul blocking
    (measured ≤ 1e-6 of the largest entry of the state, and of the conv window), so 1e-5."""
    model = qjax.load_model(default_model_dir(), dtype=dtype)
    tol = 1e-12 if dtype == "float64" else 1e-5
    g, s = nnx.split(model)
    rng = np.random.default_rng(4)
    b, t, n = 3, 9, 4
    prompt = rng.integers(0, model.config.vocab_size, (b, t)).astype(np.int32)
    more = rng.integers(0, model.config.vocab_size, (b, n)).astype(np.int32)
    consumed = np.array([1, 3, 4], np.int32)  # a row keeping 1 (only its last token), a partial and a whole call

    @functools.partial(jax.jit, static_argnums=(0, 4))
    def fwd(graphdef, state, cache, ids, keep_steps):
        out = nnx.merge(graphdef, state).forward(ids, cache=cache, keep_steps=keep_steps)
        return out.logits, out.cache

    spec = model.init_cache(b, t + n + 1, spec_tokens=n)
    _, spec = fwd(g, s, spec, jnp.asarray(prompt), False)
    _, spec = fwd(g, s, spec, jnp.asarray(more), True)
    spec = spec.accept(jnp.asarray(consumed))
    for r in range(b):
        plain = model.init_cache(1, t + n + 1)
        _, plain = fwd(g, s, plain, jnp.asarray(prompt[r:r + 1]), False)
        for i in range(consumed[r]):  # token by token, as plain decoding feeds them
            _, plain = fwd(g, s, plain, jnp.asarray(more[r:r + 1, i:i + 1]), False)
        assert int(spec.lengths[r]) == int(plain.lengths[0]) == t + consumed[r]
        assert int(spec.positions[r]) == int(plain.positions[0])
        assert not bool(jnp.any(spec.key_valid[r, t + consumed[r]:]))
        for mine, theirs in zip(spec.slots, plain.slots):
            if hasattr(mine, "recurrent"):
                want_state = np.asarray(theirs.recurrent[:, 0])
                assert np.abs(np.asarray(mine.recurrent[:, r]) - want_state).max() <= tol * np.abs(want_state).max()
                want_conv = np.asarray(theirs.conv[:, 0])
                assert np.abs(np.asarray(mine.conv[:, r]) - want_conv).max() <= tol * np.abs(want_conv).max()
        nxt = jnp.asarray(rng.integers(0, model.config.vocab_size, (1, 1)).astype(np.int32))
        want, _ = fwd(g, s, plain, nxt, False)
        got, _ = fwd(g, s, spec.prefix(b), jnp.broadcast_to(nxt, (b, 1)), False)
        np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want[0]), atol=TOL if dtype == "float32" else 1e-10,
                                   rtol=0)
