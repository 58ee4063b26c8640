"""MTP speculative decoding: the checkpoint's own ``mtp.*`` head drafts k tokens, the main model verifies them in
one call of k + 1 tokens, and every row keeps the longest prefix its own greedy choice agrees with, plus one token of
the main model's (docs/serving.md §5; vLLM's ``Qwen3_5MoeMTP`` + ``EagleProposer`` + ``RejectionSampler``).

One round, per row (all rows at once, each at its own cache length):

1. verify: the main model runs ``[last token, d_1 … d_k]`` on top of its cache (``forward(keep_steps=True)``);
   ``g_i = argmax logits_i``. The row accepts ``a`` drafts, the longest run with ``d_{i+1} = g_i``, and emits
   ``g_0 … g_a`` (the accepted drafts and the main model's own next token): always what plain greedy decoding emits.
2. roll back: the verify call consumed ``a + 1`` of its tokens; :meth:`qjax.model.cache.Cache.accept` keeps exactly
   those — the GDN conv window and recurrent state after the last of them (kept per token during the call), the
   lengths, positions and valid keys; K/V of the dropped tokens are overwritten by the next call.
3. draft: the MTP head runs over the consumed positions with the main model's true hidden states (its K/V entries for
   those positions, any earlier chained drafts there overwritten), and from the output at the last one chains k
   greedy drafts (its own output hidden and its last draft as the next input), as vLLM does.

Greedy only for now: speculation changes nothing in what is emitted, only how many main-model calls it takes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.model.cache import Cache


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


def _chain(model, logits, y, cache: Cache, position, k: int):
    """Greedy drafts ``[B, k]``: the first from ``logits [B, V]`` (the head's output at the row's last consumed
    position, hidden ``y [B, 1, H]``), each next one from the head run on (its previous output, its previous draft)
    at the next position. The chained K/V entries are written ahead of the cache's length and left invalid: the
    next round rewrites those slots from the main model's true hidden states before any query reads them."""
    drafts = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    work = cache
    for j in range(1, k):
        step_logits, y, work = model.mtp_forward(drafts[-1][:, None], y, work,
                                                 position_ids=(position + j)[:, None])
        drafts.append(jnp.argmax(step_logits[:, 0], axis=-1).astype(jnp.int32))
    kept = Cache(slots=work.slots, key_valid=cache.key_valid, positions=cache.positions, lengths=cache.lengths)
    return jnp.stack(drafts, axis=1), kept


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2, 3))
def prefill(graphdef, state, cache: Cache, mtp_cache: Cache, ids, mask, k: int):
    """Prompt ``ids [B, T]`` (left-padded by ``mask``) into both caches → (first token ``[B]``, drafts ``[B, k]``,
    cache, MTP cache)."""
    model = nnx.merge(graphdef, state)
    out = model.forward(ids, attention_mask=mask, cache=cache, last_only=True)
    first = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)
    # the head at position t reads (h_t, token t+1) and attends at token t+1's position
    positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0) + 1
    next_ids = jnp.concatenate([ids[:, 1:], first[:, None]], axis=1)
    logits, y, mtp_cache = model.mtp_forward(next_ids, out.hidden, mtp_cache, attention_mask=mask,
                                             position_ids=positions)
    drafts, mtp_cache = _chain(model, logits[:, -1], y[:, -1:], mtp_cache, positions[:, -1], k)
    return first, drafts, out.cache, mtp_cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def verify_round(graphdef, state, cache: Cache, mtp_cache: Cache, last, drafts):
    """One round (module docstring). ``last [B]``: each row's last emitted token (not yet in the cache); ``drafts
    [B, k]``. Returns (``g [B, k + 1]``, of which row b emits the first ``consumed[b]``; ``consumed [B]`` in 1 … k+1;
    next drafts ``[B, k]``; cache; MTP cache)."""
    model = nnx.merge(graphdef, state)
    k = drafts.shape[1]
    start = cache.positions  # [B] position of `last`
    out = model.forward(jnp.concatenate([last[:, None], drafts], axis=1), cache=cache, keep_steps=True)
    g = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
    accepted = jnp.sum(jnp.cumprod((drafts == g[:, :k]).astype(jnp.int32), axis=1), axis=1)  # [B] in 0 … k
    consumed = accepted + 1
    cache = out.cache.accept(consumed)
    steps = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    logits, y, mtp_cache = model.mtp_forward(g, out.hidden, mtp_cache, attention_mask=steps < consumed[:, None],
                                             position_ids=start[:, None] + steps + 1)
    rows = jnp.arange(g.shape[0])
    next_drafts, mtp_cache = _chain(model, logits[rows, accepted], y[rows, accepted][:, None], mtp_cache,
                                    start + consumed, k)
    return g, consumed, next_drafts, cache, mtp_cache


