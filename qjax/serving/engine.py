"""Continuous batching: a pool of sequence slots on the device, requests that join and leave at any step.

    engine = Engine(model, EngineConfig(max_num_seqs=16, max_model_len=4096), eos_token_ids=(eos,))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))      # blocking, from Python
    engine.start(); engine.add_request("r1", ids, params, callback); …; engine.shutdown()   # a server's loop

The pool is one :class:`qjax.model.cache.Cache` of ``max_num_seqs`` rows × ``max_model_len`` slots (each row: its
full-attention K/V, its GDN conv window and fp32 recurrent state, its own length), plus per-row device arrays: the
last token, the PRNG key and the sampling settings (:mod:`qjax.serving.programs`: the pool and the programs; this
module: the scheduler). Every engine step runs on the calling thread (or the engine's own thread) and issues at most
two device programs, both compiled for a few bucketed shapes only:

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
``qjax.generate``'s for that prompt, and a seeded request draws with its seed's key split once per token, as
``qjax.generate`` does, so sampled tokens equal too (tests/test_serving_engine.py). The key is made from the seed's 64
bits (:func:`qjax.runtime.sampling.seed_key_data`), which is ``jax.random.key(seed)`` for seeds in [0, 2³²).

**Failures** end only the requests they belong to. Values are range-checked at admission
(:mod:`qjax.serving.requests`); a step's host work is done per sequence, and a sequence whose part fails (building
its prefill row, reading its results) ends alone with ``finish_reason`` ``"error"`` and a one-line
``RequestOutput.error``. A device call that raises (prefill, decode, verify, swap) is blamed on no one yet: a
sequence that ran it alone ends with an error; the call's others become *suspects* that run their next calls alone
until one passes (a sequence in :data:`MAX_CALL_FAILURES` failed calls ends anyway). If the call took the pool (it is
donated) every sequence is *rewound* onto a new one: prefill runs again over its prompt and the tokens it emitted,
from its key as it was then. Its last emitted token is drawn again by that prefill and must equal — rows are
deterministic (greedy, or seeded: the key split once per draw) — so the row is where it was and nothing is emitted
twice; if it differs (another arithmetic, a near-tie) the emitted tokens stand as context and the next one is drawn.
No other program is compiled while nothing fails.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qjax.multimodal.positions import PromptError
from qjax.model.vision import patch_buckets
from qjax.multimodal.prompt import check_vision, image_processor
from qjax.program_cache import ProgramCache
from qjax.runtime.sampling import SamplingArrays, kept_key_data, seed_key_data
from qjax.runtime.speculative import SpeculativeStats

from .programs import Pool, Programs
from .warmup import MapBudget, compile_times

# the request side lives in .requests; its public names stay importable from here (api.py, protocol.py, qjax.serving)
from .requests import (  # noqa: F401
    EngineError,
    ImageInput,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    check_prompt,
    encode_images,
    is_int,
)

logger = logging.getLogger("qjax.serving")

# Smallest bucket of cache slots attention reads; buckets grow ×KV_FACTOR up to max_model_len.
MIN_KV_BUCKET = 256
# Bucket growth of the cache slots attention reads and of the rows a call runs (decode rows, prefill sequences):
# every bucket is a compiled program and a server compiles them all before it is ready, so ×4 (a call pays at most
# 4× the rows or slots it needs, in place of 2×: three kv_len buckets for a 4,096-token context instead of five)
KV_FACTOR = 4
ROW_FACTOR = 4
# Smallest prefill chunk bucket (tokens per sequence per call; the GDN chunk size); buckets grow ×4 up to
# max_num_batched_tokens.
MIN_CHUNK_BUCKET = 64
# A sequence in this many failed device calls is ended even if it never failed alone: calls that fail only together
# (too many rows at once, say) would else fail and be retried forever.
MAX_CALL_FAILURES = 3


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
            if not is_int(v) or v < 1:
                raise EngineError(f"{name} must be a positive integer, got {v!r}")
        for name in ("num_speculative_tokens", "max_logprobs"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise EngineError(f"{name} must be a non-negative integer, got {v!r}")
        if self.max_model_len > max_position_embeddings:
            raise EngineError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                              f"{max_position_embeddings}")
        if self.max_num_seqs % data_parallel:
            raise EngineError(f"max_num_seqs {self.max_num_seqs} is not a multiple of the mesh's data axis "
                              f"({data_parallel}): the slot pool is split over it")


# ---------------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------------
WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"


@dataclasses.dataclass(eq=False)  # one request: compared by identity
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    callback: Callable[[RequestOutput], None]
    stop_ids: frozenset
    key_data: np.ndarray  # [2] uint32: the seed's key
    arrival: float
    state: str = WAITING
    slot: int = -1
    cursor: int = 0  # tokens of `fill` prefilled
    output: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    images: ImageInput | None = None
    image_before: np.ndarray | None = None  # [T + 1]: image tokens in prompt[:i] (a chunk's first feature row)
    # what prefill runs over: the prompt, or after a rewind (module docstring, "Failures") the prompt and the tokens
    # emitted; from the key `key_data` split `fill_draws` times; `expect`: the token the replay must draw again
    fill: list[int] | None = None
    fill_key: np.ndarray | None = None  # [2] uint32; None: key_data
    fill_draws: int = 0
    expect: int | None = None
    draws: int = 0  # splits of the row's device key so far (one per drawn token; with speculation, per round)
    counted: int = 0  # prompt tokens reported to the metrics (a replay does not count them again)
    suspect: str | None = None  # "prefill" / "decode": a failed call's kind it must pass alone before batching again
    failures: int = 0  # failed device calls it was part of

    def __post_init__(self):
        if self.fill is None:
            self.fill = self.prompt


class _Chunk(NamedTuple):
    """One sequence's part of a prefill call, as host values (made per sequence: a failure is its own)."""

    seq: _Seq
    n: int  # tokens
    ids: np.ndarray  # [n] int32
    targets: np.ndarray  # [n] int32, [n - 1] in the last chunk: the token after each
    key: np.ndarray  # [2] uint32: the row's key when it starts
    sampling: tuple  # (do_sample, temperature, top_k, top_p)
    reset: bool  # the row starts here
    final: bool  # the fill ends here: the row draws a token
    prompt_lp: bool  # prompt log-probabilities wanted
    top_lp: bool  # the drawn token's log-probabilities wanted


