"""Cached generation: one jitted prefill, then either one jitted ``while_loop`` over all decode steps (``generate``)
or one jitted step per token (``stream``). Routing, sampling and the stop test stay on device.

Batches are left-padded: every row ends at the same cache slot, pads are masked out of attention and are exact
no-ops on the GDN conv window and state, and each row's RoPE positions count only its real tokens — so a row
decodes the same tokens batched as alone.

The cache is sized by :func:`cache_length` (whole :data:`CACHE_GRANULE` blocks) and the decode loop takes its step
count as an argument, so calls with different prompt lengths and ``max_new_tokens`` run the same compiled decode
loop (and, for one prompt shape, the same prefill).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.kernels import use as use_kernels
from qjax.model.cache import Cache, cache_length
from qjax.model.config import GenerationConfig
from qjax.multimodal.prompt import prepare_images
from qjax.runtime.sampling import SamplingArrays, filter_logits, seed_key
from qjax.runtime.speculative import SpeculativeStats, generate_speculative, row_keys
from qjax.runtime.speculative import rounds as speculative_rounds
from qjax.runtime.xla_options import decode_compiler_options, decode_mode
from qjax.validation import MAX_TOKEN_ID


# ---------------------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------------------
def process_logits(logits: jnp.ndarray, *, temperature: float, top_k: int, top_p: float) -> jnp.ndarray:
    """Temperature → top-k → top-p, as transformers' warpers do; removed entries become -inf. ``logits [B, V]``."""
    return filter_logits(logits, SamplingArrays.make(np.ones(logits.shape[0], bool), temperature, top_k, top_p))


