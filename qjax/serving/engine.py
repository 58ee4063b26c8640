"""Continuous batching: a pool of sequence slots on the device, requests that join and leave at any step.

    engine = Engine(model, EngineConfig(max_num_seqs=16, max_model_len=4096), eos_token_ids=(eos,))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))      # blocking, from Python
    engine.start(); engine.add_request("r1", ids, params, callback); …; engine.shutdown()   # a server's loop

The pool is one :class:`qjax.model.cache.Cache` of ``max_num_seqs`` rows × ``max_model_len`` slots (each row: its
full-attention K/V, its GDN conv window and fp32 recurrent state, its own length), plus per-row device arrays: the
last token, the PRNG key and the sampling settings. Every engine step runs on the calling thread (or the engine's
own thread) and issues at most two device programs, both compiled for a few bucketed shapes only:

- **prefill**: the next chunks of the prompts being prefilled (≤ ``max_num_batched_tokens`` tokens in all, one chunk
  per sequence, right-padded to a bucket): a new sequence first empties its row; a sequence whose prompt ends in
  this chunk draws its first token from the last real position's logits. Prompt log-probabilities are computed
  here when asked for.
- **decode**: one token (up to ``decode_steps`` tokens while nothing waits) for every running sequence, reading and
  writing in place the first rows of the pool (a bucket ≥ the running count; the engine keeps running sequences in
  the lowest slots, swapping rows when one finishes out of order) and only the first ``kv_len`` cache slots (a
  bucket ≥ the longest row); rows in the bucket that are not decoding are masked out.

With MTP speculation (``EngineConfig.num_speculative_tokens`` = k > 0, vLLM's ``--speculative-config``), the pool also
holds the MTP head's K/V cache and each row's k drafts; prefill runs the head over every prompt chunk (its cache
then covers the prompt) and drafts after the last one; decode is one verify round per call
(:mod:`qjax.runtime.speculative`): each running row emits 1 … k + 1 tokens, by its own acceptance, and the next
drafts. Greedy rows emit exactly what they emit without speculation; sampled rows draw from the same distribution.

**Images.** A request may carry an :class:`ImageInput` (:func:`encode_images`: the prompt's image placeholders
expanded to the merged-patch counts, the prompt's M-RoPE position rows, the vision tower's features of its image
tokens), made off the engine's thread. A prefill call whose chunks hold an image request's tokens runs a second
compiled variant of the prefill program that also takes ``position_ids [3, P, T]`` (the image request's rows
sliced from its prompt's positions; text rows ``cursor + arange``) and ``image_embeds [P·T, H]`` (the features of
the image tokens in the call's chunks in row-major order, each chunk's starting at the count its earlier chunks
consumed, zero rows after them): a chunk may split an image. Calls without an image request run the text program
unchanged. After the prompt the row's next position is its largest prompt position + 1, so decoding needs nothing
more. Images with MTP speculation are refused.

A request alone and a request in any batch run the same arithmetic on their own row: float32 greedy tokens equal
``qjax.generate``'s for that prompt, and a seeded request draws with ``jax.random.key(seed)`` split once per token,
as ``qjax.generate`` does, so sampled tokens equal too (tests/test_serving_engine.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import queue
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from qjax.model.cache import Cache, gather_rows, scatter_rows
from qjax.multimodal.positions import PromptError
from qjax.multimodal.prompt import check_vision, prepare_images
from qjax.runtime.sampling import SamplingArrays, sample, split_keys, token_logprobs
from qjax.runtime.speculative import SpeculativeStats, accept, propose

logger = logging.getLogger("qjax.serving")

# Greedy below this temperature, as vLLM does (OpenAI's temperature 0 means greedy).
GREEDY_TEMPERATURE = 1e-5
# Smallest bucket of cache slots attention reads at decode; buckets double up to max_model_len.
MIN_KV_BUCKET = 256
# Smallest prefill chunk bucket (tokens per sequence per call; the GDN chunk size); buckets grow ×4 up to
# max_num_batched_tokens.
MIN_CHUNK_BUCKET = 64


class EngineError(ValueError):
    """A request or a configuration the engine cannot serve; the message names the field and the numbers."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the slot pool is sized and scheduled (vLLM's flag names where vLLM has one)."""

    max_num_seqs: int = 8  # sequence slots: requests that run at once
    max_model_len: int = 2048  # prompt + output tokens per sequence (cache slots per row)
    max_num_batched_tokens: int = 2048  # prompt tokens prefilled per step, over all sequences
    decode_steps: int = 8  # tokens decoded per device call while no request waits to be prefilled
    max_logprobs: int = 20  # the most top log-probabilities a request may ask for
    num_speculative_tokens: int = 0  # MTP drafts per verify call (vLLM's --speculative-config); 0: no speculation

    @property
    def slots_per_row(self) -> int:
        """Cache slots per row: ``max_model_len``, plus room for what a verify round writes past a row's length
        (its k + 1 tokens, then the head's k − 1 chained drafts past the accepted ones)."""
        k = self.num_speculative_tokens
        return self.max_model_len + (2 * k if k else 0)

    def check(self, max_position_embeddings: int, data_parallel: int = 1) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "decode_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise EngineError(f"{name} must be a positive integer, got {v!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise EngineError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
        if self.max_model_len > max_position_embeddings:
            raise EngineError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                              f"{max_position_embeddings}")
        if self.max_num_seqs % data_parallel:
            raise EngineError(f"max_num_seqs {self.max_num_seqs} is not a multiple of the mesh's data axis "
                              f"({data_parallel}): the slot pool is split over it")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings (OpenAI / vLLM semantics)."""

    max_tokens: int = 16
    temperature: float = 1.0  # < 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # None: a fresh random seed
    stop_token_ids: tuple[int, ...] = ()  # end the output (the token is part of it), besides the model's eos
    ignore_eos: bool = False
    logprobs: int | None = None  # top log-probabilities per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check(self, max_logprobs: int) -> None:
        def bad(field, msg):
            raise EngineError(f"{field}: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad("max_tokens", f"must be a non-negative integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be ≥ 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and not 0 <= v <= max_logprobs:
                bad(field, f"must be between 0 and {max_logprobs}, got {v}")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """A request's images, ready for prefill (:func:`encode_images`): ``position_ids`` int32 ``[3, T]``, the M-RoPE
    rows of its expanded prompt of ``T`` tokens; ``embeds`` ``[N, H]`` (host array, the model's dtype), the vision
    tower's features of the prompt's ``N`` image tokens in order."""

    position_ids: np.ndarray
    embeds: np.ndarray


def encode_images(model, prompt_ids: Sequence[int], images: Sequence) -> tuple[list[int], ImageInput]:
    """``prompt_ids`` with one image placeholder per image (as the chat template writes ``<|image_pad|>``) and the
    images (anything :func:`qjax.multimodal.images.load_image` takes: PIL images, bytes, paths, uint8 arrays) → the
    expanded prompt and its :class:`ImageInput`, exactly as ``qjax.generate(images=…)`` prepares them
    (:func:`qjax.multimodal.prompt.prepare_images`; the vision tower runs here, on the calling thread). Raises
    PromptError or ImageError (one line) for placeholders and images that disagree, an unreadable image, or a model
    without its vision tower."""
    p = prepare_images(model, np.asarray([list(prompt_ids)], np.int64), None, list(images))
    return ([int(t) for t in p.input_ids[0]],
            ImageInput(position_ids=np.ascontiguousarray(p.position_ids[:, 0], np.int32),
                       embeds=np.asarray(p.image_embeds)))


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (raw logits) and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log p), most likely first


@dataclasses.dataclass
class RequestOutput:
    """What a request produced since its last output (the engine calls the request's callback with it)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first output; entry 0 is None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token that ended it (None for the model's eos)


# ---------------------------------------------------------------------------------------------------------------------
# device state and programs
# ---------------------------------------------------------------------------------------------------------------------
@struct.dataclass
class Pool:
    """Everything the device keeps per slot."""

    cache: Cache
    tokens: jnp.ndarray  # [B] int32: the row's last token (the next decode input)
    keys: jnp.ndarray  # [B, 2] uint32: the row's PRNG key data (split once per drawn token, or per verify round)
    sampling: SamplingArrays  # [B]
    mtp_cache: Cache | None = None  # with speculation: the MTP head's K/V, slots aligned with ``cache``'s
    drafts: jnp.ndarray | None = None  # with speculation: [B, k] int32, the row's drafts for its next verify round

    def prefix(self, n: int) -> "Pool":
        """The first ``n`` rows (a copy the decode steps run on as a whole batch)."""
        return Pool(cache=self.cache.prefix(n), tokens=self.tokens[:n], keys=self.keys[:n],
                    sampling=_row_fields(self.sampling, n),
                    mtp_cache=None if self.mtp_cache is None else self.mtp_cache.prefix(n),
                    drafts=None if self.drafts is None else self.drafts[:n])

    def with_prefix(self, part: "Pool") -> "Pool":
        """This pool with its first rows replaced by ``part`` (sampling settings do not change in a decode)."""
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, 0)  # noqa: E731
        return Pool(cache=self.cache.with_prefix(part.cache), tokens=put(self.tokens, part.tokens),
                    keys=put(self.keys, part.keys), sampling=self.sampling,
                    mtp_cache=None if self.mtp_cache is None else self.mtp_cache.with_prefix(part.mtp_cache),
                    drafts=None if self.drafts is None else put(self.drafts, part.drafts))