def bucket(n: int, lo: int, hi: int, factor: int = 2) -> int:
    """The smallest of ``lo, lo·factor, …`` (capped at ``hi``, which is always a bucket) that holds ``n``."""
    b = lo
    while b < n and b < hi:
        b *= factor
    return min(b, hi) if n <= hi else n


class EngineMetricsSink:
    """What the engine reports as it runs (the server counts it for ``/metrics``); the default ignores it."""

    def queue(self, running: int, waiting: int) -> None: ...
    def kv_cache(self, used: float) -> None:
        """The share (0–1) of the pool's cache slots that the running requests' tokens fill."""
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
                 metrics: EngineMetricsSink | None = None, seed: int | None = None,
                 programs: ProgramCache | None = None):
        """``seed``: seeds the random seeds of requests that give none (None: fresh randomness). ``programs``: where
        the device programs are kept traced between processes (a warm start skips tracing; None: traced in each)."""
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
        self._programs = Programs(model, self.compiled.add, self.k, programs)
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

    def warmup_plan(self) -> list[tuple[str, Callable[[], None]]]:
        """Every device program a request can reach, as (a description, a call that compiles and runs it on padding
        rows only: no row is touched): decode (verify, with speculation) at every row bucket × ``kv_len`` bucket,
        without and with log-probabilities; prefill at every (sequences, chunk) bucket × the ``kv_len`` buckets its
        chunks can reach (log-probabilities are data there: one program), and its image variant when the model has
        a vision tower; the row swap. What :meth:`warmup` runs before a server says it is ready."""
        b, cfg = self.config.max_num_seqs, self.config
        plan: list[tuple[str, Callable[[], None]]] = []
        sizes = sorted({self._decode_rows(n) for n in range(1, b + 1)})
        kvs = self._kv_buckets()
        for kv in kvs:
            for size in sizes:
                for top_k in (None, cfg.max_logprobs):
                    rows = None if size >= b else size
                    what = (f"{'verify' if self.k else 'decode'} rows={size} kv_len={kv}"
                            + (f" logprobs={top_k}" if top_k is not None else ""))
                    plan.append((what, functools.partial(self._warm_decode, size, rows, kv, top_k)))
        images = self.k == 0 and getattr(self.model, "visual", None) is not None
        low = 1
        for t in self._chunk_buckets():
            most = self._prefill_rows(t)
            for p in sorted({self._round_rows(bucket(n, 1, most, ROW_FACTOR)) for n in range(1, most + 1)}):
                for kv in (k for k in kvs if k >= self._kv_bucket(low)):
                    for image in (False, True) if images else (False,):
                        what = f"prefill rows={p} chunk={t} kv_len={kv}" + (" images" if image else "")
                        plan.append((what, functools.partial(self._warm_prefill, p, t, kv, image)))
            low = t + 1
        plan.append(("swap", lambda: setattr(self, "pool", self._programs.swap(self.pool, 0, 0))))
        if images:
            visual = self.model.visual
            for size in patch_buckets(self._most_patches(), self.model.vision_config.merge_unit):
                plan.append((f"vision tower patches={size}", functools.partial(visual.compile_bucket, size)))
        return plan

    def _most_patches(self) -> int:
        """The most patches one vision-tower call of a request meets here: its image tokens fill at most the context
        (``merge_unit`` patches each), and one image is at most the processor's ``max_pixels`` — a request of several
        images larger together compiles its tower bucket when it comes."""
        vc = self.model.vision_config
        proc = image_processor(self.model)
        per_image = proc.max_pixels // (proc.patch_size ** 2)
        return max(1, min(vc.merge_unit * self.config.max_model_len, per_image))

    def warmup(self, progress: Callable[[int, int, str, float, dict[str, float]], None] | None = None) -> int:
        """Compile (and run once, on padding rows) every program of :meth:`warmup_plan`, then serve a few tiny
        requests on this thread (greedy, sampled, with log-probabilities and prompt log-probabilities) so that the
        host side's first-use work is done too; a request after this compiles nothing (tested). ``progress(i, n,
        description, seconds, parts)`` after each program, ``parts`` where its seconds went (:func:`compile_times`).
        Must run before :meth:`start`. Returns the number of programs compiled."""
        if self._thread is not None:
            raise EngineError("warmup() runs before start(): it drives the programs on the calling thread")
        plan = self.warmup_plan()
        budget = MapBudget()
        for i, (what, run) in enumerate(plan, start=1):
            budget.check(f"the warm-up stopped before program {i} of {len(plan)} ({what})", EngineError)
            t0 = time.perf_counter()
            with compile_times() as parts, budget:
                run()
                jax.block_until_ready(self.pool)
            if progress is not None:
                progress(i, len(plan), what, time.perf_counter() - t0, parts)
        n = min(8, self.config.max_model_len - 2)
        prompt = [int(i) % self.vocab_size for i in range(1, n + 1)]
        self.generate([prompt] * 4, [SamplingParams(max_tokens=2, temperature=0),
                                     SamplingParams(max_tokens=2, temperature=0.7, top_k=5, top_p=0.9, seed=0),
                                     SamplingParams(max_tokens=2, temperature=0, logprobs=1),
                                     SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)])
        return len(self.compiled)

    def _kv_buckets(self) -> list[int]:
        out, kv = [], self._kv_bucket(1)
        while True:
            out.append(kv)
            if kv >= self.config.slots_per_row:
                return out
            kv = self._kv_bucket(kv + 1)

    def _warm_decode(self, size: int, rows: int | None, kv: int, top_k: int | None) -> None:
        # host arrays, as the steps pass them: the same input signatures, so the programs found again at run time
        inactive = np.zeros((size,), bool)
        if self.k:
            self.pool, *_ = self._programs.verify(self.pool, inactive, rows=rows, kv_len=kv, top_k=top_k)
        else:
            self.pool, _ = self._programs.decode(self.pool, inactive, np.int32(1), rows=rows,
                                                 kv_len=kv, max_steps=self.config.decode_steps, top_k=top_k)

    def _warm_prefill(self, rows: int, t: int, kv: int, image: bool) -> None:
        z = functools.partial(np.zeros, dtype=np.int32)
        extra = {}
        if image:  # the shapes and dtypes _image_arrays gives (the tower's features are in the model's dtype)
            extra = dict(position_ids=z((3, rows, t)), image_embeds=np.zeros(
                (rows * t, self.model.config.hidden_size), np.dtype(self.model.dtype)))
        self.pool, *_ = self._programs.prefill(
            self.pool, np.full((rows,), self.config.max_num_seqs, np.int32), z((rows, t)), z((rows,)),
            np.zeros((rows,), bool), np.zeros((rows,), bool), np.zeros((rows, 2), np.uint32),
            SamplingArrays.zeros(rows), z((rows, t)), np.bool_(False), kv_len=kv, top_k=self.config.max_logprobs,
            **extra)

    # -- requests (any thread) ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    callback: Callable[[RequestOutput], None], images: ImageInput | None = None) -> None:
        """Queue a request; ``callback`` receives its outputs on the engine's thread. ``images``: the
        :class:`ImageInput` of an image prompt (``prompt_ids`` then is the expanded prompt :func:`encode_images`
        returned). Raises :class:`EngineError` for a request that cannot be served (the message names the field and
        the numbers)."""
        if not callable(callback):
            raise EngineError(f"callback: must be callable, got {type(callback).__name__}")
        prompt = prompt_ids if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        self.validate(prompt, params, images)
        prompt = [int(t) for t in prompt]
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        key_data = seed_key_data(seed)
        seq = _Seq(request_id=request_id, prompt=prompt, params=params, callback=callback,
                   stop_ids=frozenset(int(t) for t in stop), key_data=key_data, arrival=time.monotonic())
        if images is not None:
            seq.images = images
            seq.image_before = np.concatenate([[0], np.cumsum(np.asarray(prompt) == self._image_token)])
        self._inbox.put(("add", seq))
        self._wake.set()

    def validate(self, prompt: Sequence[int], params: SamplingParams, images: ImageInput | None = None) -> None:
        """Raise :class:`EngineError` for a request this engine cannot serve: every value that reaches the device
        is checked against its range here (:mod:`qjax.serving.requests`), its types too."""
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params: must be a SamplingParams, got {type(params).__name__}")
        params.check(self.config.max_logprobs, self.vocab_size)
        check_prompt(prompt, self.vocab_size)
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                              f"{len(prompt) + params.max_tokens} exceeds max_model_len {self.config.max_model_len}")
        if images is not None:
            if not isinstance(images, ImageInput):
                raise EngineError(f"images: must be an ImageInput (encode_images), got {type(images).__name__}")
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
            except Exception as e:
                # a failure no request could be blamed for (each request's own work and each device call are caught
                # inside step): fail every request loudly rather than hang their clients
                logger.exception("engine step failed; ending all requests")
                message = f"the engine failed ({_summary(e)}); every request in it was ended"
                for seq in list(self._seqs.values()):
                    self._emit(seq, [], [], "error", error=message)
                try:
                    self.pool = self._new_pool()
                except Exception:
                    logger.exception("the slot pool cannot be made again")

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
            used = sum(len(q.prompt) + len(q.output) for q in self._slots if q is not None)
            self.metrics.kv_cache(used / (self.config.max_num_seqs * self.config.max_model_len))
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
            acc.error = out.error

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
        return bucket(n, min(MIN_KV_BUCKET, cap), cap, KV_FACTOR)

    def _decode_rows(self, n: int) -> int:
        """The rows a decode call runs for running sequences in the first ``n`` slots (a bucket)."""
        b = self.config.max_num_seqs
        return min(self._round_rows(bucket(n, 1, b, ROW_FACTOR)), b)

    def _prefill(self) -> None:
        todo = sorted(self._prefilling(), key=lambda s: s.arrival)
        suspect = next((s for s in todo if s.suspect), None)
        if suspect is not None:
            todo = [suspect]  # it runs alone until a call of its passes (_call_failed)
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[_Seq, int]] = []
        for seq in todo:
            if budget <= 0:
                break
            n = min(len(seq.fill) - seq.cursor, budget)
            picked.append((seq, n))
            budget -= n
        if not picked:
            return
        t = self._chunk_bucket(max(n for _, n in picked))
        most = self._prefill_rows(t)
        chunks = []
        for seq, n in picked[:most]:  # the rest wait for the next step
            try:  # each row's host values, per sequence: one that cannot be made fails alone
                chunks.append(self._prefill_chunk(seq, n))
            except Exception as e:
                self._fail(seq, "prefill", e)
        if not chunks:
            return
        p = self._round_rows(bucket(len(chunks), 1, most, ROW_FACTOR))
        rows = np.full(p, self.config.max_num_seqs, np.int32)
        ids = np.zeros((p, t), np.int32)
        targets = np.zeros((p, t), np.int32)
        n_arr = np.zeros(p, np.int32)
        reset = np.zeros(p, bool)
        final = np.zeros(p, bool)
        key_data = np.zeros((p, 2), np.uint32)
        do_sample, temperature, top_k, top_p = np.zeros(p, bool), np.ones(p), np.zeros(p, np.int64), np.ones(p)
        for i, c in enumerate(chunks):
            rows[i], n_arr[i], reset[i], final[i], key_data[i] = c.seq.slot, c.n, c.reset, c.final, c.key
            ids[i, :c.n] = c.ids
            targets[i, :len(c.targets)] = c.targets
            do_sample[i], temperature[i], top_k[i], top_p[i] = c.sampling
        end = max(c.seq.cursor + c.n for c in chunks)
        want_prompt = any(c.prompt_lp for c in chunks)
        seqs = [c.seq for c in chunks]
        try:
            extra = {}
            if any(seq.images is not None for seq in seqs):
                position_ids, image_embeds = self._image_arrays(chunks, ids.shape)
                extra = dict(position_ids=position_ids, image_embeds=image_embeds)
            pool, tok, lp, prompt = self._programs.prefill(
                self.pool, rows, ids, n_arr, reset, final, key_data,
                SamplingArrays.make(do_sample, temperature, top_k, top_p), targets, np.bool_(want_prompt),
                kv_len=self._kv_bucket(end),
                top_k=self.config.max_logprobs, **extra)
            tok, lp = np.asarray(tok), jax.tree.map(np.asarray, lp)  # a failure on the device shows here at last
            prompt = jax.tree.map(np.asarray, prompt) if want_prompt else None
        except Exception as e:
            self._call_failed("prefill", seqs, e)
            return
        self.pool = pool
        now = time.monotonic()
        for i, c in enumerate(chunks):
            try:
                self._prefilled(c, tok[i], [x[i] for x in lp], None if prompt is None else [x[i] for x in prompt], now)
            except Exception as e:
                self._fail(c.seq, "prefill", e)

    def _prefill_chunk(self, seq: _Seq, n: int) -> _Chunk:
        c, sp = seq.cursor, seq.params
        greedy = bool(sp.greedy)
        k = int(sp.top_k)
        key = seq.key_data if seq.fill_key is None else seq.fill_key
        return _Chunk(seq, n, np.asarray(seq.fill[c:c + n], np.int32), np.asarray(seq.fill[c + 1:c + n + 1], np.int32),
                      np.asarray(key, np.uint32).reshape(2),
                      # top-k past the vocabulary means every token (vLLM): off, before it meets an int32
                      (not greedy, 1.0 if greedy else float(sp.temperature), k if 0 < k < self.vocab_size else 0,
                       float(sp.top_p)),
                      c == 0, c + n == len(seq.fill),
                      # prompt log-probabilities go out once, with the first output: a replay after it makes none
                      sp.prompt_logprobs is not None and not seq.output, sp.logprobs is not None)

    def _prefilled(self, c: _Chunk, tok, lp: list, prompt: list | None, now: float) -> None:
        """One sequence's part of a prefill call's results: ``tok`` its drawn token, ``lp`` its row of the token's
        log-probabilities, ``prompt`` its rows of the prompt's (or None)."""
        seq, n = c.seq, c.n
        if c.prompt_lp:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            k = seq.params.prompt_logprobs
            last = n - (1 if c.final else 0)  # the chunk's last position predicts the next chunk's first token
            seq.prompt_logprobs += [_logprob(c.targets[j], prompt[0][j], prompt[1][j], prompt[2][j], k)
                                    for j in range(last)]
        seq.cursor += n
        new = min(seq.cursor, len(seq.prompt)) - seq.counted  # a replay's prompt tokens were counted before
        if new > 0:
            self.metrics.prompt_tokens(new)
            seq.counted += new
        if seq.suspect == "prefill":
            seq.suspect = None  # it ran alone and passed
        if not c.final:
            return
        seq.state = DECODE
        if seq.expect is not None:  # a replay: the row must draw again the token it emitted last
            if int(tok) != seq.expect:
                logger.warning("request %s: its replay drew %d where it had emitted %d; it goes on from the emitted "
                               "tokens", seq.request_id, int(tok), seq.expect)
                self._rewind(seq, replay_last=False)
                return
            seq.expect, seq.draws = None, seq.fill_draws + 1
            return
        seq.draws = seq.fill_draws + 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.first_token(now - seq.arrival)
        if seq.params.max_tokens == 0:  # echo-only request: the prompt's log-probabilities, no output
            self._emit(seq, [], [], "length")
            return
        self._accept(seq, [int(tok)], [_logprob(tok, lp[0], lp[1], lp[2], seq.params.logprobs)])

    def _image_arrays(self, chunks: list[_Chunk], shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The image variant's extra inputs for a prefill call of ``shape`` ``(P, T)``: ``position_ids [3, P, T]``
        (an image request's rows sliced from its prompt's M-RoPE rows, a text request's ``cursor + arange``, 0 at
        padding) and ``image_embeds [P·T, H]``: the features of the call's image tokens in row-major order of the
        ids — each chunk's from the count of image tokens its earlier chunks consumed — then zero rows (one shape
        per prefill bucket, so one more compiled program per bucket at most). A text request's own image-token ids
        (a raw prompt may hold them) get that token's embedding, what the text program gives them; so do the tokens
        an image request replays past its prompt (module docstring, "Failures"), at text positions after its
        prompt's largest."""
        p, t = shape
        position_ids = np.zeros((3, p, t), np.int32)
        parts = []
        for i, ch in enumerate(chunks):
            seq, c, n = ch.seq, ch.seq.cursor, ch.n
            end = 0 if seq.images is None else len(seq.prompt)  # the image prompt's tokens, then text
            m = min(max(end - c, 0), n)
            if m:
                position_ids[:, i, :m] = seq.images.position_ids[:, c:c + m]
                parts.append(seq.images.embeds[int(seq.image_before[c]):int(seq.image_before[c + m])])
            if m == n:
                continue
            top = 0 if seq.images is None else int(seq.images.position_ids.max()) + 1
            position_ids[:, i, m:n] = top + np.arange(c + m - end, c + n - end, dtype=np.int32)
            k = self._image_token is not None and sum(1 for x in seq.fill[c + m:c + n] if x == self._image_token)
            if k:
                if self._placeholder_row is None:
                    row = self.model.embed(jnp.asarray([[self._image_token]], jnp.int32))
                    self._placeholder_row = np.asarray(row)[0]
                parts.append(np.repeat(self._placeholder_row, k, axis=0))
        dtype = next(ch.seq.images.embeds.dtype for ch in chunks if ch.seq.images is not None)
        image_embeds = np.zeros((p * t, self.model.config.hidden_size), dtype)
        used = sum(len(x) for x in parts)
        if used:
            image_embeds[:used] = np.concatenate(parts)
        return position_ids, image_embeds

    def _pack(self) -> bool:
        """Keep the decoding sequences in slots ``0 … n-1`` (the decode program reads a prefix of the pool's rows
        in place): move any decoding sequence above that range into the lowest slot in it that is free or held by a
        prefilling sequence (the two rows swap, states and all). False when a swap failed (_call_failed)."""
        decoding = [s for s in self._slots if s is not None and s.state == DECODE]
        n = len(decoding)
        for seq in sorted((s for s in decoding if s.slot >= n), key=lambda s: s.slot):
            hole = next(i for i in range(n) if self._slots[i] is None or self._slots[i].state != DECODE)
            other = self._slots[hole]
            try:
                self.pool = self._programs.swap(self.pool, seq.slot, hole)
            except Exception as e:
                self._call_failed("swap", [seq] + ([other] if other is not None else []), e)
                return False
            self._slots[hole], self._slots[seq.slot] = seq, other
            if other is not None:
                other.slot = seq.slot
            seq.slot = hole
        return True

    def _decode(self, max_steps: int) -> None:
        running = [s for s in self._slots if s is not None and s.state == DECODE]
        suspect = next((s for s in running if s.suspect), None)
        if suspect is not None:
            # it decodes alone, one token, until a call of its passes (_call_failed); its row stays where it is: the
            # call reads the rows up to it, the others masked out (they wait)
            running, max_steps = [suspect], 1
        # (seq, tokens it may still produce, its length, logprobs wanted), per sequence: a failure is its own
        plans = []
        for s in running:
            try:
                plans.append((s, s.params.max_tokens - len(s.output), len(s.prompt) + len(s.output),
                              s.params.logprobs is not None))
            except Exception as e:
                self._fail(s, "decode", e)
        if not plans or (suspect is None and not self._pack()):
            return
        running = [s for s, *_ in plans]
        b = self.config.max_num_seqs
        size = self._decode_rows(max(s.slot for s in running) + 1)
        active = np.zeros(size, bool)
        active[[s.slot for s in running]] = True  # rows past the running ones (free or prefilling) are masked out
        longest = max(n for _, _, n, _ in plans)
        # log-probabilities (a log-softmax and a top-k over the vocabulary per step) only when someone asks
        want = self.config.max_logprobs if any(w for *_, w in plans) else None
        if self.k:
            self._verify(running, size, active, longest, want)
            return
        # no row gets more tokens than it may still produce, so none writes past its cache row
        steps = max(1, min(max_steps, *(r for _, r, _, _ in plans)))
        try:
            pool, out = self._programs.decode(
                self.pool, active, np.int32(steps), rows=None if size >= b else size,
                kv_len=self._kv_bucket(longest + steps), max_steps=self.config.decode_steps, top_k=want)
            toks, lps, top_ids, top_lps = (np.asarray(x) for x in out)
        except Exception as e:
            self._call_failed("decode", running, e)
            return
        self.pool = pool
        for seq in running:
            try:
                i = seq.slot
                seq.draws += steps
                seq.suspect = None  # a suspect ran alone and passed
                lp = [_logprob(toks[j, i], lps[j, i], top_ids[j, i], top_lps[j, i], seq.params.logprobs)
                      for j in range(steps)]
                self._accept(seq, [int(t) for t in toks[:steps, i]], lp)
            except Exception as e:
                self._fail(seq, "decode", e)

    def _verify(self, running: list[_Seq], size: int, active: np.ndarray, longest: int, want: int | None) -> None:
        """One verify round (module docstring) for the running sequences, the first ``size`` rows; ``longest``: the
        longest of their lengths; ``want``: the top log-probabilities to make (None: none)."""
        b, k = self.config.max_num_seqs, self.k
        try:
            # a round writes k + 1 slots past a row's length and the head k − 1 more (EngineConfig.slots_per_row)
            pool, toks, consumed, lps = self._programs.verify(
                self.pool, active, rows=None if size >= b else size,
                kv_len=self._kv_bucket(longest + 2 * k), top_k=want)
            toks, consumed, (lps, top_ids, top_lps) = np.asarray(toks), np.asarray(consumed), map(np.asarray, lps)
        except Exception as e:
            self._call_failed("verify", running, e)
            return
        self.pool = pool
        self.speculation.rounds += 1
        for seq in running:
            try:
                i, n = seq.slot, int(consumed[seq.slot])
                seq.draws += 1  # a round splits the row's key once
                seq.suspect = None
                self.speculation.record(n)
                self.metrics.speculated(k, n - 1)
                lp = [_logprob(toks[i, j], lps[i, j], top_ids[i, j], top_lps[i, j], seq.params.logprobs)
                      for j in range(n)]
                self._accept(seq, [int(t) for t in toks[i, :n]], lp)
            except Exception as e:
                self._fail(seq, "verify", e)

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
              stop_reason: int | None = None, error: str | None = None) -> None:
        """Send the request its new output; with ``reason`` it is finished and its slot is free at once."""
        if reason is not None:
            if seq.slot >= 0 and self._slots[seq.slot] is seq:
                self._slots[seq.slot] = None
            if seq in self._waiting:
                self._waiting.remove(seq)
            self._seqs.pop(seq.request_id, None)
            self.metrics.finished(reason, time.monotonic() - seq.arrival)
        prompt_lp, seq.prompt_logprobs = seq.prompt_logprobs, None
        out = RequestOutput(seq.request_id, tokens, logprobs if seq.params.logprobs is not None else None,
                            None if error else prompt_lp, reason is not None, reason, stop_reason, error)
        try:
            seq.callback(out)
        except Exception:  # a consumer's failure is its own: the other requests keep running
            logger.exception("output callback of request %s failed; aborting it", seq.request_id)
            if reason is None:
                self.abort(seq.request_id)

    # -- failures (module docstring) ------------------------------------------------------------------------------
    def _fail(self, seq: _Seq, where: str, exc: BaseException) -> None:
        """End ``seq`` alone with an ``error`` output: its part of a ``where`` call failed."""
        logger.error("request %s: its %s failed; ending it", seq.request_id, where, exc_info=exc)
        if self._seqs.get(seq.request_id) is seq:
            self._emit(seq, [], [], "error", error=f"the engine could not run this request: its {where} failed "
                                                   f"({_summary(exc)})")

    def _call_failed(self, kind: str, seqs: list[_Seq], exc: BaseException) -> None:
        """A ``kind`` device call for ``seqs`` raised. A sequence that ran it alone, or that was in
        :data:`MAX_CALL_FAILURES` failed calls, is ended with an error; the others become suspects, each running its
        next calls alone until one passes. A call that took the pool (donated) leaves a new pool and every sequence in
        a slot rewound onto it."""
        logger.error("%s call for %d requests failed", kind, len(seqs), exc_info=exc)
        seqs = [s for s in seqs if self._seqs.get(s.request_id) is s]
        for s in seqs:
            s.failures += 1
            if len(seqs) == 1 or s.failures >= MAX_CALL_FAILURES:
                self._fail(s, f"{kind} call", exc)
            else:
                s.suspect = "prefill" if kind == "prefill" else "decode"
        if any(x.is_deleted() for x in jax.tree.leaves(self.pool)):
            self.pool = self._new_pool()
            for s in self._slots:
                if s is not None:
                    self._rewind(s)

    def _rewind(self, seq: _Seq, replay_last: bool = True) -> None:
        """Start ``seq``'s row over: prefill runs again over its prompt and the tokens it emitted, from its key as it
        was then, and emits none of them again. With ``replay_last`` (and the last token drawn as decoding draws it,
        or greedily) the last emitted token is drawn again and checked; else every emitted token is context and the
        next one is new."""
        seq.state, seq.cursor = PREFILL, 0
        if not seq.output:
            seq.fill, seq.fill_key, seq.fill_draws, seq.expect = seq.prompt, None, 0, None
            seq.prompt_logprobs = None  # not sent yet: made again
            return
        again = replay_last and (not self.k or seq.params.greedy)  # a verify round draws otherwise
        seq.fill_draws = seq.draws - 1 if again else seq.draws
        seq.fill = seq.prompt + (seq.output[:-1] if again else seq.output)
        seq.expect = seq.output[-1] if again else None
        seq.fill_key = kept_key_data(seq.key_data, seq.fill_draws)


def _summary(exc: BaseException) -> str:
    """``Type: the first line of the message`` (at most 200 characters): what a client is told of a failure."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def _logprob(token, lp, top_ids, top_lps, k: int | None) -> TokenLogprob | None:
    if k is None:
        return None
    return TokenLogprob(int(token), float(lp), tuple((int(i), float(v)) for i, v in zip(top_ids[:k], top_lps[:k])))
