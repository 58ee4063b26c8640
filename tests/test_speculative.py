"""MTP speculative decoding (qjax.runtime.speculative): greedy output token-identical to plain greedy generate for
k = 1 … 4 on a left-padded batch whose rows have different lengths; the verify round accepts exactly the drafts the
main model agrees with; refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax
from qjax.runtime import speculative

pytestmark = pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)


@pytest.fixture(scope="module")
def mtp_model(official_dir):
    """The tiny model in the official layout: it carries a (random) mtp.* head."""
    return qjax.load_model(official_dir)


def _batch(vocab: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (3, 20)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :11] = 0
    return ids, mask


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculative_equals_plain_greedy(mtp_model, k):
    ids, mask = _batch(mtp_model.config.vocab_size)
    plain = qjax.generate(mtp_model, ids, attention_mask=mask, max_new_tokens=21, eos_token_id=[], do_sample=False)
    spec, stats = qjax.generate(mtp_model, ids, attention_mask=mask, max_new_tokens=21, eos_token_id=[],
                                do_sample=False, speculative="mtp", num_speculative_tokens=k, return_stats=True)
    np.testing.assert_array_equal(spec, plain)
    assert stats.num_speculative_tokens == k and stats.rounds >= 1
    assert 1.0 <= stats.mean_accepted_length <= k + 1 and len(stats.acceptance_per_position) == k


def test_verify_round_accepts_exactly_the_agreeing_drafts(mtp_model):
    """Drafts cut from plain greedy decoding: right for the first j tokens of each row, then wrong — the round
    accepts j, emits the greedy tokens, and the next round continues the greedy sequence."""
    ids, mask = _batch(mtp_model.config.vocab_size)
    k = 4
    plain = qjax.generate(mtp_model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], do_sample=False)
    greedy = plain[:, ids.shape[1]:]
    b, size = ids.shape[0], ids.shape[1] + 12 + k + 1
    graphdef, state = nnx.split(mtp_model)
    cache = mtp_model.init_cache(b, size, spec_tokens=k + 1)
    mtp_cache = mtp_model.init_mtp_cache(b, size)
    first, _, cache, mtp_cache = speculative.prefill(graphdef, state, cache, mtp_cache, jnp.asarray(ids),
                                                     jnp.asarray(mask), k)
    np.testing.assert_array_equal(np.asarray(first), greedy[:, 0])
    right = np.array([0, 2, 4])  # drafts right per row
    drafts = greedy[:, 1:1 + k].copy()
    for r, j in enumerate(right):
        drafts[r, j:] = (drafts[r, j:] + 1) % mtp_model.config.vocab_size  # wrong from draft j + 1 on
    g, consumed, _, cache, mtp_cache = speculative.verify_round(graphdef, state, cache, mtp_cache, first,
                                                                jnp.asarray(drafts))
    np.testing.assert_array_equal(np.asarray(consumed), right + 1)
    for r in range(b):
        np.testing.assert_array_equal(np.asarray(g)[r, :right[r] + 1], greedy[r, 1:right[r] + 2])
    # the next round, fed perfect drafts, emits the continuation of each row's greedy sequence
    last = np.asarray(g)[np.arange(b), np.asarray(consumed) - 1]
    at = 2 + right  # index in `greedy` of each row's next token
    drafts = np.stack([greedy[r, at[r]:at[r] + k] for r in range(b)])
    g, consumed, _, _, _ = speculative.verify_round(graphdef, state, cache, mtp_cache, jnp.asarray(last),
                                                    jnp.asarray(drafts))
    np.testing.assert_array_equal(np.asarray(consumed), [k + 1] * b)
    for r in range(b):
        np.testing.assert_array_equal(np.asarray(g)[r, :k], drafts[r])


def test_refusals(mtp_model, tiny_hf):
    ids, _ = _batch(mtp_model.config.vocab_size)
    no_head = qjax.load_model(tiny_hf[1])
    with pytest.raises(ValueError, match="no mtp"):
        qjax.generate(no_head, ids, max_new_tokens=4, do_sample=False, speculative="mtp")
    with pytest.raises(ValueError, match="must be 'mtp'"):
        qjax.generate(mtp_model, ids, max_new_tokens=4, do_sample=False, speculative="eagle")
    with pytest.raises(ValueError, match="greedy only"):
        qjax.generate(mtp_model, ids, max_new_tokens=4, do_sample=True, speculative="mtp")
    with pytest.raises(ValueError, match="≥ 1"):
        qjax.generate(mtp_model, ids, max_new_tokens=4, do_sample=False, speculative="mtp",
                      num_speculative_tokens=0)


def test_stream_and_cli_emit_the_same_tokens(mtp_model, official_dir, capsys):
    """qjax.stream(speculative='mtp') yields, position by position, what plain stream yields (rows stopping at a stop
    token at different times: padded); `qjax generate --speculative mtp` prints what it prints without."""
    from qjax.cli import main

    ids, mask = _batch(mtp_model.config.vocab_size)
    plain = qjax.generate(mtp_model, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], do_sample=False)
    stop = int(plain[1, ids.shape[1] + 5])  # row 1 stops after 6 tokens (other rows where that token shows up)
    kw = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=[stop], pad_token_id=0, do_sample=False)
    want = np.stack(list(qjax.stream(mtp_model, ids, **kw)), axis=1)
    got = np.stack(list(qjax.stream(mtp_model, ids, speculative="mtp", num_speculative_tokens=3, **kw)), axis=1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(qjax.generate(mtp_model, ids, speculative="mtp", num_speculative_tokens=3, **kw),
                                  np.concatenate([ids, want], axis=1))

    prompt = " ".join(map(str, ids[0, 5:]))
    outs = []
    for extra in ([], ["--speculative", "mtp", "--num-speculative-tokens", "2"]):
        assert main(["generate", "--model", official_dir, "--ids", prompt, "--max-new-tokens", "9", "--no-do-sample",
                     *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0].split()) == 9
