"""Where AutoRound's blocks and calibration streams come from: a model in memory, or a checkpoint folder read one
decoder block at a time (``qjax quantize``), and whether the cached streams sit on the device or on the host.

The driver (:mod:`.driver`) asks a block source for what the per-block loop needs — the calibration embedding,
a batch's step context, decoder layer ``i``, the final norm and LM head when the head is quantized — and nothing
else, so one loop serves both:

* :class:`ModelBlocks`: a loaded model (the library API, ``AutoRound(model, …)``); its layers are cut out of the
  stacked groups once, as before.
* :class:`FolderBlocks`: a checkpoint folder through :class:`qjax.checkpoint.loading.ModelParts` — the loader's
  checks on open, then layer ``i`` read (lazy safetensors reads, the same value checks and casts) when the loop
  reaches it and dropped when its block is finished. The embedding is read on the host for the calibration embed
  and dropped; the final norm, the LM head, the MTP head and the vision tower are never read (the export copies
  them from the folder), except the norm and head under ``--quant_lm_head``.

The streams (float input, quantized input, float output; ``nsamples × seqlen × hidden`` each in the model dtype) are
device arrays when they fit the plan's budget (:mod:`.plan`), else host arrays moved one minibatch at a time: the
layer forwards slice them per batch, and the tuning step receives each chunk's minibatches gathered on the host
(:func:`gather_chunk`) in place of the whole stream — the same values, so the same result.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from qjax import xla_env
from qjax.checkpoint.loading import ModelParts

from . import blocks

DEVICE, HOST = "device", "host"  # where the cached streams live


class ModelBlocks:
    """The blocks of a model in memory."""

    streamed = False  # results stay in memory; the whole model is there to build the quantized one

    def __init__(self, model):
        if getattr(model, "quant", None) is not None:
            raise ValueError("AutoRound: the model is already quantized; start from the BF16/FP32 checkpoint")
        self.model = model
        self.config, self.dtype = model.config, model.dtype
        self.tied_head = model.lm_head is None
        self._layers = None

    @property
    def layers(self) -> list:
        if self._layers is None:
            self._layers = blocks.decoder_layers(self.model)
        return self._layers

    def layer(self, i: int):
        return self.layers[i]

    def release(self, i: int) -> None:
        pass  # the model holds its layers anyway

    def embed(self, ids: np.ndarray):
        return self.model.embed(jnp.asarray(ids))

    def step_context(self, ids):
        return self.model.step_context(ids, None, None, None)[0]

    def head(self):
        """(final norm, LM head) modules."""
        return self.model.norm, self.model.lm_head


class FolderBlocks:
    """The blocks of a checkpoint folder, read one at a time (see the module docstring). Close it with
    :meth:`close`."""

    streamed = True  # each finished block's results live in the progress folder, not in memory

    def __init__(self, folder: str, *, dtype=None, verify: bool = True):
        self.parts = ModelParts(folder, dtype=dtype, verify=verify)
        if self.parts.quant is not None:
            self.parts.close()
            raise ValueError(f"AutoRound: {folder} is already quantized; start from the BF16/FP32 checkpoint")
        self.folder = folder
        self.config, self.dtype = self.parts.config, self.parts.dtype
        self.generation_config = self.parts.generation_config
        self.tied_head = self.config.tie_word_embeddings
        self._held: dict[int, object] = {}

    @property
    def layers(self):
        raise AttributeError("a folder's blocks are read one at a time (layer(i)); there is no list of layers")

    def layer(self, i: int):
        if i not in self._held:
            self._held = {i: self.parts.layer(i)}  # the previous block is dropped before the next is read
        return self._held[i]

    def release(self, i: int) -> None:
        self._held.pop(i, None)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The calibration embedding on the host (the embedding table itself is dropped on return)."""
        return np.take(self.parts.embedding(), np.asarray(ids), axis=0)

    def step_context(self, ids):
        return self.parts.model.step_context(ids, None, None, None)[0]  # config and dtype only: no weights

    def head(self):
        return self.parts.module("norm"), self.parts.module("lm_head")

    def layer_bytes(self, i: int) -> int:
        """Bytes of decoder layer ``i``'s weights in the model dtype (from the headers)."""
        n = 0
        for k in self.parts.layer_keys(i):
            itemsize = np.dtype(self.dtype).itemsize if self.parts.view.dtype(k) in ("BF16", "F16", "F32", "F64") \
                else 1
            n += int(np.prod(self.parts.view.shape(k))) * itemsize
        return n

    def close(self) -> None:
        self._held.clear()
        self.parts.close()


def blocks_of(model):
    """The block source of ``model``: itself when it is one (:class:`FolderBlocks`), else :class:`ModelBlocks`."""
    return model if isinstance(model, (ModelBlocks, FolderBlocks)) else ModelBlocks(model)


def place(h, where: str):
    """A whole stream where the plan keeps it: a device array, or a host (numpy) array."""
    return jnp.asarray(h) if where == DEVICE else np.asarray(h)


def is_host(h) -> bool:
    return isinstance(h, np.ndarray)


def map_batches(fn, h, batch_size: int):
    """``fn`` over ``h [n, …]`` ``batch_size`` samples at a time, the outputs joined where ``h`` lives: on the device
    as one concatenation (as the whole-model run always did), on the host into one preallocated array (each batch
    moved to the device and back)."""
    if not is_host(h):
        return jnp.concatenate([fn(h[i:i + batch_size]) for i in range(0, h.shape[0], batch_size)])
    out = None
    for i in range(0, h.shape[0], batch_size):
        y = np.asarray(fn(jnp.asarray(h[i:i + batch_size])))
        if out is None:
            out = np.empty((h.shape[0], *y.shape[1:]), y.dtype)
        out[i:i + y.shape[0]] = y
    return out


def gather_chunk(idx: np.ndarray, streams: tuple, sharding=None) -> tuple[jnp.ndarray, tuple]:
    """A chunk's minibatches ``idx [k, B]`` of host ``streams`` gathered on the host and sent to the device:
    (indices into the gathered chunk ``[k, B]``, the chunk of each stream ``[k·B, …]``). The tuning step indexes the
    chunk as it would index the whole stream, so it computes on the same values."""
    idx = np.asarray(idx)
    local = np.arange(idx.size, dtype=np.int32).reshape(idx.shape)
    flat = idx.reshape(-1)
    chunks = tuple(jax.device_put(np.take(s, flat, axis=0), sharding) for s in streams)
    return jnp.asarray(local), chunks


def trim_host_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). XLA:CPU's
    buffers below glibc's mmap threshold (which rises to 32 MiB as large buffers are freed) and the loader's reads
    come from the heap, and glibc keeps what they free for reuse: without this the resident size grows by what one
    block's programs freed, and the next tuning step's own buffers come on top of it."""
    trim = xla_env.malloc_trim()
    if trim is not None:
        trim(0)


# what jax records when XLA has compiled a program (jax._src.dispatch.BACKEND_COMPILE_EVENT), before it first runs
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def trim_after_compiles(min_seconds: float = 0.5):
    """Inside the ``with``, :func:`trim_host_memory` after each XLA compile of ``min_seconds`` or more: a tuning step is
    compiled and run in one call, and what the compiler freed (~0.5 GiB for a 256-expert step) would otherwise sit
    under the step's own buffers at the block's peak. Short compiles leave little and are many: not trimmed."""
    def listener(event: str, seconds: float, **_):
        if event == BACKEND_COMPILE_EVENT and seconds >= min_seconds:
            trim_host_memory()

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
