"""Hugging Face checkpoint folder → qjax model. The only module that knows checkpoint key names and layouts.

Accepted layouts (docs/model.md §6): text weights under ``model.language_model.`` (official composite checkpoints) or
``model.`` (text-only); routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``,
no ``.weight``) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), chosen per layer; ``mtp.*`` loads
into the MTP head when present; ``model.visual.*`` into the vision tower, in its stored dtype (``text_only=True``
skips it).

Tensors stream one at a time from memory-mapped files straight into pre-allocated device buffers (a donated
in-place update per tensor), so the checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections import Counter
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from qjax.checkpoint.auto_round import open_autoround
from qjax.checkpoint.dense_mtp import dense_mtp_view
from qjax.checkpoint.layout import (
    FLOAT,
    TEXT_PREFIXES,
    VISUAL_PREFIX,
    LoadError,
    Target,
    expected_tensors,
    expert_layouts,
    mtp_layers,
    per_expert_layout,
    text_prefix,
)
from qjax.checkpoint.quant_plan import plan_quantization
from qjax.checkpoint.safetensors_io import list_checkpoint_files
from qjax.checkpoint.view import Checkpoint, CheckpointView
from qjax.kernels import dequantize
from qjax.model.config import GenerationConfig, TextConfig, VisionConfig
from qjax.multimodal.images import ImageProcessorConfig
from qjax.model.dtypes import model_dtype
from qjax.model.quant_spec import ModelQuant
from qjax.model.qwen3_5_moe import Qwen3_5MoeForCausalLM, abstract_model
from qjax.model.memory import available
from qjax.model.sharding import per_device_bytes, plan_mesh, set_plan, state_shardings
from qjax.model.variables import variable_shapes
from qjax.quant.config import QuantizationConfig
from qjax.quant.packing import e8m0_max_byte, unpack_zero_point

__all__ = ["FLOAT", "TEXT_PREFIXES", "VISUAL_PREFIX", "Checkpoint", "LoadError", "Target", "check_folder",
           "check_memory", "checkpoint_dtype", "load_from_view", "load_model", "module_weight", "verify_folder",
           "verify_values", "with_fp8_kv_cache"]

logger = logging.getLogger("qjax")

_FLOAT_DTYPES = {"F32": jnp.float32, "BF16": jnp.bfloat16, "F16": jnp.float16, "F64": jnp.float32}


# ---------------------------------------------------------------------------------------------------------------------
# device writes
# ---------------------------------------------------------------------------------------------------------------------
# Variables (per-device shards) assembled on the host and sent whole, up to this many bytes at a time. Writing a
# tensor into its variable on the device is a compiled program per (variable shape, tensor shape) and a zeros
# program per variable shape — ~30 ms each to trace and compile, paid again by every process that loads a model
# (measured over the test suite: ~1,700 write programs, 44 s, and as many zeros); a variable that does not fit in
# what is left of the budget is written on the device, so loading a large model holds at most this much on the
# host besides the tensor being read.
HOST_STAGING_BYTES = 256 << 20


@functools.partial(jax.jit, donate_argnums=0)
def _write(buf: jnp.ndarray, value: jnp.ndarray, start: jnp.ndarray) -> jnp.ndarray:
    value = value.reshape((1,) * (buf.ndim - value.ndim) + value.shape)
    return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype), tuple(start[i] for i in range(buf.ndim)))


def _host_cast(arr: np.ndarray, dtype) -> np.ndarray:
    """Float tensors take the model's dtype; packed integers, float8 values and E8M0 bytes are kept bit for bit."""
    dtype = np.dtype(dtype)
    if arr.dtype == dtype:
        return arr
    if arr.dtype.kind in "iub" or dtype.kind in "iub" or "float8" in arr.dtype.name or "float8" in dtype.name:
        if arr.dtype.itemsize != dtype.itemsize:
            raise AssertionError(f"refusing to convert {arr.dtype} to {dtype}")
        return arr.view(dtype)
    return arr.astype(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------------------------------
def _default_dtype(ckpt: Checkpoint, cfg: TextConfig, prefix: str):
    key = prefix + "embed_tokens.weight"
    return checkpoint_dtype(ckpt.dtype(key) if key in ckpt.keys() else None, cfg)


def checkpoint_dtype(embed_dtype: str | None, cfg: TextConfig):
    """The model dtype a checkpoint implies: its embedding's float dtype, else config.json's ``dtype``."""
    if embed_dtype in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[embed_dtype]
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(str(cfg.dtype), jnp.float32)


def load_model(path: str | os.PathLike, *, dtype=None, progress: bool | None = None,
               mesh=None, verify: bool = True, text_only: bool = False) -> Qwen3_5MoeForCausalLM:
    """Load a HF ``qwen3_5_moe`` / ``qwen3_5_moe_text`` checkpoint folder (dense, compressed-tensors, or auto-round
    ``quant_method: "auto-round"`` INT packing, converted to compressed-tensors' layout at load).

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` or sharded files + ``model.safetensors.index.json``.
      dtype: parameter/activation dtype, one of :data:`qjax.model.dtypes.MODEL_DTYPES` (a name or a dtype:
        ``"float64"``, ``jnp.bfloat16``); default: the checkpoint's float dtype. ``A_log`` and ``dt_bias`` stay in
        the accumulation dtype (float32; float64 for float64). float64 switches JAX's x64 mode on and computes every
        step in float64; packed weights dequantize to the values compressed-tensors' decompression gives, exact in
        float64.
      progress: a tqdm bar over the tensors on stderr; None = only for checkpoints over 256 MiB when stderr is a
        terminal.
      mesh: run on several devices: a dict of axis sizes (``{"data": 1, "tensor": 2, "expert": 4}``; missing axes
        are 1), a ``"tensor=2,expert=4"`` string, or a :class:`jax.sharding.Mesh` with axes among
        (data, tensor, expert). Each tensor goes straight to the devices that hold a part of it
        (:mod:`qjax.model.sharding` has the layout). None: one device.
      verify: check every tensor's values as it streams in (:func:`verify_values`: no NaN or infinity in float
        tensors, no NaN code in float8 weights or E8M0 scales, no zero weight scale, K/V scales positive); one
        more read of each tensor in host memory (benchmarks/RESULTS.md has the cost). False skips it.
      text_only: do not load the vision tower (``model.visual.*``; vLLM's ``--limit-mm-per-prompt '{"image": 0}'``):
        its memory is not used and image input is refused. Otherwise the tower loads when the folder has it, in its
        stored dtype unless ``dtype`` is given (then in ``dtype`` like the rest).
    Raises:
      ConfigError, SafetensorsError, LoadError — each naming the file and the tensor or field at fault;
      qjax.model.sharding.MeshError when the mesh does not divide the model's heads or experts.
    """
    path = os.fspath(path)
    if dtype is not None:
        dtype = model_dtype(dtype, "load_model(dtype=…)")  # before anything is traced: float64 switches x64 on
    cfg = TextConfig.from_file(path)
    vision = VisionConfig.from_file(path)
    plan = None
    if mesh is not None:

        plan = plan_mesh(mesh, cfg)
    # checked before minutes of loading, not after; its token ids against this model's vocabulary
    generation_config = GenerationConfig.from_folder(path, vocab_size=cfg.vocab_size)
    ckpt = Checkpoint(path)
    try:
        qc, view = quantization_view(path, ckpt)
        model = load_from_view(cfg, qc, view, dtype, progress=progress, plan=plan, verify=verify, vision=vision,
                               text_only=text_only)
    finally:
        ckpt.close()
    model.generation_config = generation_config
    if vision is not None:
        model.image_processor = ImageProcessorConfig.from_folder(
            path, patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size)
    return model


def quantization_view(path: str, ckpt: Checkpoint):
    """(quantization config or None, the checkpoint view to read): auto-round folders (quant_method "auto-round",
    GPTQ/AWQ packing) are read through a compressed-tensors view."""
    autoround = open_autoround(path, ckpt)
    if autoround is not None:
        return autoround
    return QuantizationConfig.from_config_json(path), ckpt


def check_folder(path: str | os.PathLike, *, dtype=None) -> tuple[TextConfig, QuantizationConfig | None,
                                                               dict[str, tuple[tuple[int, ...], str]]]:
    """Every check :func:`load_model` makes before it reads tensor data — config.json and generation_config.json
    fields, files confined to the folder, strict safetensors headers, no tensor stored twice, the quantization
    config, every tensor's name, shape and dtype against the model — without reading the data (so not the values
    :func:`verify_values` checks). Returns (config, quantization config, headers as the loader sees them: key →
    (shape, safetensors dtype)); raises what load_model raises."""
    return _check_folder(path, values=False, dtype=dtype)


def verify_folder(path: str | os.PathLike, *, dtype=None) -> tuple[TextConfig, QuantizationConfig | None,
                                                                dict[str, tuple[tuple[int, ...], str]]]:
    """:func:`check_folder`, and the values of every tensor the model reads (:func:`verify_values`, for a model in
    ``dtype``: default the checkpoint's, as :func:`load_model` picks it)."""
    return _check_folder(path, values=True, dtype=dtype)


def _check_folder(path, *, values: bool, dtype=None):
    path = os.fspath(path)
    cfg = TextConfig.from_file(path)
    vision = VisionConfig.from_file(path)
    GenerationConfig.from_folder(path, vocab_size=cfg.vocab_size)
    ckpt = Checkpoint(path)
    try:
        qc, view = quantization_view(path, ckpt)
        model, _, targets, _, view = _structure(cfg, qc, view, None, vision)
        # the dtype the values must suit (E8M0 scales): the one asked for, else the one load_model would pick
        dtype = model.dtype if dtype is None else model_dtype(dtype, "dtype", switch_x64=False)
        for key in _ordered(view, targets):
            if values:
                verify_values(view, key, view.get(key), dtype=dtype)
            elif targets[key].transform == "weight_shape":  # two integers: as cheap as a header
                _transform(view, key, targets[key], view.get(key))
        return cfg, qc, {k: (tuple(view.shape(k)), view.dtype(k)) for k in view.keys()}
    finally:
        ckpt.close()


def _structure(cfg: TextConfig, qc, ckpt: Checkpoint, dtype, vision: VisionConfig | None = None,
               text_only: bool = False, vision_dtype=None):
    """The abstract model a checkpoint describes, its variables and every tensor's target, checked against the
    checkpoint's names, shapes and dtypes: (model, leaves, targets, skipped keys, the view to read — ``ckpt``, or
    a view of it that decodes a quantized MTP head to the dense one the model holds). The vision tower is part of
    the model when ``vision`` is given, the checkpoint has ``model.visual.*`` tensors and not ``text_only``."""
    source = os.path.join(ckpt.folder, "config.json")
    visual = [k for k in ckpt.keys() if k.startswith(VISUAL_PREFIX)]
    with_visual = bool(visual) and vision is not None and not text_only
    packed = [k for k in visual if not k.endswith((".weight", ".bias"))]
    if with_visual and packed:  # before the quantization plan, which would name only a config mismatch
        raise LoadError(f"{ckpt.folder}: the vision tower is stored quantized ({packed[0]} [{ckpt.file_of(packed[0])}]"
                        f", {len(packed)} such tensors); qjax runs it in its float dtype as the seed checkpoints "
                        f"keep it — load with text_only=True to skip it")
    ckpt = dense_mtp_view(cfg, qc, ckpt, check=verify_values, source=source)
    keys = ckpt.keys()
    prefix = text_prefix(keys)
    skipped = [] if with_visual else visual
    with_mtp = any(k.startswith("mtp.") for k in keys)
    explicit_dtype = dtype is not None
    dtype = jnp.dtype(dtype) if dtype is not None else _default_dtype(ckpt, cfg, prefix)
    if vision_dtype is not None:
        vision_dtype = jnp.dtype(vision_dtype)
    elif explicit_dtype or not with_visual:
        vision_dtype = dtype
    else:
        first = VISUAL_PREFIX + "patch_embed.proj.weight"
        vision_dtype = _FLOAT_DTYPES.get(ckpt.dtype(first) if first in keys else None, dtype)
    quant = plan_quantization(cfg, qc, set(keys) - set(skipped), ckpt.dtype, text_prefix=prefix, source=source)
    model = abstract_model(cfg, dtype=dtype, with_mtp=with_mtp, quant=quant, vision=vision,
                           vision_dtype=vision_dtype, with_visual=with_visual)
    leaves = variable_shapes(model)
    targets = expected_tensors(model, leaves, fused_experts=expert_layouts(keys), text_prefix=prefix)
    _check(ckpt, targets, set(skipped))
    return model, leaves, targets, skipped, ckpt


def load_from_view(cfg: TextConfig, qc, ckpt: CheckpointView, dtype, *, progress: bool | None = False,
                   plan=None, verify: bool = False, vision: VisionConfig | None = None,
                   text_only: bool = False, vision_dtype=None) -> Qwen3_5MoeForCausalLM:
    """The model of ``cfg`` (quantized as ``qc`` says) with every tensor of ``ckpt`` in its variables; with the
    vision tower of ``vision`` when ``ckpt`` holds it and not ``text_only`` (:func:`load_model`), in
    ``vision_dtype`` (default: its stored dtype, or ``dtype`` when that is given)."""
    model, leaves, targets, skipped, ckpt = _structure(cfg, qc, ckpt, dtype, vision, text_only, vision_dtype)
    if skipped:
        logger.warning("%s: skipping %d vision tensors (model.visual.*): %s", ckpt.folder, len(skipped),
                       "loaded text-only" if vision is not None else "config.json has no vision_config")
    check_memory(ckpt.folder, model, leaves, plan)

    shardings = None
    if plan is not None:

        set_plan(model, plan)
        shardings = state_shardings(model, plan)
    return _fill(model, leaves, targets, ckpt, shardings=shardings, keys=_progress(_ordered(ckpt, targets), ckpt,
                                                                                 targets, progress),
                 verify=verify, dtype=model.dtype)


def _fill(module, leaves: dict, targets: dict[str, Target], ckpt: CheckpointView, *, shardings=None, keys=None,
          verify: bool, dtype):
    """``module`` (abstract, with ``leaves``) with every tensor of ``targets`` read from ``ckpt`` into its variables:
    the whole model (:func:`load_from_view`) or one part of it (:class:`ModelParts`). ``dtype``: the model's, for
    :func:`verify_values`."""
    placer = _Placer(leaves, shardings, Counter(t.path for t in targets.values() if t.path is not None))
    for key in (_ordered(ckpt, targets) if keys is None else keys):
        t = targets[key]
        arr = ckpt.get(key)  # once: a converting view (auto-round) hands each tensor out once
        if verify:
            verify_values(ckpt, key, arr, dtype=dtype)
        arr = _transform(ckpt, key, t, arr)
        if t.path is not None:
            placer.put(t, _host_cast(arr, leaves[t.path].dtype))

    graphdef, state = nnx.split(module)
    flat = nnx.to_flat_state(state)
    for p, v in flat:
        value = placer.array(tuple(p))
        v.set_value(value) if hasattr(v, "set_value") else setattr(v, "value", value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class ModelParts:
    """A checkpoint folder read one part at a time, for a run that never holds the whole model (``qjax quantize``
    streams the decoder one block at a time: :mod:`qjax.autoround.stream`).

    Opening it makes every check :func:`load_model` makes before reading data (config.json and
    generation_config.json fields, strict headers, every tensor's name, shape and dtype against the model); each
    part is then read alone through the loader's own path — lazy safetensors reads, :func:`verify_values` (when
    ``verify``), the same casts into the same variables — so decoder layer ``i`` is layer ``i`` of
    :func:`load_model`'s model, bit for bit. Text only: the vision tower is never read. Close it with :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike, *, dtype=None, verify: bool = True):
        path = os.fspath(path)
        if dtype is not None:
            dtype = model_dtype(dtype, "ModelParts(dtype=…)")
        self.folder = path
        self.config = TextConfig.from_file(path)
        vision = VisionConfig.from_file(path)
        self.generation_config = GenerationConfig.from_folder(path, vocab_size=self.config.vocab_size)
        self.verify = verify
        self._ckpt = Checkpoint(path)
        try:
            qc, view = quantization_view(path, self._ckpt)
            self.model, _, self.targets, _, self.view = _structure(self.config, qc, view, dtype, vision, text_only=True)
        except BaseException:
            self._ckpt.close()
            raise
        self.dtype = self.model.dtype
        self.prefix = text_prefix(self.view.keys())

    @property
    def quant(self):
        """The checkpoint's quantization (a :class:`ModelQuant`), None when dense."""
        return self.model.quant

    def layer_keys(self, i: int) -> list[str]:
        """The stored tensors of decoder layer ``i``, in on-disk order."""
        stem = f"{self.prefix}layers.{i}."
        return [k for k in self.view.keys() if k.startswith(stem) and k in self.targets]

    def layer(self, i: int):
        """Decoder layer ``i`` as its own module (what :func:`qjax.autoround.blocks.decoder_layers` cuts out of a
        loaded model), its weights read now onto the default device."""
        period = len(self.model.layer_kinds)
        g, slot = divmod(i, period)
        graphdef, state = nnx.split(self.model.groups)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
        layer = nnx.merge(graphdef, one).layers[slot]
        # the layer's targets, the group axis dropped from their variable path ('groups', 'layers', slot, …) and offset
        targets = {}
        for k in self.layer_keys(i):
            t = self.targets[k]
            targets[k] = t if t.path is None else dataclasses.replace(t, path=t.path[3:], start=t.start[1:])
        return self._fill(layer, targets)

    def module(self, name: str):
        """A top-level part of the text model (``"norm"``, ``"lm_head"``), read now onto the default device."""
        sub = getattr(self.model, name)
        if sub is None:
            raise ValueError(f"{self.folder}: the model has no {name}")
        targets = {k: dataclasses.replace(t, path=t.path[1:]) for k, t in self.targets.items()
                   if t.path is not None and t.path[0] == name}
        return self._fill(sub, targets)

    def embedding(self) -> np.ndarray:
        """The token embedding ``[vocab, hidden]`` on the host, in the model dtype (memory-mapped when the stored
        dtype is the model's: only the rows taken are read)."""
        key = self.prefix + "embed_tokens.weight"
        arr = self.view.get(key)
        if self.verify:
            verify_values(self.view, key, arr, dtype=self.dtype)
            self._ckpt.drop_pages()  # the check read every page; the embed reads the rows it takes again
        return _host_cast(arr, self.dtype)

    def _fill(self, module, targets: dict[str, Target]):
        leaves = variable_shapes(module)
        check_memory(self.folder, module, leaves)
        try:
            return _fill(module, leaves, targets, self.view, verify=self.verify, dtype=self.dtype)
        finally:
            self._ckpt.drop_pages()  # the part is on the device now: its file pages leave this process's RSS

    def close(self) -> None:
        self._ckpt.close()


def deferred_model(cfg: TextConfig, qc, ckpt: CheckpointView, dtype):
    """The model of ``cfg`` (quantized as ``qc`` says) whose variables read their tensors from ``ckpt`` only when a
    writer takes them: what :func:`qjax.checkpoint.layout.checkpoint_tensors` — so every writer — writes as it writes
    a loaded model, holding one tensor at a time instead of the model (``qjax quantize``'s streamed export,
    :mod:`qjax.autoround.export`). Checked as :func:`load_from_view` checks (names, shapes, dtypes); each tensor
    goes through the loader's transforms and casts, so the written folder is the one a loaded model would give.
    Text only; not a model to run (its variables hold readers, not arrays)."""
    model, leaves, targets, _, ckpt = _structure(cfg, qc, ckpt, dtype, None, text_only=True)
    regions: dict[tuple, list[tuple[str, Target]]] = {}
    for key, t in targets.items():
        if t.path is not None:
            regions.setdefault(t.path, []).append((key, t))
    last: dict = {}  # the last tensor read: a writer asks for the experts of one fused tensor one after another
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    for p, v in flat:
        p = tuple(p)
        value = _Deferred(ckpt, leaves[p], regions.get(p, []), last)
        v.set_value(value) if hasattr(v, "set_value") else setattr(v, "value", value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class _Deferred:
    """A variable of :func:`deferred_model`: ``shape``/``dtype``/``ndim`` of the model's variable; indexing it with
    a target's region (:meth:`Target.index`) reads the stored tensor that covers that region."""

    def __init__(self, ckpt: CheckpointView, leaf, regions: list[tuple[str, Target]], last: dict):
        self.ckpt, self.shape, self.dtype = ckpt, tuple(leaf.shape), np.dtype(leaf.dtype)
        self.ndim = len(self.shape)
        self.last = last
        # each stored tensor's region of the variable: a writer usually asks for exactly one (a dict lookup; a
        # layer's stacked experts have thousands), else for a part of one (the experts of a fused tensor)
        self.regions = [(key, t, tuple(_bounds(t.index(self.ndim), self.shape))) for key, t in regions]
        self.exact = {have: (key, t, have) for key, t, have in self.regions}

    def __getitem__(self, index) -> np.ndarray:
        want = tuple(_bounds(index, self.shape))
        found = [self.exact[want]] if want in self.exact else self.regions
        for key, t, have in found:
            if all(h0 <= w0 and w1 <= h1 for (w0, w1), (h0, h1) in zip(want, have)):
                if self.last.get("key") != key:
                    self.last.clear()
                    arr = _transform(self.ckpt, key, t, self.ckpt.get(key))
                    self.last.update(key=key, arr=_host_cast(np.asarray(arr), self.dtype).reshape(
                        [h1 - h0 for h0, h1 in have]))
                arr = self.last["arr"]
                inner = tuple(slice(w0 - h0, w1 - h0) for (w0, w1), (h0, _) in zip(want, have))
                drop = tuple(0 if isinstance(i, int) else slice(None) for i in _full(index, self.ndim))
                return arr[inner][drop]
        raise AssertionError(f"{self.ckpt.folder}: no stored tensor holds {want} of a {list(self.shape)} variable")


def _full(index, ndim: int) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    return tuple(index) + (slice(None),) * (ndim - len(index))


def _bounds(index, shape: tuple) -> list[tuple[int, int]]:
    """``[(start, stop)]`` per dimension of a basic index (integers and unit-step slices) into ``shape``."""
    out = []
    for i, n in zip(_full(index, len(shape)), shape):
        out.append((i, i + 1) if isinstance(i, int) else i.indices(n)[:2])
    return out


def check_memory(folder: str, model, leaves: dict, plan=None) -> None:
    """Refuse, before a byte of tensor data is read, a load whose variables (what it materialises: the model's
    weights, sizes from the headers through the config) do not fit what the device can still allocate
    (:func:`qjax.model.memory.available`): a few-megabyte sparse file can declare terabytes of tensors. Per device
    on a mesh; CPU devices share the host's memory, so on CPU every device's part counts against it. The host
    staging buffer (:data:`HOST_STAGING_BYTES`) comes on top, and is not counted."""
    if plan is None:
        devices = [jax.local_devices()[0]]
        need = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves.values())
    else:
        devices = list(plan.mesh.devices.flat)
        need = per_device_bytes(model, plan)[0]
    device = devices[0]
    if device.platform == "cpu":
        need *= len(devices)
    have, what = available(device)
    if have is not None and need > have:
        per = f" per device ({len(devices)} devices)" if len(devices) > 1 and device.platform != "cpu" else ""
        raise LoadError(f"{folder}: loading needs {need / 2**30:,.2f} GiB ({need:,} bytes){per} for the weights "
                        f"its config.json and headers declare, but the {what} is {have / 2**30:,.2f} GiB "
                        f"({have:,} bytes); refused before reading (check the folder, or load it with a mesh or on a "
                        "larger device)")


class _Placer:
    """Per-device buffers of every variable, filled tensor by tensor.

    Without a mesh each variable is one buffer on the default device. On a mesh each device holds only its shard
    of each variable, and receives only the part of each checkpoint tensor that falls inside that shard (a
    replicated variable: the whole tensor on each device) — the full model never exists on one device, and the
    host holds one (memory-mapped) tensor at a time, plus the variables it assembles (:data:`HOST_STAGING_BYTES`),
    each sent to its device once its last tensor (of ``parts``: path → how many tensors fill it) is in.
    """

    def __init__(self, leaves: dict, shardings: dict | None, parts: dict):
        self.leaves, self.shardings = leaves, shardings
        self.buffers: dict[tuple, dict] = {}
        self._staged: dict[tuple, dict] = {}  # path → device → host buffer being filled
        self._staged_bytes = 0
        self._left = dict(parts)
        self._index_maps: dict[tuple, dict] = {}

    def _devices(self, path) -> dict:
        """device → tuple of slices of the variable that device holds (one entry, None, without a mesh)."""
        if self.shardings is None:
            return {None: tuple(slice(0, n) for n in self.leaves[path].shape)}
        if path not in self._index_maps:
            shape = tuple(self.leaves[path].shape)
            raw = self.shardings[path].addressable_devices_indices_map(shape)
            self._index_maps[path] = {d: tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(idx, shape))
                                      for d, idx in raw.items()}
        return self._index_maps[path]

    def put(self, t: Target, arr: np.ndarray) -> None:
        leaf = self.leaves[t.path]
        region = t.index(len(leaf.shape))
        starts = [r if isinstance(r, int) else r.start for r in region]
        sizes = [1 if isinstance(r, int) else r.stop - r.start for r in region]
        arr = np.asarray(arr).reshape(sizes)
        bufs = self.buffers.setdefault(t.path, {})
        for device, held in self._devices(t.path).items():
            lo = [max(a, h.start) for a, h in zip(starts, held)]
            hi = [min(a + n, h.stop) for a, n, h in zip(starts, sizes, held)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            part = arr[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, starts))]
            shard_shape = tuple(h.stop - h.start for h in held)
            if part.shape == shard_shape:
                bufs[device] = jax.device_put(part, device)  # device None: the default device
                continue
            host = self._host_buffer(t.path, device, shard_shape, leaf.dtype) if device not in bufs else None
            if host is not None:
                host[tuple(slice(l - h.start, u - h.start) for l, u, h in zip(lo, hi, held))] = part
                continue
            if device not in bufs:
                bufs[device] = jnp.zeros(shard_shape, leaf.dtype, device=device)
            offset = jnp.asarray([l - h.start for l, h in zip(lo, held)], jnp.int32)
            bufs[device] = _write(bufs[device], jax.device_put(part, device), offset)
        self._left[t.path] -= 1
        if not self._left[t.path]:
            self._send(t.path)

    def _host_buffer(self, path, device, shape: tuple, dtype) -> np.ndarray | None:
        """The host buffer of ``path``'s shard on ``device``: the one being filled, a new one (zeros) while the budget
        allows, else None (write on the device)."""
        host = self._staged.get(path, {}).get(device)
        if host is None:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if self._staged_bytes + nbytes > HOST_STAGING_BYTES:
                return None
            host = self._staged.setdefault(path, {})[device] = np.zeros(shape, dtype)
            self._staged_bytes += nbytes
        return host

    def _send(self, path: tuple) -> None:
        """``path``'s host-assembled shards to their devices."""
        for device, host in self._staged.pop(path, {}).items():
            self.buffers.setdefault(path, {})[device] = jax.device_put(host, device)
            self._staged_bytes -= host.nbytes

    def array(self, path: tuple) -> jax.Array:
        self._send(path)
        bufs = self.buffers[path]
        if self.shardings is None:
            return bufs[None]
        leaf = self.leaves[path]
        return jax.make_array_from_single_device_arrays(tuple(leaf.shape), self.shardings[path],
                                                        [bufs[d] for d in self._devices(path)])