def next_token(logits: jnp.ndarray, key: jax.Array, *, do_sample: bool, temperature: float, top_k: int,
               top_p: float) -> jnp.ndarray:
    """``logits [B, V]`` → ``[B]`` int32: argmax (first index on ties, like torch) or a seeded sample.

    One key draws for the whole batch (``[B, V]`` noise); a batch of one draws exactly as the serving engine draws
    for that row with the same key (:func:`qjax.runtime.sampling.sample`)."""
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """The sampling settings of one ``generate``/``stream`` call, static in its compiled programs."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    pad: int

    def arrays(self, batch: int) -> SamplingArrays:
        """These settings for every one of ``batch`` rows (the per-row form speculation and the engine use)."""
        return SamplingArrays.make(np.full(batch, self.do_sample), self.temperature, self.top_k, self.top_p)


# ---------------------------------------------------------------------------------------------------------------------
# jitted programs
# ---------------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("impl",), donate_argnums=(2,))
def prefill(graphdef, state, cache: Cache, input_ids, attention_mask, impl: str | None = None, position_ids=None,
            image_embeds=None):
    """``input_ids [B, T]`` into ``cache``: (last-position logits ``[B, V]``, the cache). ``impl``: the kernel
    implementation to trace with (None: the default; :mod:`qjax.runtime.bench` times others). An image prompt
    (:class:`qjax.multimodal.prompt.ImagePrompt`) brings its ``position_ids [3, B, T]`` and ``image_embeds [N, H]``."""
    with use_kernels(impl):
        model = nnx.merge(graphdef, state)
        out = model.forward(input_ids, attention_mask=attention_mask, cache=cache, last_only=True,
                            position_ids=position_ids, image_embeds=image_embeds)
    return out.logits[:, -1], out.cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _extend(graphdef, state, cache: Cache, input_ids, attention_mask):
    out = nnx.merge(graphdef, state).forward(input_ids, attention_mask=attention_mask, cache=cache)
    return out.logits, out.cache


def extend(model, cache: Cache, input_ids, attention_mask=None) -> tuple[jnp.ndarray, Cache]:
    """Run ``input_ids [B, T]`` through the model on top of ``cache`` (prefill, or continue a conversation).

    Returns logits ``[B, T, V]`` for every new position and the updated cache (the old one is donated).
    """
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.ones(ids.shape, jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    used = int(jnp.max(cache.lengths))
    if used + ids.shape[1] > cache.max_len:
        raise ValueError(f"cache holds {cache.max_len} positions; {used} used, {ids.shape[1]} more asked")
    graphdef, state = nnx.split(model)
    return _extend(graphdef, state, cache, ids, mask)


def _is_eos(tok, eos):
    if not eos:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(eos, jnp.int32)[None, :], axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _step(graphdef, state, cache: Cache, logits, key, s: DecodeSettings, done):
    """Pick a token from ``logits``, feed it, return (token, next logits, cache, done)."""
    tok = next_token(logits, key, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    tok = jnp.where(done, s.pad, tok)
    done = done | _is_eos(tok, s.eos)
    model = nnx.merge(graphdef, state)
    out = model.forward(tok[:, None], cache=cache)
    return tok, out.logits[:, -1], out.cache, done


def _decode_loop(graphdef, state, cache: Cache, logits, key, s: DecodeSettings, max_new_tokens,
                 impl: str | None = None):
    """All decode steps in one program; stops early once every row has emitted a stop token. ``max_new_tokens``
    (≤ the cache's free slots + 1) is an argument, not part of the program. Returns (tokens ``[B, cache.max_len]``, of
    which the first n columns were generated, n, the cache)."""
    with use_kernels(impl):
        return _decode_loop_body(graphdef, state, cache, logits, key, s, max_new_tokens)


@functools.cache
def _decode_loop_jit(mode: str):
    return jax.jit(_decode_loop, static_argnums=(0, 5), static_argnames=("impl",), donate_argnums=(2,),
                   compiler_options=decode_compiler_options(mode))


def decode_loop_for(mode: str | None = None):
    """The jitted decode loop compiled with the decode programs' XLA options of ``mode``
    (:mod:`qjax.runtime.xla_options`; None: ``$QJAX_DECODE_GRAPHS`` or the default), one program per mode."""
    return _decode_loop_jit(decode_mode(mode))


decode_loop = decode_loop_for()  # the process's mode, settled at import


def _decode_loop_body(graphdef, state, cache: Cache, logits, key, s: DecodeSettings, max_new_tokens):
    b = logits.shape[0]
    model = nnx.merge(graphdef, state)
    max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
    tokens = jnp.full((b, cache.max_len), s.pad, jnp.int32)  # wide enough for any step count the cache allows

    def cond(carry):
        i, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, logits, key, done, tokens = carry
        key, sub = jax.random.split(key)
        tok = next_token(logits, sub, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k,
                         top_p=s.top_p)
        tok = jnp.where(done, s.pad, tok)
        done = done | _is_eos(tok, s.eos)
        tokens = tokens.at[:, i].set(tok)
        # the last token needs no forward pass: nothing reads its logits
        out_logits, cache = jax.lax.cond(
            i + 1 < max_new_tokens,
            lambda c: _forward_one(model, tok, c),
            lambda c: (logits, c),
            cache)
        return i + 1, cache, out_logits, key, done, tokens

    init = (jnp.zeros((), jnp.int32), cache, logits, key, jnp.zeros((b,), bool), tokens)
    n, cache, _, _, _, tokens = jax.lax.while_loop(cond, body, init)
    return tokens, n, cache


def _forward_one(model, tok, cache):
    out = model.forward(tok[:, None], cache=cache)
    return out.logits[:, -1], out.cache


# ---------------------------------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------------------------------
def _resolve(model, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
             generation_config) -> tuple[DecodeSettings, int]:
    gc = generation_config or getattr(model, "generation_config", None) or GenerationConfig()
    if max_new_tokens is None:
        max_new_tokens = gc.max_new_tokens
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    eos = gc.eos_token_id if eos_token_id is None else (
        tuple(eos_token_id) if isinstance(eos_token_id, Sequence) else (int(eos_token_id),))
    pad = pad_token_id if pad_token_id is not None else gc.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    s = DecodeSettings(
        do_sample=gc.do_sample if do_sample is None else bool(do_sample),
        temperature=float(gc.temperature if temperature is None else temperature),
        top_k=int(gc.top_k if top_k is None else top_k),
        top_p=float(gc.top_p if top_p is None else top_p),
        eos=tuple(int(e) for e in eos), pad=int(pad))
    # ids are held as int32: one of 10^20 would overflow deep in a jitted step (an id past the vocabulary is only
    # never generated — a tokenizer's stop ids may lie past a small model's vocabulary)
    for name, ids in (("eos_token_id", s.eos), ("pad_token_id", (s.pad,))):
        bad = next((i for i in ids if not 0 <= i <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise ValueError(f"{name} {bad} is not a token id (0 to {MAX_TOKEN_ID})")
    if s.do_sample and s.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {s.temperature}")
    if not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be ≥ 0, got {s.top_k}")
    return s, int(max_new_tokens)


def _speculative_k(s: DecodeSettings, speculative, num_speculative_tokens) -> int:
    if speculative != "mtp":
        raise ValueError(f"speculative must be 'mtp' (the checkpoint's MTP head), got {speculative!r}")
    return 1 if num_speculative_tokens is None else int(num_speculative_tokens)


def _stream_speculative(model, input_ids, attention_mask, s: DecodeSettings, n_new: int, seed: int, speculative,
                        num_speculative_tokens, stats: SpeculativeStats | None) -> Iterator[np.ndarray]:
    k = _speculative_k(s, speculative, num_speculative_tokens)
    ids, mask = _check_prompt(model, input_ids, attention_mask)
    if stats is None:
        stats = SpeculativeStats(num_speculative_tokens=k)
    elif stats.num_speculative_tokens != k:
        raise ValueError(f"stats counts {stats.num_speculative_tokens} drafts per round, but num_speculative_tokens "
                         f"is {k}")
    rows = [[] for _ in range(ids.shape[0])]
    sent = 0
    for new, done in speculative_rounds(model, ids, mask, max_new_tokens=n_new, k=k, eos=s.eos, stats=stats,
                                        sampling=s.arrays(ids.shape[0]), keys=row_keys(seed, ids.shape[0])):
        for row, toks in zip(rows, new):
            row.extend(toks)
        # a position is out once every row still generating has reached it
        ready = min((len(row) for row, d in zip(rows, done) if not d), default=max(len(row) for row in rows))
        for i in range(sent, ready):
            yield np.asarray([row[i] if i < len(row) else s.pad for row in rows], np.int32)
        sent = max(sent, ready)


def _prefilled(model, input_ids, attention_mask, max_new_tokens, images, pad: int):
    """(prompt ids ``[B, T]`` as run — image placeholders expanded —, graphdef, state, last logits, cache) after the
    prompt's prefill; with ``images``, through :func:`qjax.multimodal.prompt.prepare_images`."""
    position_ids = image_embeds = None
    if images is not None:
        prompt = prepare_images(model, input_ids, attention_mask, images, pad_token_id=pad)
        input_ids, attention_mask = prompt.input_ids, prompt.attention_mask
        position_ids, image_embeds = jnp.asarray(prompt.position_ids), prompt.image_embeds
    ids, mask = _check_prompt(model, input_ids, attention_mask)
    cache = model.init_cache(ids.shape[0], cache_length(ids.shape[1], max_new_tokens))
    graphdef, state = nnx.split(model)
    logits, cache = prefill(graphdef, state, cache, jnp.asarray(ids, jnp.int32), jnp.asarray(mask),
                            position_ids=position_ids, image_embeds=image_embeds)
    return ids, graphdef, state, logits, cache


