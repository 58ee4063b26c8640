"""MTP speculative decoding: the checkpoint's own ``mtp.*`` head drafts k tokens, the main model verifies them in
one call of k + 1 tokens, and every row keeps the drafts its acceptance rule takes plus one token of the main model's
(docs/serving.md §5; vLLM's ``Qwen3_5MoeMTP`` + ``EagleProposer`` + ``RejectionSampler``).

One round, per row (all rows at once, each at its own cache length):

1. verify: the main model runs ``[last token, d_1 … d_k]`` on top of its cache (``forward(keep_steps=True)``),
   giving the target distributions ``p_0 … p_k`` (the row's temperature → top-k → top-p, as plain decoding samples).
   The row accepts ``a`` drafts and emits ``a + 1`` tokens (:func:`accept`):
   - greedy rows: ``a`` = the longest run with ``d_{i+1} = argmax p_i``; the emitted tokens are plain greedy's.
   - sampling rows: the drafts are greedy, a point mass ``q = δ(d)`` as vLLM treats MTP drafts
     (``draft_probs=None``), so the rule of Leviathan et al. (arXiv 2211.17192) accepts ``d_{i+1}`` with probability
     ``min(1, p_i(d)/q_i(d)) = p_i(d_{i+1})``; at the first rejection it emits a token drawn from
     ``normalize(max(0, p_i − q_i))`` = ``p_i`` with ``d_{i+1}`` removed; after k acceptances a bonus token from
     ``p_k``. Every emitted token is then distributed exactly as plain sampling's.
2. roll back: the verify call consumed ``a + 1`` of its tokens; :meth:`qjax.model.cache.Cache.accept` keeps exactly
   those — the GDN conv window and recurrent state after the last of them (kept per token during the call), the
   lengths, positions and valid keys; K/V of the dropped tokens are overwritten by the next call.
3. draft: the MTP head runs over the consumed positions with the main model's true hidden states (its K/V entries for
   those positions, any earlier chained drafts there overwritten), and from the output at the last one chains k
   greedy drafts (its own output hidden and its last draft as the next input), as vLLM does.

Randomness: each row carries its own PRNG key, split once per round (a draw for the first token at prefill), so a
row's tokens depend on its seed and its logits only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.model.cache import Cache, cache_length
from qjax.runtime.sampling import SamplingArrays, filter_logits, sample, seed_key, split_keys


@dataclasses.dataclass
class SpeculativeStats:
    """What speculation did in one ``generate`` call (rows still generating only)."""

    num_speculative_tokens: int
    rounds: int = 0  # verify calls of the main model
    row_rounds: int = 0  # (row, round) pairs of rows still generating
    emitted: int = 0  # tokens those rows emitted in verify rounds (accepted drafts + the main model's own)
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # row-rounds that accepted draft j, j = 1..k

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_speculative_tokens

    def record(self, consumed: int) -> None:
        """One row's verify round that consumed ``consumed`` tokens (its accepted drafts + 1)."""
        self.row_rounds += 1
        self.emitted += consumed
        for j in range(consumed - 1):
            self.accepted_at[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify call and row (1 … k + 1; 1 = no draft ever accepted)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of row-rounds whose draft j was accepted (j = 1 … k; draft j needs drafts 1 … j−1 too)."""
        return [n / self.row_rounds if self.row_rounds else 0.0 for n in self.accepted_at]

    def to_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens, "rounds": self.rounds,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.acceptance_per_position}


def _chain(model, logits, y, cache: Cache, position, k: int, rows=None, kv_len: int | None = None):
    """Greedy drafts ``[B, k]``: the first from ``logits [B, V]`` (the head's output at the row's last consumed
    position, hidden ``y [B, 1, H]``), each next one from the head run on (its previous output, its previous draft)
    at the next position. The chained K/V entries are written ahead of the cache's length and left invalid: the
    next round rewrites those slots from the main model's true hidden states before any query reads them.
    ``rows``, ``kv_len``: the cache rows the batch is (:meth:`Qwen3_5MoeForCausalLM.forward`'s ``cache_rows``)."""
    drafts = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    work = cache
    for j in range(1, k):
        step_logits, y, work = model.mtp_forward(drafts[-1][:, None], y, work, position_ids=(position + j)[:, None],
                                                 cache_rows=rows, kv_len=kv_len)
        drafts.append(jnp.argmax(step_logits[:, 0], axis=-1).astype(jnp.int32))
    kept = Cache(slots=work.slots, key_valid=cache.key_valid, positions=cache.positions, lengths=cache.lengths)
    return jnp.stack(drafts, axis=1), kept


def propose(model, tokens, hidden, cache: Cache, mask, positions, at, k: int, rows=None, kv_len: int | None = None):
    """Step 3 of a round (module docstring) for a prompt chunk or a verify call: the head over ``tokens [B, T]``
    (the token after each position of ``hidden [B, T, H]``, the main model's) at ``positions [B, T]`` (those tokens'
    positions) where ``mask [B, T]``, then k drafts chained from position ``at [B]`` (each row's last real one).
    Returns (drafts ``[B, k]``, the head's cache)."""
    _, y, cache = model.mtp_forward(tokens, hidden, cache, attention_mask=mask, position_ids=positions,
                                    cache_rows=rows, kv_len=kv_len, logits=False)
    b = jnp.arange(tokens.shape[0])
    last = y[b, at][:, None]  # [B, 1, H]: only these positions need logits
    return _chain(model, model.logits_from_hidden(last)[:, 0], last, cache, positions[b, at], k, rows, kv_len)


def accept(logits: jnp.ndarray, drafts: jnp.ndarray, keys: jax.Array, sampling: SamplingArrays
           ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The acceptance rule (module docstring, step 1) for one verify call.

    ``logits [B, k + 1, V]``: the main model's at ``[last, d_1 … d_k]``; ``drafts [B, k]``; ``keys [B]``: one key per
    row for this round. Returns (``tokens [B, k + 1]``, of which row b emits the first ``consumed[b]``; ``consumed
    [B]`` in 1 … k + 1). Greedy rows draw nothing; the sampling branch runs only when some row samples."""
    b, k1, v = logits.shape
    k = k1 - 1
    g = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
    greedy_accepted = jnp.sum(jnp.cumprod((drafts == g[:, :k]).astype(jnp.int32), axis=1), axis=1)

    def sampled(_):
        rows = jnp.arange(b)
        per_row = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), sampling)
        p = jax.nn.softmax(filter_logits(logits.reshape(b * k1, v), per_row), axis=-1).reshape(b, k1, v)
        key_u, key_r = (jnp.squeeze(x, 1) for x in jnp.split(jax.vmap(lambda key: jax.random.split(key))(keys), 2,
                                                              axis=1))
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,), p.dtype))(key_u)  # [B, k] in [0, 1)
        p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        a = jnp.sum(jnp.cumprod((u < p_draft).astype(jnp.int32), axis=1), axis=1)  # [B] accepted drafts
        p_a = p[rows, a]  # [B, V]: where the row's last token comes from
        rejected = jnp.concatenate([drafts, jnp.full((b, 1), -1, jnp.int32)], axis=1)[rows, a]  # -1: none (bonus)
        residual = jnp.where(jnp.arange(v)[None, :] == rejected[:, None], 0.0, p_a)
        # p_a(d) = 1 leaves no mass, but then d is accepted with probability 1: fall back to p_a for safety only
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_a)
        last = jax.vmap(jax.random.categorical)(key_r, jnp.log(residual)).astype(jnp.int32)
        steps = jnp.arange(k1)[None, :]
        tokens = jnp.where(steps < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
        return (jnp.where(sampling.do_sample[:, None], tokens, g),
                jnp.where(sampling.do_sample, a, greedy_accepted))

    tokens, accepted = jax.lax.cond(jnp.any(sampling.do_sample), sampled, lambda _: (g, greedy_accepted), None)
    return tokens, accepted + 1


@functools.partial(jax.jit, static_argnums=(0, 8), donate_argnums=(2, 3))
def prefill(graphdef, state, cache: Cache, mtp_cache: Cache, ids, mask, keys, sampling: SamplingArrays, k: int):
    """Prompt ``ids [B, T]`` (left-padded by ``mask``) into both caches → (first token ``[B]``, drafts ``[B, k]``,
    cache, MTP cache, keys). ``keys [B]``: the rows' PRNG keys (split once here)."""
    model = nnx.merge(graphdef, state)
    out = model.forward(ids, attention_mask=mask, cache=cache, last_only=True)
    keys, sub = split_keys(keys)
    first = sample(out.logits[:, -1], sub, sampling)
    # the head at position t reads (h_t, token t+1) and attends at token t+1's position
    positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0) + 1
    next_ids = jnp.concatenate([ids[:, 1:], first[:, None]], axis=1)
    last = jnp.full((ids.shape[0],), ids.shape[1] - 1, jnp.int32)
    drafts, mtp_cache = propose(model, next_ids, out.hidden, mtp_cache, mask, positions, last, k)
    return first, drafts, out.cache, mtp_cache, keys


def _round(model, cache: Cache, mtp_cache: Cache, last, drafts, keys, sampling: SamplingArrays):
    """:func:`verify_round`'s body (traced inside other programs too)."""
    k = drafts.shape[1]
    start = cache.positions  # [B] position of `last`
    out = model.forward(jnp.concatenate([last[:, None], drafts], axis=1), cache=cache, keep_steps=True)
    keys, sub = split_keys(keys)
    tokens, consumed = accept(out.logits, drafts, sub, sampling)
    cache = out.cache.accept(consumed)
    steps = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    next_drafts, mtp_cache = propose(model, tokens, out.hidden, mtp_cache, steps < consumed[:, None],
                                     start[:, None] + steps + 1, consumed - 1, k)
    return tokens, consumed, next_drafts, cache, mtp_cache, keys


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def verify_round(graphdef, state, cache: Cache, mtp_cache: Cache, last, drafts, keys, sampling: SamplingArrays):
    """One round (module docstring). ``last [B]``: each row's last emitted token (not yet in the cache); ``drafts
    [B, k]``; ``keys [B]``: the rows' PRNG keys. Returns (``tokens [B, k + 1]``, of which row b emits the first
    ``consumed[b]``; ``consumed [B]`` in 1 … k+1; next drafts ``[B, k]``; cache; MTP cache; keys)."""
    return _round(nnx.merge(graphdef, state), cache, mtp_cache, last, drafts, keys, sampling)


@functools.partial(jax.jit, static_argnums=(0, 9))  # the caches end inside: nothing to donate them to
def round_loop(graphdef, state, cache: Cache, mtp_cache: Cache, first, drafts, keys, sampling: SamplingArrays,
               max_new_tokens, eos: tuple[int, ...]):
    """Every round after the prefill in one program (a ``while_loop``, as plain ``generate`` decodes: no host round
    trip per round). ``first [B]``: the prefill's token; ``max_new_tokens``: an argument, not part of the program
    (like the decode loop's, :func:`qjax.runtime.generate.decode_loop`). Returns (``tokens [B, cache.max_len]`` — each
    row's emitted tokens up to and including its stop token, then -1 —, per row the count emitted, and the stats
    counters: rounds, row-rounds, tokens emitted in them, ``[k]`` accepted per draft position), the same bookkeeping
    as :func:`rounds`."""
    model = nnx.merge(graphdef, state)
    b, k = drafts.shape
    n = jnp.asarray(max_new_tokens, jnp.int32)
    width = cache.max_len  # ≥ max_new_tokens: the cache holds the prompt and every token
    stop = jnp.asarray(eos if eos else (-1,), jnp.int32)

    def is_stop(t):
        return jnp.any(t[..., None] == stop, axis=-1)

    out = jnp.full((b, width), -1, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = is_stop(first) | (n == 1)
    zero = jnp.zeros((), jnp.int32)
    init = (cache, mtp_cache, first, drafts, keys, out, count, done, zero, zero, zero, jnp.zeros((k,), jnp.int32))

    def body(carry):
        cache, mtp_cache, last, drafts, keys, out, count, done, rounds, row_rounds, emitted, accepted_at = carry
        tokens, consumed, drafts, cache, mtp_cache, keys = _round(model, cache, mtp_cache, last, drafts, keys,
                                                                  sampling)
        live = ~done
        j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        taken = j < consumed[:, None]
        stops = taken & is_stop(tokens)
        # a row emits up to its first stop token and at most what max_new_tokens leaves it
        upto = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, consumed)
        emit = jnp.where(live, jnp.minimum(upto, n - count), 0)
        at = jnp.where(j < emit[:, None], count[:, None] + j, width)  # width: out of range, dropped
        out = out.at[jnp.arange(b)[:, None], at].set(tokens, mode="drop")
        count = count + emit
        done = done | (live & (jnp.any(stops, axis=1) | (count >= n)))
        last = jnp.take_along_axis(tokens, (consumed - 1)[:, None], axis=1)[:, 0]
        live_i = live.astype(jnp.int32)
        accepted_at = accepted_at + jnp.sum(live_i[:, None] * (jnp.arange(k)[None, :] < consumed[:, None] - 1), 0)
        return (cache, mtp_cache, last, drafts, keys, out, count, done, rounds + 1, row_rounds + jnp.sum(live_i),
                emitted + jnp.sum(live_i * consumed), accepted_at)

    carry = jax.lax.while_loop(lambda c: ~jnp.all(c[7]), body, init)
    return carry[5], carry[6], carry[8:]


def row_keys(seed: int, batch: int) -> jax.Array:
    """One PRNG key per row from one seed: rows of a batch draw independently, and a seed reproduces."""
    return jax.random.split(seed_key(seed), batch)


def _prefilled(model, ids, mask, max_new_tokens: int, k: int, sampling: SamplingArrays, keys):
    """Checks, both caches sized for the run, and the prefill: (graphdef, state, first token, drafts, cache, MTP cache,
    keys) — the start of :func:`rounds` and :func:`generate_speculative`."""
    if model.mtp is None:
        raise ValueError("speculative='mtp' needs the checkpoint's MTP head, but it has no mtp.* weights")
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be ≥ 1, got {k}")
    b, t = ids.shape
    # a verify call writes k + 1 slots past a row's length: room for the last one past max_new_tokens
    size = cache_length(t, max_new_tokens + k + 1)
    keys = row_keys(0, b) if keys is None else keys
    graphdef, state = nnx.split(model)
    first, drafts, cache, mtp_cache, keys = prefill(graphdef, state, model.init_cache(b, size, spec_tokens=k + 1),
                                                    model.init_mtp_cache(b, size), jnp.asarray(ids, jnp.int32),
                                                    jnp.asarray(mask, jnp.int32), keys, sampling, k)
    return graphdef, state, first, drafts, cache, mtp_cache, keys


def rounds(model, ids, mask, *, max_new_tokens: int, k: int, eos: tuple[int, ...], stats: SpeculativeStats,
           sampling: SamplingArrays | None = None, keys: jax.Array | None = None
           ) -> Iterator[tuple[list[list[int]], list[bool]]]:
    """Generation with MTP drafts (module docstring), round by round: yields, after the prefill and after each
    verify round, (the tokens each row emitted in it, whether each row has stopped: a stop token or
    ``max_new_tokens``). ``stats`` is updated as it goes. ``ids``, ``mask``: ``[B, T]`` left-padded prompt (checked
    by the caller); ``sampling``: per-row settings (default greedy); ``keys [B]``: per-row PRNG keys (default
    :func:`row_keys` of seed 0)."""
    b = ids.shape[0]
    sampling = SamplingArrays.zeros(b) if sampling is None else sampling
    graphdef, state, first, drafts, cache, mtp_cache, keys = _prefilled(model, ids, mask, max_new_tokens, k,
                                                                        sampling, keys)
    new = [[int(x)] for x in np.asarray(first)]
    count = [1] * b
    done = [row[0] in eos or max_new_tokens == 1 for row in new]
    yield new, list(done)
    last = first
    while not all(done):
        g, consumed, drafts, cache, mtp_cache, keys = verify_round(graphdef, state, cache, mtp_cache, last, drafts,
                                                                   keys, sampling)
        g_np, n_np = np.asarray(g), np.asarray(consumed)
        stats.rounds += 1
        new = [[] for _ in range(b)]
        for r in range(b):
            if done[r]:
                continue
            n = int(n_np[r])
            stats.record(n)
            for tok in g_np[r, :n]:
                new[r].append(int(tok))
                count[r] += 1
                if int(tok) in eos or count[r] >= max_new_tokens:
                    done[r] = True
                    break
        yield new, list(done)
        last = g[jnp.arange(b), consumed - 1]


def generate_speculative(model, ids, mask, *, max_new_tokens: int, k: int, eos: tuple[int, ...], pad: int,
                         sampling: SamplingArrays | None = None, keys: jax.Array | None = None
                         ) -> tuple[np.ndarray, SpeculativeStats]:
    """The prefill, then every round in one program (:func:`round_loop`): (``[B, T + n]`` prompts and new tokens,
    rows that stopped padded with ``pad``; the stats) — greedy: the same tokens as plain greedy ``generate``;
    sampling: tokens from the same distribution; the same tokens and stats as :func:`rounds` round by round."""
    sampling = SamplingArrays.zeros(ids.shape[0]) if sampling is None else sampling
    graphdef, state, first, drafts, cache, mtp_cache, keys = _prefilled(model, ids, mask, max_new_tokens, k,
                                                                        sampling, keys)
    out, count, counters = round_loop(graphdef, state, cache, mtp_cache, first, drafts, keys, sampling,
                                      max_new_tokens, tuple(eos))
    out, count = np.asarray(out), np.asarray(count)
    rounds_, row_rounds, emitted, accepted_at = (np.asarray(c) for c in counters)
    stats = SpeculativeStats(num_speculative_tokens=k, rounds=int(rounds_), row_rounds=int(row_rounds),
                             emitted=int(emitted), accepted_at=[int(a) for a in accepted_at])
    new = np.where(out >= 0, out, pad).astype(np.int32)[:, :int(count.max())]
    return np.concatenate([np.asarray(ids, np.int32), new], axis=1), stats
