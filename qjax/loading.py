"""Hugging Face checkpoint folder → qjax model. The only module that knows checkpoint key names and layouts.

Accepted layouts (MODEL.md §6): text weights under ``model.language_model.`` (official composite checkpoints) or
``model.`` (text-only); routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``,
no ``.weight``) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), chosen per layer; ``mtp.*`` loads
into the MTP head when present; ``model.visual.*`` is skipped with one log line.

Tensors stream one at a time from memory-mapped files straight into pre-allocated device buffers (a donated
in-place update per tensor), so the checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import TextConfig
from .generate import GenerationConfig
from .model import Qwen3_5MoeForCausalLM, abstract_model
from .safetensors_io import SafetensorsFile, list_checkpoint_files

logger = logging.getLogger("qjax")

TEXT_PREFIXES = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.",)
_FLOAT_DTYPES = {"F32": jnp.float32, "BF16": jnp.bfloat16, "F16": jnp.float16, "F64": jnp.float32}


class LoadError(ValueError):
    """A checkpoint that does not match the model: lists every missing, unexpected and mis-shaped tensor."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a model variable, the offset inside it, and the shape it must have."""

    path: tuple  # nnx state path, e.g. ('groups', 'layers', 0, 'mlp', 'experts', 'gate_up_proj')
    start: tuple[int, ...]  # offset of the tensor inside the variable (leading dims it does not have are 1)
    shape: tuple[int, ...]  # the tensor's own shape on disk


# ---------------------------------------------------------------------------------------------------------------------
# key map
# ---------------------------------------------------------------------------------------------------------------------
def _leaf_shapes(model: nnx.Module) -> dict[tuple, jax.ShapeDtypeStruct]:
    return {tuple(p): v.get_value() if hasattr(v, "get_value") else v.value
            for p, v in nnx.to_flat_state(nnx.state(model))}


def expected_tensors(cfg: TextConfig, leaves: dict[tuple, jax.ShapeDtypeStruct], *, fused_experts: dict[str, bool],
                     text_prefix: str) -> dict[str, Target]:
    """Every checkpoint key the model needs, with its target.

    ``fused_experts`` maps a layer's key stem (``"{text_prefix}layers.3."`` or ``"mtp.layers.0."``) to whether that
    layer stores its experts fused; stems not in it default to fused.
    """
    period = len(cfg.layer_period)
    out: dict[str, Target] = {}
    for path, leaf in leaves.items():
        shape = tuple(leaf.shape)
        if path[0] == "groups":
            slot, rest = path[2], path[3:]
            for g in range(cfg.num_groups):
                stem = f"{text_prefix}layers.{g * period + slot}."
                _add_layer_keys(out, stem, rest, path, (g,), shape[1:], fused_experts.get(stem, True))
        elif path[0] == "mtp" and path[1] == "layers":
            stem = f"mtp.layers.{path[2]}."
            _add_layer_keys(out, stem, path[3:], path, (), shape, fused_experts.get(stem, True))
        elif path[0] == "mtp":
            out["mtp." + ".".join(map(str, path[1:]))] = Target(path, (0,) * len(shape), shape)
        elif path == ("embed_tokens",):
            out[text_prefix + "embed_tokens.weight"] = Target(path, (0, 0), shape)
        elif path[0] == "lm_head":
            out["lm_head.weight"] = Target(path, (0, 0), shape)
        else:
            out[text_prefix + ".".join(map(str, path))] = Target(path, (0,) * len(shape), shape)
    return out