def _progress(keys: Iterator[str], ckpt: Checkpoint, targets: dict, progress: bool | None) -> Iterator[str]:
    if progress is None:
        progress = sys.stderr.isatty() and _folder_bytes(ckpt.folder) > (256 << 20)
    if not progress:
        return keys

    n = sum(1 for k in ckpt.keys() if k in targets)
    return iter(tqdm(keys, total=n, desc=f"loading {os.path.basename(os.path.normpath(ckpt.folder))}", unit="tensor",
                     leave=False, file=sys.stderr))


def _folder_bytes(folder) -> int:
    """Bytes of the files the loader reads (the one listing, :func:`list_checkpoint_files`)."""
    try:
        return sum(os.path.getsize(os.path.join(folder, n)) for n in list_checkpoint_files(folder))
    except (OSError, TypeError, ValueError):  # in-memory checkpoints have no folder
        return 0


def _transform(ckpt: Checkpoint, key: str, t: Target, arr: np.ndarray) -> np.ndarray | None:
    """The on-disk tensor ``arr`` in the layout of its model variable (zero points unpacked, KV scales per head)."""
    if t.transform is None:
        return arr
    if t.transform == "zero_point":
        bits, rows = t.info
        return unpack_zero_point(np.asarray(arr), bits, rows).astype(np.int8)
    if t.transform == "kv_scale":
        (heads,) = t.info
        return np.broadcast_to(np.asarray(arr, np.float32).reshape(-1), (heads,)).copy()
    if t.transform == "weight_shape":
        if [int(v) for v in np.asarray(arr).reshape(-1)] != list(t.info):
            raise LoadError(f"{ckpt.folder}: {key} [{ckpt.file_of(key)}] says {np.asarray(arr).tolist()}, but the "
                            f"model needs {list(t.info)}")
        return None
    raise AssertionError(t.transform)


