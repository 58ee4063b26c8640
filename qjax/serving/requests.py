"""A request as the engine takes it: its decoding settings and the ranges they are checked against, its prompt, its
images, and what it produces. Every value that reaches the device is checked here, at admission
(:meth:`SamplingParams.check`, :func:`check_prompt`; :meth:`qjax.serving.engine.Engine.validate` calls both), so a
step never meets a value it cannot hold: the engine is a Python API too (``Engine.generate``, ``add_request``) and
trusts no caller. The ranges (the HTTP schema states the same):

========================  ==================================================================================
``max_tokens``            an int ≥ 0, and prompt + max_tokens ≤ ``max_model_len``
``temperature``           a finite real ≥ 0 (< 1e-5: greedy; above 1e30 it samples as 1e30 does, see
                          :data:`qjax.runtime.sampling.MAX_TEMPERATURE`)
``top_p``                 a finite real in (0, 1]
``top_k``                 an int in [−1, 2³¹ − 1]; −1 and 0: off; k ≥ the vocabulary: every token (vLLM)
``seed``                  None or an int in [−2⁶³, 2⁶⁴): its 64 bits make the key
                          (:func:`qjax.runtime.sampling.seed_key_data`), so s and s − 2⁶⁴ are one seed
``stop_token_ids``        ints in [0, vocab)
``ignore_eos``            a bool
``logprobs``              None or an int in [0, ``max_logprobs``]; ``prompt_logprobs`` the same
prompt token ids          ints in [0, vocab), at least one
========================  ==================================================================================

Ints are ints (``numbers.Integral``: Python or numpy), never bools; reals may be ints or floats, never bools.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from qjax.multimodal.prompt import prepare_images
from qjax.runtime.sampling import SEED_END, SEED_MIN

# Greedy below this temperature, as vLLM does (OpenAI's temperature 0 means greedy).
GREEDY_TEMPERATURE = 1e-5
TOP_K_MAX = (1 << 31) - 1  # top_k lives in an int32 row; any k ≥ the vocabulary already means every token


class EngineError(ValueError):
    """A request or a configuration the engine cannot serve; the message names the field and the numbers."""


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _bad(field: str, msg: str):
    raise EngineError(f"{field}: {msg}")


def _check_int(field: str, v, lo: int, hi: int, what: str) -> None:
    """``v`` an int in [lo, hi] (``what`` names the range in the message)."""
    if not is_int(v):
        _bad(field, f"must be an integer {what}, got {v!r}")
    if not lo <= v <= hi:
        _bad(field, f"must be {what}, got {v}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings (OpenAI / vLLM semantics; the ranges: the module docstring)."""

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

    def check(self, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Raise :class:`EngineError` (``field: …``, the value and its range) for a setting outside its range;
        ``vocab_size`` bounds the stop token ids (None: not checked here)."""
        if not is_int(self.max_tokens):
            _bad("max_tokens", f"must be a non-negative integer, got {self.max_tokens!r}")
        if self.max_tokens < 0:
            _bad("max_tokens", f"must be a non-negative integer, got {self.max_tokens}")
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            _bad("temperature", f"must be a finite number ≥ 0, got {t!r}")
        p = self.top_p
        if not is_real(p) or not (math.isfinite(p) and 0.0 < p <= 1.0):
            _bad("top_p", f"must be a number in (0, 1], got {p!r}")
        _check_int("top_k", self.top_k, -1, TOP_K_MAX, f"in [-1, {TOP_K_MAX}] (-1 or 0: off)")
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_END - 1, f"in [{SEED_MIN}, {SEED_END})")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            _bad("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None:
                _check_int(field, v, 0, max_logprobs, f"between 0 and {max_logprobs}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
            _bad("stop_token_ids", f"must be a sequence of token ids, got {type(stops).__name__}")
        for t in stops:
            if not is_int(t):
                _bad("stop_token_ids", f"token ids must be integers, got {t!r}")
            if vocab_size is not None and not 0 <= t < vocab_size:
                _bad("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")


def check_prompt(prompt: Sequence, vocab_size: int) -> None:
    """Raise :class:`EngineError` unless ``prompt`` is a non-empty sequence of int token ids in [0, vocab)."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            _bad("prompt", f"must be one row of integer token ids, got a {prompt.dtype} array {list(prompt.shape)}")
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        _bad("prompt", f"must be a sequence of token ids, got {type(prompt).__name__}")
    else:
        wrong = next((t for t in prompt if not is_int(t)), None)
        if wrong is not None:
            _bad("prompt", f"token ids must be integers, got {wrong!r}")
    if not len(prompt):
        _bad("prompt", "empty (at least one token is needed)")
    bad = next((int(t) for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        _bad("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token that ended it (None for the model's eos)
    # with finish_reason "error": one line for the client, what failed (the engine's log has the traceback); the
    # tokens sent before it stand, the other requests went on
    error: str | None = None