def _add_layer_keys(out, stem, rest, path, lead, shape, fused):
    """Keys of one decoder-layer variable. ``lead`` is the stacked-group offset (``(g,)`` or ``()``)."""
    name = ".".join(map(str, rest))
    if rest[-2:] == ("experts", "gate_up_proj") and not fused:
        e, two_i, h = shape
        for x in range(e):
            out[f"{stem}mlp.experts.{x}.gate_proj.weight"] = Target(path, (*lead, x, 0, 0), (two_i // 2, h))
            out[f"{stem}mlp.experts.{x}.up_proj.weight"] = Target(path, (*lead, x, two_i // 2, 0), (two_i // 2, h))
    elif rest[-2:] == ("experts", "down_proj") and not fused:
        e, h, i = shape
        for x in range(e):
            out[f"{stem}mlp.experts.{x}.down_proj.weight"] = Target(path, (*lead, x, 0, 0), (h, i))
    else:
        out[stem + name] = Target(path, (*lead, *([0] * len(shape))), shape)


_EXPERT_STEM = re.compile(r"^(.*layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj|\d+\.)")


def _expert_layouts(keys) -> dict[str, bool]:
    layouts: dict[str, bool] = {}
    for k in keys:
        m = _EXPERT_STEM.match(k)
        if m:
            layouts.setdefault(m.group(1), not m.group(2)[0].isdigit())
    return layouts


# ---------------------------------------------------------------------------------------------------------------------
# device writes
# ---------------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, donate_argnums=0)
def _write(buf: jnp.ndarray, value: jnp.ndarray, start: jnp.ndarray) -> jnp.ndarray:
    value = value.reshape((1,) * (buf.ndim - value.ndim) + value.shape)
    return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype), tuple(start[i] for i in range(buf.ndim)))


def _host_cast(arr: np.ndarray, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------------------------------
class Checkpoint:
    """The tensors of a HF checkpoint folder (headers only; data is read on demand)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.files = [SafetensorsFile(os.path.join(self.folder, f)) for f in list_checkpoint_files(self.folder)]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for k in f.keys():
                self.where.setdefault(k, f)

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.where[key].shape(key))

    def dtype(self, key: str) -> str:
        return self.where[key].dtype(key)

    def get(self, key: str) -> np.ndarray:
        return self.where[key].get(key)

    def file_of(self, key: str) -> str:
        return os.path.basename(self.where[key].path)

    def close(self) -> None:
        for f in self.files:
            f.close()


def _text_prefix(keys) -> str:
    if any(k.startswith("model.language_model.") for k in keys):
        return "model.language_model."
    return "model."


def _default_dtype(ckpt: Checkpoint, cfg: TextConfig, prefix: str):
    key = prefix + "embed_tokens.weight"
    if key in ckpt.where and ckpt.dtype(key) in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[ckpt.dtype(key)]
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(str(cfg.dtype), jnp.float32)


def load_model(path: str | os.PathLike, *, dtype=None) -> Qwen3_5MoeForCausalLM:
    """Load a HF ``qwen3_5_moe`` / ``qwen3_5_moe_text`` checkpoint folder.

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` or sharded files + ``model.safetensors.index.json``.
      dtype: parameter/activation dtype (e.g. ``jnp.bfloat16``); default: the checkpoint's float dtype.
        ``A_log`` and ``dt_bias`` stay float32 whatever is asked.
    Raises:
      ConfigError, SafetensorsError, LoadError — each naming the file and the tensor or field at fault.
    """
    path = os.fspath(path)
    cfg = TextConfig.from_file(path)
    ckpt = Checkpoint(path)
    try:
        model = _load(cfg, ckpt, dtype)
    finally:
        ckpt.close()
    model.generation_config = GenerationConfig.from_folder(path)
    return model


def _load(cfg: TextConfig, ckpt: Checkpoint, dtype) -> Qwen3_5MoeForCausalLM:
    keys = ckpt.keys()
    prefix = _text_prefix(keys)
    skipped = [k for k in keys if k.startswith(SKIPPED_PREFIXES)]
    if skipped:
        logger.warning("%s: skipping %d vision tensors (model.visual.*): qjax runs the text model",
                       ckpt.folder, len(skipped))
    with_mtp = any(k.startswith("mtp.") for k in keys)
    dtype = jnp.dtype(dtype) if dtype is not None else _default_dtype(ckpt, cfg, prefix)
    model = abstract_model(cfg, dtype=dtype, with_mtp=with_mtp)
    leaves = _leaf_shapes(model)
    targets = expected_tensors(cfg, leaves, fused_experts=_expert_layouts(keys), text_prefix=prefix)
    _check(ckpt, targets, set(skipped))

    buffers: dict[tuple, jnp.ndarray] = {}
    for key in _ordered(ckpt, targets):
        t = targets[key]
        leaf = leaves[t.path]
        arr = _host_cast(ckpt.get(key), leaf.dtype)
        if tuple(arr.shape) == tuple(leaf.shape):
            buffers[t.path] = jax.device_put(arr)
            continue
        if t.path not in buffers:
            buffers[t.path] = jnp.zeros(leaf.shape, leaf.dtype)
        buffers[t.path] = _write(buffers[t.path], jax.device_put(arr), jnp.asarray(t.start, jnp.int32))

    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    for p, v in flat:
        v.set_value(buffers[tuple(p)]) if hasattr(v, "set_value") else setattr(v, "value", buffers[tuple(p)])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _ordered(ckpt: Checkpoint, targets: dict[str, Target]) -> Iterator[str]:
    """Keys file by file, in on-disk order, so reads walk each mmap sequentially."""
    for f in ckpt.files:
        for k in f.keys():
            if k in targets and ckpt.where[k] is f:
                yield k


def _check(ckpt: Checkpoint, targets: dict[str, Target], skipped: set[str]) -> None:
    present = set(ckpt.keys())
    missing = sorted(set(targets) - present)
    unexpected = sorted(present - set(targets) - skipped)
    misshaped = [k for k in sorted(present & set(targets)) if ckpt.shape(k) != targets[k].shape]
    wrong_kind = [k for k in sorted(present & set(targets)) if ckpt.dtype(k) not in _FLOAT_DTYPES]
    if not (missing or unexpected or misshaped or wrong_kind):
        return
    lines = [f"checkpoint {ckpt.folder} does not match the model its config.json describes:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): " +
                     ", ".join(f"{k} [{ckpt.file_of(k)}]" for k in unexpected))
    for k in misshaped:
        lines.append(f"  wrong shape: {k} [{ckpt.file_of(k)}] is {list(ckpt.shape(k))}, "
                     f"expected {list(targets[k].shape)}")
    for k in wrong_kind:
        lines.append(f"  not a float tensor: {k} [{ckpt.file_of(k)}] is {ckpt.dtype(k)} "
                     "(quantized checkpoints need a quantization_config)")
    raise LoadError("\n".join(lines))