def _row_fields(x: SamplingArrays, rows) -> SamplingArrays:
    return jax.tree.map(lambda a: gather_rows(a, rows), x)


class _Programs:
    """The engine's jitted programs, closed over the model's graph (only arrays are passed per call)."""

    def __init__(self, model, compiled: Callable[[tuple], None], k: int = 0):
        """``k``: MTP drafts per verify round (0: plain decoding)."""
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self.leaves = leaves
        self.k = k
        self._note = compiled

        def merged(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, pool: Pool, rows, ids, n, reset, final, key_data, sampling: SamplingArrays, targets,
                    position_ids=None, image_embeds=None, *, kv_len: int, top_k: int | None,
                    prompt_top_k: int | None):
            model = merged(leaves)
            new_rows = jnp.where(reset, rows, pool.cache.batch_size)
            cache = pool.cache.reset_rows(new_rows)
            mask = jnp.arange(ids.shape[1])[None, :] < n[:, None]
            start = gather_rows(cache.positions, rows)  # [P] the chunk's first position
            # an image call (the second variant): M-RoPE rows and the features of the call's image tokens
            out = model.forward(ids, attention_mask=mask, cache=cache, cache_rows=rows, kv_len=kv_len, last_only=True,
                                position_ids=position_ids, image_embeds=image_embeds)
            last = jnp.take_along_axis(out.hidden, jnp.maximum(n - 1, 0)[:, None, None], axis=1)  # [P, 1, H]
            logits = model.logits_from_hidden(last)[:, 0]
            keys = jnp.where(reset[:, None], key_data, gather_rows(pool.keys, rows))
            keep, sub = split_keys(jax.random.wrap_key_data(keys))
            tok = sample(logits, sub, sampling)
            lp = token_logprobs(logits, tok, top_k) if top_k is not None else _no_logprobs(tok)
            keep = jnp.where(final[:, None], jax.random.key_data(keep), keys)
            old = gather_rows(pool.tokens, rows)
            mtp_cache, drafts = pool.mtp_cache, pool.drafts
            if k:
                # the head over the chunk: position t reads the token after it — the next prompt token, or the first
                # drawn one at a prompt's last position — so its cache covers the whole prompt; drafts after that
                last = jnp.maximum(n - 1, 0)
                at_last = jnp.arange(ids.shape[1])[None, :] == last[:, None]
                nxt = jnp.where(at_last & final[:, None], tok[:, None], targets)
                positions = start[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] + 1
                new, mtp_cache = propose(model, nxt, out.hidden, mtp_cache.reset_rows(new_rows), mask, positions,
                                         last, k, rows=rows, kv_len=kv_len)
                drafts = scatter_rows(drafts, rows, jnp.where(final[:, None], new, gather_rows(drafts, rows)))
            pool = Pool(cache=out.cache, tokens=scatter_rows(pool.tokens, rows, jnp.where(final, tok, old)),
                        keys=scatter_rows(pool.keys, rows, keep),
                        sampling=jax.tree.map(lambda a, v: scatter_rows(a, rows, v), pool.sampling, sampling),
                        mtp_cache=mtp_cache, drafts=drafts)
            prompt = None
            if prompt_top_k is not None:
                prompt = _prompt_logprobs(model, out.hidden, targets, prompt_top_k)
            return pool, tok, lp, prompt

        def decode(leaves, pool: Pool, active, steps, *, rows: int | None, kv_len: int, max_steps: int,
                   top_k: int | None):
            model = merged(leaves)
            whole = pool
            if rows is not None:
                # the running sequences are the first `rows` slots: they are copied out once per call and back once
                # at its end, and the steps run on that small pool as a whole batch. Reading and writing a prefix of
                # the big pool inside every step made XLA copy each GDN state stack per layer per step (one
                # sequence in a 32-slot pool decoded at 0.56× the speed of a 1-slot pool)
                pool = pool.prefix(rows)
            sampling = pool.sampling

            def body(i, carry):
                pool, out = carry
                tok, keys = pool.tokens, pool.keys
                fwd = model.forward(tok[:, None], attention_mask=active[:, None], cache=pool.cache, kv_len=kv_len)
                logits = fwd.logits[:, 0]
                keep, sub = split_keys(jax.random.wrap_key_data(keys))
                new = sample(logits, sub, sampling)
                lp = token_logprobs(logits, new, top_k) if top_k is not None else _no_logprobs(new)
                pool = pool.replace(cache=fwd.cache, tokens=jnp.where(active, new, tok),
                                    keys=jnp.where(active[:, None], jax.random.key_data(keep), keys))
                # log-probabilities are kept in float32 whatever the model computes in (a float64 model's are
                # rounded here once: they leave as JSON numbers of float32 precision either way)
                out = jax.tree.map(lambda buf, v: buf.at[i].set(v.astype(buf.dtype)), out, (new, *lp))
                return pool, out

            b, k = active.shape[0], top_k or 0
            out = (jnp.zeros((max_steps, b), jnp.int32), jnp.zeros((max_steps, b), jnp.float32),
                   jnp.zeros((max_steps, b, k), jnp.int32), jnp.zeros((max_steps, b, k), jnp.float32))
            pool, out = jax.lax.fori_loop(0, steps, body, (pool, out))
            if rows is not None:
                pool = whole.with_prefix(pool)
            return pool, out

        def verify(leaves, pool: Pool, active, *, rows: int | None, kv_len: int, top_k: int | None):
            """One verify round for the running rows (``active [b]``, the first ``b`` or all rows): (pool, tokens
            ``[b, k + 1]`` of which row i emitted the first ``consumed[i]``, consumed ``[b]``, their logprobs)."""
            model = merged(leaves)
            whole = pool
            if rows is not None:
                pool = pool.prefix(rows)  # as in decode
            last, drafts = pool.tokens, pool.drafts
            start = pool.cache.positions  # [b] each row's position of `last`
            ids = jnp.concatenate([last[:, None], drafts], axis=1)
            mask = jnp.broadcast_to(active[:, None], ids.shape)
            out = model.forward(ids, attention_mask=mask, cache=pool.cache, kv_len=kv_len, keep_steps=True)
            keep, sub = split_keys(jax.random.wrap_key_data(pool.keys))
            tokens, consumed = accept(out.logits, drafts, sub, pool.sampling)
            cache = out.cache.accept(consumed, active)
            lp = token_logprobs(out.logits, tokens, top_k) if top_k is not None else _no_logprobs(tokens)
            steps = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
            new, mtp_cache = propose(model, tokens, out.hidden, pool.mtp_cache, mask & (steps < consumed[:, None]),
                                     start[:, None] + steps + 1, consumed - 1, k, kv_len=kv_len)
            emitted = jnp.take_along_axis(tokens, (consumed - 1)[:, None], axis=1)[:, 0]
            pool = Pool(cache=cache, tokens=jnp.where(active, emitted, last),
                        keys=jnp.where(active[:, None], jax.random.key_data(keep), pool.keys), sampling=pool.sampling,
                        mtp_cache=mtp_cache, drafts=jnp.where(active[:, None], new, drafts))
            if rows is not None:
                pool = whole.with_prefix(pool)
            lp = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in lp)
            return pool, tokens, consumed, lp

        def swap(pool: Pool, a, b):
            """Exchange rows a and b of every per-row array of the pool (its cache rows included)."""
            def one(x, axis):
                ra, rb = (jax.lax.dynamic_index_in_dim(x, r, axis) for r in (a, b))
                x = jax.lax.dynamic_update_index_in_dim(x, rb, a, axis)
                return jax.lax.dynamic_update_index_in_dim(x, ra, b, axis)

            def cache_rows(cache):
                if cache is None:
                    return None
                slots = jax.tree.map(lambda x: one(x, 1), cache.slots)  # [G, B, …]
                key_valid, positions, lengths = (one(x, 0) for x in (cache.key_valid, cache.positions, cache.lengths))
                return Cache(slots=slots, key_valid=key_valid, positions=positions, lengths=lengths)

            tokens, keys, sampling, drafts = jax.tree.map(lambda x: one(x, 0), (pool.tokens, pool.keys, pool.sampling,
                                                                                 pool.drafts))
            return Pool(cache=cache_rows(pool.cache), tokens=tokens, keys=keys, sampling=sampling,
                        mtp_cache=cache_rows(pool.mtp_cache), drafts=drafts)

        self._prefill = jax.jit(prefill, donate_argnums=(1,), static_argnames=("kv_len", "top_k", "prompt_top_k"))
        self._decode = jax.jit(decode, donate_argnums=(1,), static_argnames=("rows", "kv_len", "max_steps", "top_k"))
        self._verify = jax.jit(verify, donate_argnums=(1,), static_argnames=("rows", "kv_len", "top_k"))
        self._swap = jax.jit(swap, donate_argnums=(0,))

    def prefill(self, pool, *args, kv_len, top_k, prompt_top_k, position_ids=None, image_embeds=None):
        kind = "prefill" if image_embeds is None else "prefill_images"
        self._note((kind, args[1].shape, kv_len, top_k, prompt_top_k))
        return self._prefill(self.leaves, pool, *args, position_ids, image_embeds, kv_len=kv_len, top_k=top_k,
                             prompt_top_k=prompt_top_k)

    def decode(self, pool, active, steps, *, rows, kv_len, max_steps, top_k):
        self._note(("decode", rows, kv_len, max_steps, top_k))
        return self._decode(self.leaves, pool, active, steps, rows=rows, kv_len=kv_len, max_steps=max_steps,
                            top_k=top_k)

    def verify(self, pool, active, *, rows, kv_len, top_k):
        self._note(("verify", rows, kv_len, top_k))
        return self._verify(self.leaves, pool, active, rows=rows, kv_len=kv_len, top_k=top_k)

    def swap(self, pool, a: int, b: int):
        self._note(("swap",))
        return self._swap(pool, jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _no_logprobs(tokens):
    empty = jnp.zeros((*tokens.shape, 0), jnp.float32)  # float32 named: a bare zeros is float64 under x64
    return jnp.zeros(tokens.shape, jnp.float32), empty.astype(jnp.int32), empty


PROMPT_CHUNK = 64  # prompt positions whose [P, chunk, vocab] logits exist at once


def _prompt_logprobs(model, hidden, targets, k: int):
    """log p(targets[t]) given the prefix through t, and the top-k, for every position: ``hidden [P, T, H]``
    (post-norm), ``targets [P, T]`` → ``[P, T]``, ``[P, T, k]`` ids, ``[P, T, k]`` log p. Logits are made
    :data:`PROMPT_CHUNK` positions at a time."""
    p, t, h = hidden.shape
    pad = (-t) % PROMPT_CHUNK
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    ts = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (t + pad) // PROMPT_CHUNK
    hs = hs.reshape(p, n, PROMPT_CHUNK, h).swapaxes(0, 1)
    ts = ts.reshape(p, n, PROMPT_CHUNK).swapaxes(0, 1)

    def one(args):
        hc, tc = args
        return token_logprobs(model.logits_from_hidden(hc), tc, k)

    lp, ids, top = jax.lax.map(one, (hs, ts))
    undo = lambda a: a.swapaxes(0, 1).reshape(p, n * PROMPT_CHUNK, *a.shape[3:])[:, :t]  # noqa: E731
    return undo(lp), undo(ids), undo(top)


# ---------------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------------
WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"


@dataclasses.dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    callback: Callable[[RequestOutput], None]
    stop_ids: frozenset
    key_data: np.ndarray  # [2] uint32
    arrival: float
    state: str = WAITING
    slot: int = -1
    cursor: int = 0  # prompt tokens prefilled
    output: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    images: ImageInput | None = None
    image_before: np.ndarray | None = None  # [T + 1]: image tokens in prompt[:i] (a chunk's first feature row)


def bucket(n: int, lo: int, hi: int, factor: int = 2) -> int:
    """The smallest of ``lo, lo·factor, …`` (capped at ``hi``, which is always a bucket) that holds ``n``."""
    b = lo
    while b < n and b < hi:
        b *= factor
    return min(b, hi) if n <= hi else n


class EngineMetricsSink:
    """What the engine reports as it runs (the server counts it for ``/metrics``); the default ignores it."""

    def queue(self, running: int, waiting: int) -> None: ...
    def prompt_tokens(self, n: int) -> None: ...
    def generated_tokens(self, n: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, n: int) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...
    def speculated(self, drafts: int, accepted: int) -> None:
        """One row's verify round: ``drafts`` drafts checked, the first ``accepted`` of them accepted."""


class Engine:
    """The slot pool and its scheduler (see the module docstring). Thread-safe entry points: :meth:`add_request`,
    :meth:`abort`, :meth:`start`, :meth:`shutdown`; :meth:`step` runs on one thread at a time."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), *, eos_token_ids: Sequence[int] = (),
                 metrics: EngineMetricsSink | None = None, seed: int | None = None):
        """``seed``: seeds the random seeds of requests that give none (None: fresh randomness)."""
        plan = model.mesh_plan
        self._data = 1 if plan is None else plan.size("data")
        config.check(model.config.max_position_embeddings, self._data)
        self.model = model
        self.config = config
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.metrics = metrics or EngineMetricsSink()
        self.compiled: set[tuple] = set()  # the program signatures dispatched so far (each compiles once)
        self.k = config.num_speculative_tokens
        if self.k and getattr(model, "mtp", None) is None:
            raise EngineError("speculative decoding (method mtp) needs the checkpoint's MTP head, but this model has "
                              "no mtp.* weights")
        if self.k and model.mesh_plan is not None:
            raise EngineError("speculative decoding runs on one device; serve without a mesh or without it")
        self._programs = _Programs(model, self.compiled.add, self.k)
        # what speculation did since the engine started (every row's verify rounds); None without it
        self.speculation = SpeculativeStats(num_speculative_tokens=self.k) if self.k else None
        b = config.max_num_seqs
        self.pool = self._new_pool()
        self._slots: list[_Seq | None] = [None] * b
        self._seqs: dict[str, _Seq] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards step() against a concurrent caller
        self.steps = 0
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        vision = getattr(model, "vision_config", None)
        self._image_token = None if vision is None else int(vision.image_token_id)
        self._placeholder_row: np.ndarray | None = None  # the image token's own embedding (see _image_arrays)

    # -- memory ---------------------------------------------------------------------------------------------------
    def _new_pool(self) -> Pool:
        b, s, k = self.config.max_num_seqs, self.config.slots_per_row, self.k
        if k:
            return Pool(cache=self.model.init_cache(b, s, spec_tokens=k + 1), tokens=jnp.zeros((b,), jnp.int32),
                        keys=jnp.zeros((b, 2), jnp.uint32), sampling=SamplingArrays.zeros(b),
                        mtp_cache=self.model.init_mtp_cache(b, s), drafts=jnp.zeros((b, k), jnp.int32))
        cache = self.model.init_cache(b, s)
        rep = (lambda x: x) if self.model.mesh_plan is None else self.model.mesh_plan.batch
        return Pool(cache=cache, tokens=rep(jnp.zeros((b,), jnp.int32)), keys=rep(jnp.zeros((b, 2), jnp.uint32)),
                    sampling=jax.tree.map(rep, SamplingArrays.zeros(b)))

    @staticmethod
    def cache_bytes(model, max_num_seqs: int, max_model_len: int, num_speculative_tokens: int = 0) -> dict[str, int]:
        """Bytes of the slot pool, from the cache's own layout: ``kv`` (full-attention K/V, and the MTP head's with
        speculation) and ``state`` (GDN conv windows + recurrent states, and their per-token copies of a verify
        round with speculation) per sequence, and ``total`` for the pool."""
        k = num_speculative_tokens
        slots = EngineConfig(max_model_len=max_model_len, num_speculative_tokens=k).slots_per_row
        one = jax.eval_shape(lambda: model.init_cache(1, slots, spec_tokens=k + 1 if k else 0))
        kv = state = 0
        for slot in one.slots:
            n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slot))
            if hasattr(slot, "k"):
                kv += n
            else:
                state += n
        if k:
            kv += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
                lambda: model.init_mtp_cache(1, slots).slots)))
        return {"kv": kv, "state": state, "total": (kv + state) * max_num_seqs}

    def warmup(self) -> int:
        """Compile, before the first request, the programs steady serving uses: decode at every row bucket and
        prefill at every (sequences, chunk) bucket, for the shortest ``kv_len`` bucket (longer contexts compile
        their buckets on first use), and the row swap. The calls touch no row (every row is padding). Returns the
        number of programs compiled so far."""
        b = self.config.max_num_seqs
        kv = self._kv_bucket(1)
        sizes = sorted({min(self._round_rows(bucket(n, 1, b)), b) for n in range(1, b + 1)})
        for size in sizes:
            if self.k:
                self.pool, *_ = self._programs.verify(self.pool, jnp.zeros((size,), bool),
                                                      rows=None if size >= b else size, kv_len=kv, top_k=None)
                continue
            self.pool, _ = self._programs.decode(self.pool, jnp.zeros((size,), bool), jnp.asarray(1, jnp.int32),
                                                 rows=None if size >= b else size, kv_len=kv,
                                                 max_steps=self.config.decode_steps, top_k=None)
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        for t in self._chunk_buckets():
            p = 1
            while p <= self._prefill_rows(t):
                rows = self._round_rows(p)
                self.pool, *_ = self._programs.prefill(
                    self.pool, jnp.full((rows,), b, jnp.int32), z((rows, t)), z((rows,)), jnp.zeros((rows,), bool),
                    jnp.zeros((rows,), bool), jnp.zeros((rows, 2), jnp.uint32), SamplingArrays.zeros(rows),
                    z((rows, t)), kv_len=self._kv_bucket(t), top_k=None, prompt_top_k=None)
                p *= 2
        self.pool = self._programs.swap(self.pool, 0, 0)
        jax.block_until_ready(self.pool)
        return len(self.compiled)

    # -- requests (any thread) ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    callback: Callable[[RequestOutput], None], images: ImageInput | None = None) -> None:
        """Queue a request; ``callback`` receives its outputs on the engine's thread. ``images``: the
        :class:`ImageInput` of an image prompt (``prompt_ids`` then is the expanded prompt :func:`encode_images`
        returned). Raises :class:`EngineError` for a request that cannot be served (the message names the field and
        the numbers)."""
        prompt = [int(t) for t in prompt_ids]
        self.validate(prompt, params, images)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        key_data = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
        seq = _Seq(request_id=request_id, prompt=prompt, params=params, callback=callback,
                   stop_ids=frozenset(int(t) for t in stop), key_data=key_data, arrival=time.monotonic())
        if images is not None:
            seq.images = images
            seq.image_before = np.concatenate([[0], np.cumsum(np.asarray(prompt) == self._image_token)])
        self._inbox.put(("add", seq))
        self._wake.set()

    def validate(self, prompt: Sequence[int], params: SamplingParams, images: ImageInput | None = None) -> None:
        params.check(self.config.max_logprobs)
        if not prompt:
            raise EngineError("prompt: empty (at least one token is needed)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                              f"{len(prompt) + params.max_tokens} exceeds max_model_len {self.config.max_model_len}")
        if images is not None:
            self._validate_images(prompt, images)

    def _validate_images(self, prompt: Sequence[int], images: ImageInput) -> None:
        if self.k:
            # the MTP head would need the prompt's M-RoPE rows in its own cache (qjax.generate refuses it too)
            raise EngineError("images: image input with MTP speculative decoding is not supported (serve without "
                              "--speculative-config to take images)")
        try:
            check_vision(self.model)
        except PromptError as e:
            raise EngineError(f"images: {e}") from None
        n = sum(1 for t in prompt if t == self._image_token)
        pos, emb = np.asarray(images.position_ids), np.asarray(images.embeds)
        if pos.shape != (3, len(prompt)) or not np.issubdtype(pos.dtype, np.integer):
            raise EngineError(f"images: position_ids must be integers [3, {len(prompt)}] (the prompt's M-RoPE rows), "
                              f"got {pos.dtype} {list(pos.shape)}")
        hidden = self.model.config.hidden_size
        if emb.shape != (n, hidden):
            raise EngineError(f"images: embeds must be [{n}, {hidden}] (one feature row per image token of the "
                              f"prompt), got {list(emb.shape)}")
        if n == 0:
            raise EngineError("images: the prompt has no image tokens (encode_images expands its placeholders)")

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone): its slot is free at the next step; its callback gets ``abort``."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_pending(self) -> int:
        """Requests not yet running: waiting for a slot, or added and not yet taken in by a step (any thread)."""
        return len(self._waiting) + self._inbox.qsize()

    def has_work(self) -> bool:
        return bool(self._seqs) or not self._inbox.empty()

    # -- the loop -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run :meth:`step` on a background thread until :meth:`shutdown`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="qjax-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug: fail every request loudly rather than hang their clients
                logger.exception("engine step failed; aborting all requests")
                for seq in list(self._seqs.values()):
                    self._emit(seq, [], [], "abort")
                self.pool = self._new_pool()

    def shutdown(self, *, abort: bool = True, timeout: float | None = None) -> None:
        """Stop the loop thread; ``abort``: end every unfinished request with ``abort`` first (else let them run
        to completion, waiting at most ``timeout`` seconds)."""
        if not abort:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.has_work() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        for seq in list(self._seqs.values()):
            self.abort(seq.request_id)
        if self._thread is not None:
            end = time.monotonic() + 30
            while self.has_work() and time.monotonic() < end:
                time.sleep(0.01)
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None

    def step(self) -> None:
        """One scheduling step: take new requests and aborts, admit waiting requests to free slots, prefill one
        chunk per prefilling sequence (within the token budget), decode every running sequence."""
        with self._lock:
            self._drain()
            self._admit()
            self._prefill()
            self._decode(max_steps=1 if (self._waiting or self._prefilling()) else self.config.decode_steps)
            self.metrics.queue(self.num_running, self.num_waiting)
            self.steps += 1

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 images: Sequence[ImageInput | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion on this thread (the engine must not be :meth:`start` ed) and return one
        merged :class:`RequestOutput` per prompt. ``images``: per prompt, its :class:`ImageInput` or None."""
        if self._thread is not None:
            raise EngineError("generate() runs the engine on the calling thread; this engine has a loop thread")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results: dict[str, RequestOutput] = {}

        def collect(out: RequestOutput) -> None:
            acc = results.setdefault(out.request_id, RequestOutput(out.request_id, [], [] if out.new_logprobs
                                                                   is not None else None))
            acc.new_token_ids += out.new_token_ids
            if out.new_logprobs is not None:
                acc.new_logprobs = (acc.new_logprobs or []) + out.new_logprobs
            if out.prompt_logprobs is not None:
                acc.prompt_logprobs = out.prompt_logprobs
            acc.finished, acc.finish_reason, acc.stop_reason = out.finished, out.finish_reason, out.stop_reason

        ids = [f"generate-{secrets.token_hex(6)}-{i}" for i in range(len(prompts))]
        images = [None] * len(prompts) if images is None else list(images)
        if len(images) != len(prompts):
            raise EngineError(f"images: {len(images)} entries for {len(prompts)} prompts")
        for rid, prompt, p, im in zip(ids, prompts, params, images):
            self.add_request(rid, prompt, p, collect, images=im)
        while self.has_work():
            self.step()
        return [results[rid] for rid in ids]

    # -- scheduling -----------------------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if item.request_id in self._seqs:
                    item.callback(RequestOutput(item.request_id, [], finished=True, finish_reason="abort"))
                    continue
                self._seqs[item.request_id] = item
                self._waiting.append(item)
            else:
                seq = self._seqs.get(item)
                if seq is not None:
                    self._emit(seq, [], [], "abort")

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            seq = self._waiting.popleft()
            seq.slot = self._slots.index(None)  # lowest free slot: running rows stay packed at the front
            seq.state = PREFILL
            self._slots[seq.slot] = seq

    def _prefilling(self) -> list[_Seq]:
        return [s for s in self._slots if s is not None and s.state == PREFILL]

    def _round_rows(self, n: int) -> int:
        return -(-n // self._data) * self._data

    def _chunk_bucket(self, n: int) -> int:
        cap = min(self.config.max_num_batched_tokens, self.config.max_model_len)  # a chunk is part of one prompt
        return bucket(n, min(MIN_CHUNK_BUCKET, cap), cap, factor=4)

    def _chunk_buckets(self) -> list[int]:
        out, t = [], self._chunk_bucket(1)
        while True:
            out.append(t)
            if t >= min(self.config.max_num_batched_tokens, self.config.max_model_len):
                return out
            t = self._chunk_bucket(t + 1)

    def _prefill_rows(self, t: int) -> int:
        """The most sequences one prefill call takes with chunks of bucket ``t``: a power of two whose chunks fit the
        token budget (one at least), so the (sequences, chunk) buckets are a small fixed set."""
        fit = max(1, min(self.config.max_num_batched_tokens // t, self.config.max_num_seqs))
        return 1 << (fit.bit_length() - 1)

    def _kv_bucket(self, n: int) -> int:
        cap = self.config.slots_per_row
        return bucket(n, min(MIN_KV_BUCKET, cap), cap)

    def _prefill(self) -> bool:
        todo = sorted(self._prefilling(), key=lambda s: s.arrival)
        if not todo:
            return False
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[_Seq, int]] = []
        for seq in todo:
            if budget <= 0:
                break
            n = min(len(seq.prompt) - seq.cursor, budget)
            chunks.append((seq, n))
            budget -= n
        t = self._chunk_bucket(max(n for _, n in chunks))
        most = self._prefill_rows(t)
        chunks = chunks[:most]  # the rest wait for the next step
        p = self._round_rows(bucket(len(chunks), 1, most))
        b = self.config.max_num_seqs
        rows = np.full(p, b, np.int32)
        ids = np.zeros((p, t), np.int32)
        targets = np.zeros((p, t), np.int32)
        n_arr = np.zeros(p, np.int32)
        reset = np.zeros(p, bool)
        final = np.zeros(p, bool)
        key_data = np.zeros((p, 2), np.uint32)
        do_sample, temperature, top_k, top_p = np.zeros(p, bool), np.ones(p), np.zeros(p, np.int64), np.ones(p)
        end = 0
        want_prompt = want_top = None
        for i, (seq, n) in enumerate(chunks):
            sp = seq.params
            rows[i] = seq.slot
            ids[i, :n] = seq.prompt[seq.cursor:seq.cursor + n]
            nxt = seq.prompt[seq.cursor + 1:seq.cursor + n + 1]
            targets[i, :len(nxt)] = nxt
            n_arr[i] = n
            reset[i] = seq.cursor == 0
            final[i] = seq.cursor + n == len(seq.prompt)
            key_data[i] = seq.key_data
            do_sample[i], temperature[i] = not sp.greedy, (1.0 if sp.greedy else sp.temperature)
            top_k[i], top_p[i] = max(sp.top_k, 0), sp.top_p
            end = max(end, seq.cursor + n)
            if sp.prompt_logprobs is not None:
                want_prompt = self.config.max_logprobs
            if sp.logprobs is not None:
                want_top = self.config.max_logprobs
        sampling = SamplingArrays.make(do_sample, temperature, top_k, top_p)
        extra = {}
        if any(seq.images is not None for seq, _ in chunks):
            position_ids, image_embeds = self._image_arrays(chunks, ids.shape)
            extra = dict(position_ids=jnp.asarray(position_ids), image_embeds=jnp.asarray(image_embeds))
        self.pool, tok, lp, prompt = self._programs.prefill(
            self.pool, jnp.asarray(rows), jnp.asarray(ids), jnp.asarray(n_arr), jnp.asarray(reset),
            jnp.asarray(final), jnp.asarray(key_data), sampling, jnp.asarray(targets), kv_len=self._kv_bucket(end),
            top_k=want_top, prompt_top_k=want_prompt, **extra)
        tok, lp = np.asarray(tok), jax.tree.map(np.asarray, lp)
        prompt = None if prompt is None else jax.tree.map(np.asarray, prompt)
        now = time.monotonic()
        for i, (seq, n) in enumerate(chunks):
            if seq.params.prompt_logprobs is not None:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]
                k = seq.params.prompt_logprobs
                last = n - (1 if final[i] else 0)  # the chunk's last position predicts the next chunk's first token
                seq.prompt_logprobs += [_logprob(targets[i, j], prompt[0][i, j], prompt[1][i, j], prompt[2][i, j], k)
                                        for j in range(last)]
            seq.cursor += n
            self.metrics.prompt_tokens(n)
            if final[i]:
                seq.state = DECODE
                seq.first_token_time = now
                self.metrics.first_token(now - seq.arrival)
                if seq.params.max_tokens == 0:  # echo-only request: the prompt's log-probabilities, no output
                    self._emit(seq, [], [], "length")
                    continue
                self._accept(seq, [int(tok[i])], [_logprob(tok[i], lp[0][i], lp[1][i], lp[2][i], seq.params.logprobs)])
        return True

    def _image_arrays(self, chunks: list[tuple[_Seq, int]], shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The image variant's extra inputs for a prefill call of ``shape`` ``(P, T)``: ``position_ids [3, P, T]``
        (an image request's rows sliced from its prompt's M-RoPE rows, a text request's ``cursor + arange``, 0 at
        padding) and ``image_embeds [P·T, H]``: the features of the call's image tokens in row-major order of the
        ids — each chunk's from the count of image tokens its earlier chunks consumed — then zero rows (one shape
        per prefill bucket, so one more compiled program per bucket at most). A text request's own image-token ids
        (a raw prompt may hold them) get that token's embedding, what the text program gives them."""
        p, t = shape
        position_ids = np.zeros((3, p, t), np.int32)
        parts = []
        for i, (seq, n) in enumerate(chunks):
            c = seq.cursor
            if seq.images is not None:
                position_ids[:, i, :n] = seq.images.position_ids[:, c:c + n]
                parts.append(seq.images.embeds[int(seq.image_before[c]):int(seq.image_before[c + n])])
                continue
            position_ids[:, i, :n] = c + np.arange(n, dtype=np.int32)
            k = self._image_token is not None and sum(1 for x in seq.prompt[c:c + n] if x == self._image_token)
            if k:
                if self._placeholder_row is None:
                    row = self.model.embed(jnp.asarray([[self._image_token]], jnp.int32))
                    self._placeholder_row = np.asarray(row)[0]
                parts.append(np.repeat(self._placeholder_row, k, axis=0))
        dtype = next(x.dtype for x in parts)
        image_embeds = np.zeros((p * t, self.model.config.hidden_size), dtype)
        used = sum(len(x) for x in parts)
        if used:
            image_embeds[:used] = np.concatenate(parts)
        return position_ids, image_embeds

    def _pack(self) -> None:
        """Keep the decoding sequences in slots ``0 … n-1`` (the decode program reads a prefix of the pool's rows
        in place): move any decoding sequence above that range into the lowest slot in it that is free or held by a
        prefilling sequence (the two rows swap, states and all)."""
        decoding = [s for s in self._slots if s is not None and s.state == DECODE]
        n = len(decoding)
        for seq in sorted((s for s in decoding if s.slot >= n), key=lambda s: s.slot):
            hole = next(i for i in range(n) if self._slots[i] is None or self._slots[i].state != DECODE)
            other = self._slots[hole]
            self.pool = self._programs.swap(self.pool, seq.slot, hole)
            self._slots[hole], self._slots[seq.slot] = seq, other
            if other is not None:
                other.slot = seq.slot
            seq.slot = hole

    def _decode(self, max_steps: int) -> None:
        self._pack()
        running = [s for s in self._slots if s is not None and s.state == DECODE]
        if not running:
            return
        b = self.config.max_num_seqs
        size = min(self._round_rows(bucket(len(running), 1, b)), b)
        active = np.zeros(size, bool)
        active[[s.slot for s in running]] = True  # rows past the running ones (free or prefilling) are masked out
        if self.k:
            self._verify(running, size, active)
            return
        # no row gets more tokens than it may still produce, so none writes past its cache row
        steps = max(1, min(max_steps, *(s.params.max_tokens - len(s.output) for s in running)))
        longest = max(len(s.prompt) + len(s.output) for s in running) + steps
        # log-probabilities (a log-softmax and a top-k over the vocabulary per step) only when someone asks
        want = any(s.params.logprobs is not None for s in running)
        self.pool, (toks, lps, top_ids, top_lps) = self._programs.decode(
            self.pool, jnp.asarray(active), jnp.asarray(steps, jnp.int32), rows=None if size >= b else size,
            kv_len=self._kv_bucket(longest), max_steps=self.config.decode_steps,
            top_k=self.config.max_logprobs if want else None)
        toks, lps, top_ids, top_lps = (np.asarray(x) for x in (toks, lps, top_ids, top_lps))
        for seq in running:
            i = seq.slot
            lp = [_logprob(toks[j, i], lps[j, i], top_ids[j, i], top_lps[j, i], seq.params.logprobs)
                  for j in range(steps)]
            self._accept(seq, [int(t) for t in toks[:steps, i]], lp)

    def _verify(self, running: list[_Seq], size: int, active: np.ndarray) -> None:
        """One verify round (module docstring) for the running sequences, the first ``size`` rows."""
        b, k = self.config.max_num_seqs, self.k
        # a round writes k + 1 slots past a row's length and the head k − 1 more (EngineConfig.slots_per_row)
        longest = max(len(s.prompt) + len(s.output) for s in running) + 2 * k
        want = any(s.params.logprobs is not None for s in running)
        self.pool, toks, consumed, (lps, top_ids, top_lps) = self._programs.verify(
            self.pool, jnp.asarray(active), rows=None if size >= b else size, kv_len=self._kv_bucket(longest),
            top_k=self.config.max_logprobs if want else None)
        toks, consumed, lps, top_ids, top_lps = (np.asarray(x) for x in (toks, consumed, lps, top_ids, top_lps))
        self.speculation.rounds += 1
        for seq in running:
            i, n = seq.slot, int(consumed[seq.slot])
            self.speculation.record(n)
            self.metrics.speculated(k, n - 1)
            lp = [_logprob(toks[i, j], lps[i, j], top_ids[i, j], top_lps[i, j], seq.params.logprobs)
                  for j in range(n)]
            self._accept(seq, [int(t) for t in toks[i, :n]], lp)

    def _accept(self, seq: _Seq, tokens: list[int], logprobs: list) -> None:
        """Append decoded tokens up to the first stop token or the length limit and emit them (finished when
        either was reached; tokens decoded after it are dropped)."""
        reason = stop_reason = None
        take = []
        for t in tokens:
            take.append(t)
            if t in seq.stop_ids:
                reason = "stop"
                stop_reason = None if t in self.eos_token_ids and not seq.params.ignore_eos else t
                break
            if len(seq.output) + len(take) >= seq.params.max_tokens:
                reason = "length"
                break
        now = time.monotonic()
        if seq.output and seq.last_token_time is not None:
            self.metrics.inter_token((now - seq.last_token_time) / len(take), len(take))
        seq.last_token_time = now
        seq.output += take
        self.metrics.generated_tokens(len(take))
        self._emit(seq, take, logprobs[:len(take)], reason, stop_reason)

    def _emit(self, seq: _Seq, tokens: list[int], logprobs: list, reason: str | None = None,
              stop_reason: int | None = None) -> None:
        """Send the request its new output; with ``reason`` it is finished and its slot is free at once."""
        if reason is not None:
            if seq.slot >= 0 and self._slots[seq.slot] is seq:
                self._slots[seq.slot] = None
            if seq in self._waiting:
                self._waiting.remove(seq)
            self._seqs.pop(seq.request_id, None)
            self.metrics.finished(reason, time.monotonic() - seq.arrival)
        prompt_lp, seq.prompt_logprobs = seq.prompt_logprobs, None
        out = RequestOutput(seq.request_id, tokens, logprobs if seq.params.logprobs is not None else None, prompt_lp,
                            reason is not None, reason, stop_reason)
        try:
            seq.callback(out)
        except Exception:  # a consumer's failure is its own: the other requests keep running
            logger.exception("output callback of request %s failed; aborting it", seq.request_id)
            if reason is None:
                self.abort(seq.request_id)


def _logprob(token, lp, top_ids, top_lps, k: int | None) -> TokenLogprob | None:
    if k is None:
        return None
    return TokenLogprob(int(token), float(lp), tuple((int(i), float(v)) for i, v in zip(top_ids[:k], top_lps[:k])))
