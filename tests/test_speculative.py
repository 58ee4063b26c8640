"""MTP speculative decoding (qjax.runtime.speculative): greedy output token-identical to plain greedy generate for
k = 1 … 4 on a left-padded batch whose rows have different lengths; the verify round accepts exactly the drafts the
main model agrees with; sampling draws from the main model's own distribution (a chi-square test) and a seed
reproduces; refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

import qjax
from qjax.model.config import TextConfig
from qjax.runtime import speculative
from qjax.runtime.generate import process_logits
from qjax.runtime.sampling import SamplingArrays
from oracles.hf import tiny_text_config

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


def test_builtin_model_speculates_the_same_tokens():
    """The built-in model and its trained head (qjax/assets/default): greedy speculation emits plain greedy's tokens
    for held-out prompts of different lengths in one left-padded batch, k = 1 and 4, and its drafts are accepted far
    more often than a random head's (acceptance means something: the head is trained). k = 1 … 4 each on a random
    head: test_greedy_speculative_equals_plain_greedy; k = 2 and 3 with this head: the server's and the engine's
    tests (each k is its own compile, ~9 s on 2 cores)."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.tokenizer import Tokenizer

    folder = default_model_dir()
    model = qjax.load_model(folder, dtype=jnp.float32)
    tok = Tokenizer.from_folder(folder)
    texts = ["It is a truth universally acknowledged, that a single man", "Emma Woodhouse,",
             "The family of Dashwood had long been settled in Sussex."]
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=[], do_sample=False)
    plain = qjax.generate(model, ids, **kw)
    for k in (1, 4):
        spec, stats = qjax.generate(model, ids, speculative="mtp", num_speculative_tokens=k, return_stats=True, **kw)
        np.testing.assert_array_equal(spec, plain)
        if k == 1:
            assert stats.acceptance_per_position[0] > 0.3, stats  # a random head is right ~1/4096 of the time


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
    greedy_rows, keys = SamplingArrays.zeros(b), speculative.row_keys(0, b)
    first, _, cache, mtp_cache, keys = speculative.prefill(graphdef, state, cache, mtp_cache, jnp.asarray(ids),
                                                           jnp.asarray(mask), keys, greedy_rows, k)
    np.testing.assert_array_equal(np.asarray(first), greedy[:, 0])
    right = np.array([0, 2, 4])  # drafts right per row
    drafts = greedy[:, 1:1 + k].copy()
    for r, j in enumerate(right):
        drafts[r, j:] = (drafts[r, j:] + 1) % mtp_model.config.vocab_size  # wrong from draft j + 1 on
    g, consumed, _, cache, mtp_cache, keys = speculative.verify_round(graphdef, state, cache, mtp_cache, first,
                                                                      jnp.asarray(drafts), keys, greedy_rows)
    np.testing.assert_array_equal(np.asarray(consumed), right + 1)
    for r in range(b):
        np.testing.assert_array_equal(np.asarray(g)[r, :right[r] + 1], greedy[r, 1:right[r] + 2])
    # the next round, fed perfect drafts, emits the continuation of each row's greedy sequence
    last = np.asarray(g)[np.arange(b), np.asarray(consumed) - 1]
    at = 2 + right  # index in `greedy` of each row's next token
    drafts = np.stack([greedy[r, at[r]:at[r] + k] for r in range(b)])
    g, consumed, *_ = speculative.verify_round(graphdef, state, cache, mtp_cache, jnp.asarray(last),
                                               jnp.asarray(drafts), keys, greedy_rows)
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


# ---------------------------------------------------------------------------------------------------------------------
# sampling: the rejection rule keeps the main model's distribution
# ---------------------------------------------------------------------------------------------------------------------
SAMPLES = 4000
FALSE_ALARM = 1e-3  # a correct sampler fails one of these chi-square tests with probability ≤ 1e-3 per seed
SETTINGS = dict(temperature=0.7, top_k=6, top_p=1.0)


@pytest.fixture(scope="module")
def small_vocab():
    """A random model with an MTP head over 8 tokens: every continuation of 3 tokens can be enumerated."""
    cfg = TextConfig.from_dict(tiny_text_config(vocab_size=8, mtp_num_hidden_layers=1), source="test")
    return qjax.init_model(cfg, seed=5, with_mtp=True)