def _check_images(images, speculative, num_speculative_tokens) -> None:
    if images is not None and (speculative is not None or num_speculative_tokens is not None):
        # the MTP head's positions would need the prompt's M-RoPE rows; not wired yet
        raise ValueError("speculative decoding with image input is not supported; generate without speculative=")


def _check_prompt(model, input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """(ids ``[B, T]``, mask ``[B, T]``) as numpy, checked: in-vocabulary ids, left padding, a real last token."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T ≥ 1, got shape {ids.shape}")
    vocab = model.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"input_ids must be in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
    if np.any(mask[:, :-1] > mask[:, 1:]):
        raise ValueError("attention_mask must be left-padded (zeros before ones in every row)")
    if np.any(mask[:, -1] == 0):
        raise ValueError("every row needs at least one real token at the end (left padding)")
    return ids, mask


def generate(model, input_ids, *, max_new_tokens: int | None = None, attention_mask=None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, eos_token_id=None, pad_token_id: int | None = None,
             generation_config: GenerationConfig | None = None, speculative: str | None = None,
             num_speculative_tokens: int | None = None, return_stats: bool = False, images=None):
    """Generate up to ``max_new_tokens`` tokens after each (left-padded) prompt.

    Unset sampling options come from ``generation_config`` or the model's ``generation_config.json``; greedy when
    ``do_sample`` is off. After a row emits a stop token it is filled with ``pad_token_id``.

    Args:
      input_ids: ``[B, T]`` (or ``[T]``) int token ids, left-padded.
      attention_mask: ``[B, T]``, 0 at left pads; default all ones.
      speculative: ``"mtp"``: the checkpoint's MTP head drafts ``num_speculative_tokens`` (default 1) tokens per
        main-model call (:mod:`qjax.runtime.speculative`): greedy, the same tokens as without it; sampling, tokens
        from the same distribution (each row drawing with its own key from ``seed``, so not the same draws).
      return_stats: also return a :class:`qjax.runtime.speculative.SpeculativeStats` (with ``speculative``).
      images: image sources (paths, bytes, PIL images, uint8 arrays) for the prompts' image placeholders
        (``image_token_id``, one per image as the chat template writes ``<|image_pad|>``), in order across the rows
        (:func:`qjax.multimodal.prompt.prepare_images`): each placeholder is expanded to the image's merged-patch
        count and the prompt runs with M-RoPE positions. Needs a model loaded with its vision tower.
    Returns:
      ``[B, T + n]`` int32 numpy array: the prompts followed by the n generated tokens (n ≤ max_new_tokens; fewer
      when every row stopped early); with ``return_stats``, ``(tokens, stats)``. With ``images`` the prompt part is
      the expanded prompt that ran.
    """
    s, n_new = _resolve(model, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
                        generation_config)
    _check_images(images, speculative, num_speculative_tokens)
    if speculative is not None or num_speculative_tokens is not None:
        k = _speculative_k(s, speculative, num_speculative_tokens)
        ids, mask = _check_prompt(model, input_ids, attention_mask)
        tokens, stats = generate_speculative(model, ids, mask, max_new_tokens=n_new, k=k, eos=s.eos, pad=s.pad,
                                             sampling=s.arrays(ids.shape[0]), keys=row_keys(seed, ids.shape[0]))
        return (tokens, stats) if return_stats else tokens
    if return_stats:
        raise ValueError("return_stats needs speculative='mtp'")
    ids, graphdef, state, logits, cache = _prefilled(model, input_ids, attention_mask, n_new, images, s.pad)
    tokens, n, _ = decode_loop(graphdef, state, cache, logits, seed_key(seed), s, n_new)
    n = int(n)
    return np.concatenate([np.asarray(ids), np.asarray(tokens)[:, :n]], axis=1)


def stream(model, input_ids, *, max_new_tokens: int | None = None, attention_mask=None,
           do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
           top_p: float | None = None, seed: int = 0, eos_token_id=None, pad_token_id: int | None = None,
           generation_config: GenerationConfig | None = None, speculative: str | None = None,
           num_speculative_tokens: int | None = None, stats: SpeculativeStats | None = None, images=None
           ) -> Iterator[np.ndarray]:
    """Like :func:`generate` but yields each step's ``[B]`` tokens as soon as they exist (same tokens, same seed).
    With ``speculative="mtp"`` a verify round yields all the positions every row has reached (1 … k + 1 at once;
    rows that stopped give ``pad_token_id``), and ``stats`` (a :class:`SpeculativeStats` for
    ``num_speculative_tokens``), when given, is updated round by round."""
    s, n_new = _resolve(model, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
                        generation_config)
    _check_images(images, speculative, num_speculative_tokens)
    if speculative is not None or num_speculative_tokens is not None:
        yield from _stream_speculative(model, input_ids, attention_mask, s, n_new, seed, speculative,
                                       num_speculative_tokens, stats)
        return
    if stats is not None:
        raise ValueError("stats needs speculative='mtp'")
    ids, graphdef, state, logits, cache = _prefilled(model, input_ids, attention_mask, n_new, images, s.pad)
    key = seed_key(seed)
    done = jnp.zeros((ids.shape[0],), bool)
    for _ in range(n_new):
        key, sub = jax.random.split(key)
        tok, logits, cache, done = _step(graphdef, state, cache, logits, sub, s, done)
        yield np.asarray(tok)
        if bool(jnp.all(done)):
            return