# (bits, mask, value): a float is infinite or NaN exactly when its bits & mask == value (the exponent all ones;
# float8 E4M3FN has no infinities and one NaN code per sign, S.1111.111). E8M0 scale bytes: 0xFF is NaN.
_NON_FINITE = {"F64": (np.uint64, 0x7FF0000000000000, 0x7FF0000000000000),
               "F32": (np.uint32, 0x7F800000, 0x7F800000), "F16": (np.uint16, 0x7C00, 0x7C00),
               "BF16": (np.uint16, 0x7F80, 0x7F80), "F8_E4M3": (np.uint8, 0x7F, 0x7F)}


_CHUNK = 1 << 18  # elements per piece of verify_values' pass


def verify_values(ckpt: Checkpoint, key: str, arr: np.ndarray, *, dtype=None) -> None:
    """Refuse a tensor whose values no producer writes and that would turn the model's output into NaN or garbage
    without an error: a NaN or infinity in a float tensor, the NaN code of a float8 weight, a NaN (0xFF) E8M0 scale
    byte or one whose scale overflows the weights it dequantizes for a model in ``dtype``
    (:func:`qjax.quant.packing.e8m0_max_byte`; None: bfloat16), a zero weight scale, or a K / V scale that is not
    positive. ``arr``: the tensor ``key`` as read from ``ckpt`` (which names its file); one pass over it (bit tests,
    no float copy)."""
    arr = np.asarray(arr)
    stored = ckpt.dtype(key)
    where = f"{ckpt.folder}: {key} [{ckpt.file_of(key)}]"
    if stored in _NON_FINITE:
        bits, mask, value = _NON_FINITE[stored]
        flat = arr.reshape(-1).view(bits)
        # in cache-sized pieces: one pass over the bytes, no tensor-sized temporaries
        if any(((flat[i:i + _CHUNK] & bits(mask)) == bits(value)).any() for i in range(0, flat.size, _CHUNK)):
            bad = (arr.view(bits) & bits(mask)) == bits(value)
            what = "NaN codes" if stored == "F8_E4M3" else "NaN or infinite values"
            raise LoadError(f"{where}: {int(bad.sum())} {what} (first at index {_first(bad)}); the file is damaged")
    if key.endswith(".weight_scale") and stored in ("U8", "F8_E8M0"):  # E8M0 exponents
        e = arr.view(np.uint8)
        bad = e == 0xFF
        if bad.any():
            raise LoadError(f"{where}: {int(bad.sum())} E8M0 scale bytes are 0xFF (NaN) (first at index "
                            f"{_first(bad)}); the file is damaged")
        top = e8m0_max_byte(dtype)
        bad = e > top
        if bad.any():
            i = _first(bad)
            raise LoadError(f"{where}: {int(bad.sum())} E8M0 scale bytes are over 0x{top:02X} (first at index {i}: "
                            f"0x{int(e[i]):02X}): 448·2^(e−127) overflows "
                            f"{np.dtype(jnp.bfloat16 if dtype is None else dtype).name} "
                            "and the weights dequantize to infinities; the file is damaged")
    elif key.endswith(".weight_scale") and stored in FLOAT:
        # auto-round's symmetric INT scales are signed (the sign follows the group's larger side); no producer
        # writes a zero scale (compressed-tensors and auto-round floor the magnitude): a zero zeroes its group
        bad = np.asarray(arr, np.float32) == 0
        if bad.any():
            raise LoadError(f"{where}: {int(bad.sum())} scales are zero (first at index {_first(bad)}); the file "
                            "is damaged")
    elif key.endswith((".k_scale", ".v_scale")):
        bad = ~(np.asarray(arr, np.float32) > 0)  # K and V are divided by them before the FP8 cast
        if bad.any():
            i = _first(bad)
            raise LoadError(f"{where}: {int(bad.sum())} K/V scales are zero or negative (first: {arr[i]} at index "
                            f"{i}); they must be positive")


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