def _exact_joint(model, prompt, n: int, **settings) -> np.ndarray:
    """P(t_1 … t_n | prompt) under plain sampling with ``settings``, ``[V] * n``, from the model's own logits."""
    v = model.config.vocab_size
    joint = np.ones((1,))
    for i in range(n):
        conts = np.indices((v,) * i, np.int32).reshape(i, v ** i).T  # [v^i, i], the last token fastest
        ids = np.concatenate([np.repeat(prompt[None], v ** i, axis=0), conts], axis=1)
        logits = model(ids)[:, -1]
        p = np.asarray(jax.nn.softmax(process_logits(logits, **settings), axis=-1), np.float64)
        joint = (joint[:, None] * p).reshape(-1)
    return joint.reshape((v,) * n)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``; cells expecting < 5 are pooled into one."""
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    assert counts[probs == 0].sum() == 0, "a token the target distribution cannot emit was emitted"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def test_acceptance_rule_per_position():
    """One verify call on made-up target logits (k = 3, 6 tokens, 20,000 rows; rows 0 mod 4 greedy): at every draft
    position j, the rows that accepted drafts 1 … j emit a token distributed as p_j (the accepted draft with
    probability p_j(d_j), a residual draw otherwise) — a chi-square test per position. Power check: the rule with
    the residual drawn from p_j itself (the rejected draft not removed) is rejected by the same test."""
    k, v, n = 3, 6, 20_000
    rng = np.random.default_rng(0)
    logits = np.tile(rng.normal(size=(1, k + 1, v)) * 2.0, (n, 1, 1)).astype(np.float32)
    p = np.asarray(jax.nn.softmax(jnp.asarray(logits[0]), axis=-1), np.float64)  # [k + 1, V]
    drafts = np.tile(np.argsort(-p[:k], axis=-1)[:, 0], (n, 1)).astype(np.int32)  # the likeliest: deep rows exist
    do_sample = np.arange(n) % 4 != 0
    sampling = SamplingArrays.make(do_sample, 1.0, 0, 1.0)
    tokens, consumed = jax.jit(speculative.accept)(jnp.asarray(logits), jnp.asarray(drafts),
                                                   speculative.row_keys(3, n), sampling)
    tokens, consumed = np.asarray(tokens), np.asarray(consumed)
    greedy = np.argmax(logits[0], axis=-1)
    want = np.sum(np.cumprod(drafts[0] == greedy[:k]))
    assert np.all(consumed[~do_sample] == want + 1) and np.all(tokens[~do_sample] == greedy)
    tokens, consumed = tokens[do_sample], consumed[do_sample]
    for j in range(k + 1):
        reached = consumed > j  # rows whose first j tokens are the accepted drafts 1 … j
        assert np.all(tokens[reached, :j] == drafts[0, :j]) and reached.sum() > 1000
        counts = np.bincount(tokens[reached, j], minlength=v)
        assert _chi_square_p(counts, p[j]) > FALSE_ALARM, j
        if j < k:  # the wrong rule: d stays in the residual, so it comes out p(d) + (1 − p(d)) p(d) of the time
            d = drafts[0, j]
            wrong = (1 - p[j, d]) * p[j]
            wrong[d] += p[j, d]
            assert _chi_square_p(counts, wrong) < FALSE_ALARM, j


def test_sampling_draws_from_the_target_distribution(small_vocab):
    """4,000 seeded rows of one prompt, k = 2: the joint distribution of their first 3 tokens (tokens 2 and 3 come
    through the acceptance rule: accepted drafts, residual draws, bonus tokens) against the exact one enumerated from
    the model's logits. Power check: the same test rejects rows sampled at temperature 0.8 instead of 0.7."""
    model = small_vocab
    prompt = np.array([3, 1, 4, 1, 5, 2, 6], np.int32)
    n = 3
    exact = _exact_joint(model, prompt, n, **SETTINGS)
    ids = np.repeat(prompt[None], SAMPLES, axis=0)

    def counts(**settings):
        out, stats = qjax.generate(model, ids, max_new_tokens=n, eos_token_id=[], do_sample=True, seed=11,
                                   speculative="mtp", num_speculative_tokens=2, return_stats=True, **settings)
        c = np.zeros(exact.size, np.int64)
        np.add.at(c, np.ravel_multi_index(out[:, len(prompt):].T, exact.shape), 1)
        return c, stats

    got, stats = counts(**SETTINGS)
    assert stats.acceptance_per_position[0] > 0.05  # accepted drafts are part of what is tested
    assert _chi_square_p(got, exact) > FALSE_ALARM
    hotter, _ = counts(**{**SETTINGS, "temperature": 0.8})
    assert _chi_square_p(hotter, exact) < FALSE_ALARM


def test_sampling_seed_reproduces(mtp_model):
    ids, mask = _batch(mtp_model.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=[], do_sample=True, temperature=0.9,
              speculative="mtp", num_speculative_tokens=2)
    a = qjax.generate(mtp_model, ids, seed=7, **kw)
    np.testing.assert_array_equal(qjax.generate(mtp_model, ids, seed=7, **kw), a)
    assert not np.array_equal(qjax.generate(mtp_model, ids, seed=8, **kw), a)
    streamed = np.stack(list(qjax.stream(mtp_model, ids, seed=7, **kw)), axis=1)
    np.testing.assert_array_equal(streamed, a[:, ids.shape[1]:])