def rounds(model, ids, mask, *, max_new_tokens: int, k: int, eos: tuple[int, ...], stats: SpeculativeStats
           ) -> Iterator[tuple[list[list[int]], list[bool]]]:
    """Greedy generation with MTP drafts (module docstring), round by round: yields, after the prefill and after each
    verify round, (the tokens each row emitted in it, whether each row has stopped: a stop token or
    ``max_new_tokens``). ``stats`` is updated as it goes. ``ids``, ``mask``: ``[B, T]`` left-padded prompt (checked
    by the caller)."""
    if model.mtp is None:
        raise ValueError("speculative='mtp' needs the checkpoint's MTP head, but it has no mtp.* weights")
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be ≥ 1, got {k}")
    b, t = ids.shape
    # a verify call writes k + 1 slots past a row's length: room for the last one past max_new_tokens
    size = t + max_new_tokens + k + 1
    cache = model.init_cache(b, size, spec_tokens=k + 1)
    mtp_cache = model.init_mtp_cache(b, size)
    graphdef, state = nnx.split(model)
    first, drafts, cache, mtp_cache = prefill(graphdef, state, cache, mtp_cache, jnp.asarray(ids, jnp.int32),
                                              jnp.asarray(mask, jnp.int32), k)
    new = [[int(x)] for x in np.asarray(first)]
    count = [1] * b
    done = [row[0] in eos or max_new_tokens == 1 for row in new]
    yield new, list(done)
    last = first
    while not all(done):
        g, consumed, drafts, cache, mtp_cache = verify_round(graphdef, state, cache, mtp_cache, last, drafts)
        g_np, n_np = np.asarray(g), np.asarray(consumed)
        stats.rounds += 1
        new = [[] for _ in range(b)]
        for r in range(b):
            if done[r]:
                continue
            n = int(n_np[r])
            stats.row_rounds += 1
            stats.emitted += n
            for j in range(n - 1):
                stats.accepted_at[j] += 1
            for tok in g_np[r, :n]:
                new[r].append(int(tok))
                count[r] += 1
                if int(tok) in eos or count[r] >= max_new_tokens:
                    done[r] = True
                    break
        yield new, list(done)
        last = g[jnp.arange(b), consumed - 1]


def generate_speculative(model, ids, mask, *, max_new_tokens: int, k: int, eos: tuple[int, ...], pad: int
                         ) -> tuple[np.ndarray, SpeculativeStats]:
    """All of :func:`rounds` at once: (``[B, T + n]`` prompts and new tokens, rows that stopped padded with ``pad``;
    the stats) — the same tokens as plain greedy ``generate``."""
    stats = SpeculativeStats(num_speculative_tokens=k)
    out = [[] for _ in range(ids.shape[0])]
    for new, _ in rounds(model, ids, mask, max_new_tokens=max_new_tokens, k=k, eos=eos, stats=stats):
        for row, toks in zip(out, new):
            row.extend(toks)
    b = ids.shape[0]
    n_new = max(len(row) for row in out)
    new = np.full((b, n_new), pad, np.int32)
    for r, row in enumerate(out):
        new[r, :len(row)] = row
    return np.concatenate([np.asarray(ids, np.int32), new], axis=1), stats