def _ordered(ckpt: Checkpoint, targets: dict[str, Target]) -> Iterator[str]:
    """Keys file by file, in on-disk order, so reads walk each mmap sequentially."""
    return (k for k in ckpt.keys() if k in targets)


def _check(ckpt: Checkpoint, targets: dict[str, Target], skipped: set[str]) -> None:
    present = set(ckpt.keys())
    missing = sorted(set(targets) - present)
    unexpected = sorted(present - set(targets) - skipped)

    def shape_ok(k):
        t = targets[k]
        if t.transform == "kv_scale":
            return ckpt.shape(k) in ((1,), (t.info[0],))
        return ckpt.shape(k) == t.shape

    misshaped = [k for k in sorted(present & set(targets)) if not shape_ok(k)]
    wrong_kind = [k for k in sorted(present & set(targets)) if ckpt.dtype(k) not in targets[k].dtypes]
    if not (missing or unexpected or misshaped or wrong_kind):
        return
    lines = [f"checkpoint {ckpt.folder} does not match the model its config.json describes:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): " +
                     ", ".join(f"{k} [{ckpt.file_of(k)}]" for k in unexpected))
    for k in misshaped:
        want = list(targets[k].shape) if targets[k].transform != "kv_scale" else f"[1] or [{targets[k].info[0]}]"
        lines.append(f"  wrong shape: {k} [{ckpt.file_of(k)}] is {list(ckpt.shape(k))}, expected {want}")
    for k in wrong_kind:
        what = "a float tensor" if targets[k].dtypes == FLOAT else " or ".join(targets[k].dtypes)
        lines.append(f"  wrong dtype: {k} [{ckpt.file_of(k)}] is {ckpt.dtype(k)}, expected {what}"
                     + (" (quantized checkpoints need a quantization_config)" if targets[k].dtypes == FLOAT else ""))
    raise LoadError("\n".join(lines))


def module_weight(model, name: str, *, text_prefix: str = "model.") -> np.ndarray:
    """The float32 ``[out, in]`` weight of the linear module ``name`` (checkpoint naming, e.g.
    ``model.layers.3.mlp.experts.7.down_proj``): dense weights as stored, quantized ones dequantized.

    For research and tests (compare a module against another implementation); not used on the forward path.
    """

    leaves = variable_shapes(model)
    targets = expected_tensors(model, leaves,
                               fused_experts=per_expert_layout(model.config, prefix=text_prefix,
                                                               mtp_layers=mtp_layers(model)),
                               text_prefix=text_prefix)
    values = {tuple(p): (v.get_value() if hasattr(v, "get_value") else v.value)
              for p, v in nnx.to_flat_state(nnx.state(model))}
    if f"{name}.weight" in targets and targets[f"{name}.weight"].dtypes != ("F8_E4M3",):
        t = targets[f"{name}.weight"]
        arr = values[t.path]
        return np.asarray(arr[t.index(arr.ndim)], np.float32)
    key = f"{name}.weight_packed" if f"{name}.weight_packed" in targets else f"{name}.weight"
    if key not in targets:
        raise KeyError(f"no linear module named {name!r} in this model")
    t = targets[key]
    module = model
    for p in t.path[:-1]:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    meta = module.meta
    packed, scale, zero = module.arrays()
    lead = tuple(t.start[:-2])
    rows = slice(t.start[-2], t.start[-2] + t.shape[0])
    pick = lambda a: None if a is None else a[lead]
    p_, s_, z_ = pick(packed)[rows], pick(scale), pick(zero)
    if meta.strategy != "tensor":
        s_ = s_[rows]
        z_ = None if z_ is None else z_[rows]
    sub = dataclasses.replace(meta, out_features=t.shape[0])
    return np.asarray(dequantize(p_, s_, z_, sub, jnp.float32))


def with_fp8_kv_cache(model: Qwen3_5MoeForCausalLM) -> Qwen3_5MoeForCausalLM:
    """The same model with an FP8 (E4M3) K/V cache whose scales are 1.0 per kv head — what vLLM does for
    ``--kv-cache-dtype fp8`` on a checkpoint without static KV scales. A model that already has its checkpoint's
    scales is returned unchanged (they are kept)."""
    if model.kv_fp8:
        return model

    quant = model.quant if model.quant is not None else ModelQuant(layers=())
    new = abstract_model(model.config, dtype=model.dtype, with_mtp=model.mtp is not None,
                         quant=dataclasses.replace(quant, kv_cache="attn_head"))
    old = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model))}
    shardings = None
    if model.mesh_plan is not None:

        set_plan(new, model.mesh_plan)
        shardings = state_shardings(new, model.mesh_plan)
    graphdef, state = nnx.split(new)
    flat = nnx.to_flat_state(state)
    for p, v in flat:
        p = tuple(p)
        if p in old:
            value = old[p].get_value() if hasattr(old[p], "get_value") else old[p].value
        else:  # k_scale / v_scale: the unit scales
            value = jnp.ones(v.shape, v.dtype)
            if shardings is not None:
                value = jax.device_put(value, shardings[p])
        v.set_value(value) if hasattr(v, "set_value") else setattr(v, "value", value)
    out = nnx.merge(graphdef, nnx.from_flat_state(flat))
    out.generation_config = getattr(model, "generation_config", None)
    return out
