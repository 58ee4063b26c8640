"""How a ``qwen3_5_moe`` checkpoint names and lays out its tensors: the one key map that the loader, the writers,
RTN, AutoRound's assembly and the memory planner share.

Accepted layouts (docs/model.md §6): text weights under ``model.language_model.`` (official composite checkpoints)
or ``model.`` (text-only); routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``,
no ``.weight``) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), chosen per layer; ``mtp.*`` for the
MTP head; ``model.visual.*`` for the vision tower (its blocks stacked ``[depth, …]`` in the model). A packed linear ``name`` is stored the compressed-tensors
way (docs/formats.md §3): ``name.weight_packed`` (I32) + ``name.weight_scale`` + ``name.weight_shape`` (+
``name.weight_zero_point`` when asymmetric), or for MXFP8 ``name.weight`` (F8_E4M3) + ``name.weight_scale`` (U8).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.checkpoint.safetensors_io import dtype_name, numpy_dtype
from qjax.model.variables import packed_metas, variable_shapes
from qjax.quant import schemes
from qjax.quant.packing import pack_zero_point

TEXT_PREFIXES = ("model.language_model.", "model.")
VISUAL_PREFIX = "model.visual."  # the vision tower; skipped when the model is loaded text-only


class LoadError(ValueError):
    """A checkpoint that does not match the model: lists every missing, unexpected and mis-shaped tensor."""


FLOAT = ("F32", "BF16", "F16", "F64")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a model variable, the offset inside it, and the shape it must have."""

    path: tuple | None  # nnx state path, e.g. ('groups', 'layers', 0, 'mlp', 'experts', 'gate_up_proj');
    #                     None: check only
    start: tuple[int, ...]  # offset inside the variable (leading stacked dims included)
    shape: tuple[int, ...]  # the tensor's shape on disk
    dtypes: tuple[str, ...] = FLOAT  # safetensors dtypes accepted on disk
    transform: str | None = None  # None (copy/cast) | "zero_point" (unpack along rows) | "kv_scale" | "weight_shape"
    info: tuple = ()  # transform arguments: zero_point (bits, rows); kv_scale (heads,); weight_shape (out, in)
    mem: tuple[int, ...] | None = None  # shape of the slice of the variable, when it differs from the disk shape

    @property
    def mem_shape(self) -> tuple[int, ...]:
        return self.shape if self.mem is None else self.mem

    def index(self, ndim: int) -> tuple:
        """Index of this tensor's slice in a variable with ``ndim`` dims (leading stacked dims are integers)."""
        mem = self.mem_shape
        lead = ndim - len(mem)
        return tuple(self.start[:lead]) + tuple(slice(s, s + n) for s, n in zip(self.start[lead:], mem))


# ---------------------------------------------------------------------------------------------------------------------
# key map
# ---------------------------------------------------------------------------------------------------------------------
def expected_tensors(model, leaves: dict[tuple, jax.ShapeDtypeStruct], *, fused_experts: dict[str, bool],
                     text_prefix: str) -> dict[str, Target]:
    """Every checkpoint key ``model`` needs, with its target (the single map loader and writer share).

    ``fused_experts`` maps a layer's key stem (``"{text_prefix}layers.3."`` or ``"mtp.layers.0."``) to whether that
    layer stores its experts fused; stems not in it default to fused (dense experts only: quantized experts are
    always per expert on disk).
    """
    period = len(model.layer_kinds)
    metas = packed_metas(model)
    out: dict[str, Target] = {}
    for path, leaf in leaves.items():
        shape = tuple(leaf.shape)
        meta = metas.get(path[:-1])
        if path[0] == "groups":
            slot, rest = path[2], path[3:]
            for g in range(model.num_groups):
                stem = f"{text_prefix}layers.{g * period + slot}."
                _add_layer_keys(out, stem, rest, path, (g,), shape[1:], fused_experts.get(stem, True), meta)
        elif path[0] == "mtp" and path[1] == "layers":
            stem = f"mtp.layers.{path[2]}."
            _add_layer_keys(out, stem, path[3:], path, (), shape, fused_experts.get(stem, True), meta)
        elif path[0] == "mtp":
            out["mtp." + ".".join(map(str, path[1:]))] = Target(path, (0,) * len(shape), shape)
        elif path[:2] == ("visual", "blocks"):  # the tower's stacked [depth, …] blocks
            rest = ".".join(map(str, path[2:]))
            for i in range(shape[0]):
                out[f"{VISUAL_PREFIX}blocks.{i}.{rest}"] = Target(path, (i,) + (0,) * (len(shape) - 1), shape[1:])
        elif path[0] == "visual":
            out[VISUAL_PREFIX + ".".join(map(str, path[1:]))] = Target(path, (0,) * len(shape), shape)
        elif path == ("embed_tokens",):
            out[text_prefix + "embed_tokens.weight"] = Target(path, (0, 0), shape)
        elif path[0] == "lm_head" and meta is not None:
            _quant_keys(out, "lm_head", path[-1], path, (), 0, meta.out_features, shape[-1], meta)
        elif path[0] == "lm_head":
            out["lm_head.weight"] = Target(path, (0, 0), shape)
        else:
            out[text_prefix + ".".join(map(str, path))] = Target(path, (0,) * len(shape), shape)
    return out


# which model variable holds each stored field of a packed linear (the float8 ``weight`` of MXFP8 is held in the
# ``weight_packed`` variable; ``weight_shape`` is checked, not held)
_HELD_IN = {"weight": "weight_packed", "weight_packed": "weight_packed", "weight_shape": "weight_packed",
            "weight_scale": "weight_scale", "weight_zero_point": "weight_zero_point"}


def _quant_keys(out, name: str, field: str, path: tuple, lead: tuple[int, ...], row0: int, rows: int, cols: int,
                meta) -> None:
    """Keys of one field of a packed linear ``name`` stored at ``variable[*lead, row0:row0+rows, :cols]``: the
    tensors :func:`packed_tensors` names for it, read back."""
    if field == "weight_zero_point" and meta.strategy == "tensor":
        raise LoadError(f"{name}: asymmetric tensor-strategy quantization is not supported")
    start = (*lead, row0, 0)
    # the weight dtype argument only names int scales' dtype, which the loader does not fix (any float is read)
    for key, (stored, shape, dtype) in packed_tensors(name, schemes.from_meta(meta), (rows, meta.in_features),
                                                      "BF16").items():
        if _HELD_IN[stored] != field:
            continue
        if stored == "weight_shape":
            out[key] = Target(None, (), shape, ("I64", "I32"), "weight_shape", (rows, meta.in_features))
        elif stored == "weight_zero_point":  # packed along rows on disk, unpacked in memory
            out[key] = Target(path, start, shape, (dtype,), "zero_point", (meta.bits, rows), mem=(rows, cols))
        elif stored == "weight_scale":  # int scales: any float dtype (the plan reads which); MXFP8: E8M0 bytes
            dtypes = (dtype,) if meta.fmt == "mxfp8" else FLOAT
            if meta.strategy == "tensor":
                out[key] = Target(path, (*lead, 0, 0), shape, dtypes, mem=(1, 1))
            else:
                out[key] = Target(path, start, shape, dtypes)
        else:
            out[key] = Target(path, start, shape, (dtype,))


def module_targets(name: str, meta) -> dict[str, Target]:
    """Every stored tensor of the packed linear ``name`` (``meta``: its QuantMeta) with the shape and dtypes the
    loader accepts, as :func:`expected_tensors` states them, but bound to no variable (``path`` None): for a reader
    that decodes the module itself."""
    out: dict[str, Target] = {}
    fields = ("weight_packed", "weight_scale") + (() if meta.symmetric else ("weight_zero_point",))
    for field in fields:
        _quant_keys(out, name, field, None, (), 0, meta.out_features, meta.in_features, meta)
    return out


def _add_layer_keys(out, stem, rest, path, lead, shape, fused, meta):
    """Keys of one decoder-layer variable of shape ``shape`` (group axis removed); ``lead`` = ``(g,)`` or ``()``."""
    name = stem + ".".join(map(str, rest[:-1]))
    field = rest[-1]
    if field in ("k_scale", "v_scale"):
        out[name + "." + field] = Target(path, (*lead, 0), (None,), FLOAT, "kv_scale", shape, mem=shape)
        return
    experts = rest[:2] == ("mlp", "experts")
    if experts and meta is not None:  # quantized experts: always per expert on disk
        proj, cols = rest[2], shape[-1]
        for e in range(shape[0]):
            if proj == "gate_up_proj":
                half = meta.out_features // 2
                for i, sub in enumerate(("gate_proj", "up_proj")):
                    _quant_keys(out, f"{stem}mlp.experts.{e}.{sub}", field, path, (*lead, e), i * half, half, cols,
                                meta)
            else:
                _quant_keys(out, f"{stem}mlp.experts.{e}.down_proj", field, path, (*lead, e), 0, meta.out_features,
                            cols, meta)
        return
    if experts and field == "gate_up_proj" and not fused:
        e, two_i, h = shape
        for x in range(e):
            out[f"{stem}mlp.experts.{x}.gate_proj.weight"] = Target(path, (*lead, x, 0, 0), (two_i // 2, h))
            out[f"{stem}mlp.experts.{x}.up_proj.weight"] = Target(path, (*lead, x, two_i // 2, 0), (two_i // 2, h))
        return
    if experts and field == "down_proj" and not fused:
        e, h, i = shape
        for x in range(e):
            out[f"{stem}mlp.experts.{x}.down_proj.weight"] = Target(path, (*lead, x, 0, 0), (h, i))
        return
    if meta is not None:
        _quant_keys(out, name, field, path, lead, 0, meta.out_features, shape[-1], meta)
        return
    out[stem + ".".join(map(str, rest))] = Target(path, (*lead, *([0] * len(shape))), shape)


EXPERT_STEM = re.compile(r"^(.*layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj|\d+\.)")


def expert_layouts(keys) -> dict[str, bool]:
    layouts: dict[str, bool] = {}
    for k in keys:
        m = EXPERT_STEM.match(k)
        if m:
            layouts.setdefault(m.group(1), not m.group(2)[0].isdigit())
    return layouts


def text_prefix(keys) -> str:
    """The prefix of the text model's tensors in a folder with these keys (composite or text-only checkpoint)."""
    if any(k.startswith("model.language_model.") for k in keys):
        return "model.language_model."
    return "model."


def per_expert_layout(cfg, *, prefix: str = "model.", mtp_layers: int = 0) -> dict[str, bool]:
    """Every decoder layer (and ``mtp_layers`` MTP layers) with its routed experts stored per expert, as transformers
    and vLLM write them: the ``fused_experts`` argument of :func:`expected_tensors` for a writer."""
    stems = {f"{prefix}layers.{i}.": False for i in range(cfg.num_hidden_layers)}
    stems.update({f"mtp.layers.{i}.": False for i in range(mtp_layers)})
    return stems


def mtp_layers(model) -> int:
    """How many MTP layers ``model`` holds (0 without an MTP head)."""
    return max(1, model.config.mtp_num_hidden_layers) if getattr(model, "mtp", None) is not None else 0



def is_linear(module: str) -> bool:
    """Whether a module name is an ``nn.Linear`` in transformers (what a ``"Linear"`` config-group target matches):
    the router ``mlp.gate`` and the embedding are not."""
    return not module.endswith(".mlp.gate") and "embed_tokens" not in module


def packed_tensors(module: str, scheme, shape: tuple[int, int], weight_dtype: str) -> dict[str, tuple]:
    """The tensors compressed-tensors stores for linear ``module`` ``[out, in]`` quantized with ``scheme`` (a
    :class:`qjax.quant.config.WeightScheme`): key → (field, shape on disk, safetensors dtype). Scales are
    ``weight_dtype`` (the model's) unless the scheme names their dtype. The one statement of the module layout:
    the loader's targets (:func:`expected_tensors`) and every writer's tensors (:func:`packed_entries`) derive from
    it."""
    out_f, in_f = shape
    if scheme.is_mxfp8:
        return {f"{module}.weight": ("weight", (out_f, in_f), "F8_E4M3"),
                f"{module}.weight_scale": ("weight_scale", (out_f, -(-in_f // scheme.group_size)), "U8")}
    b = scheme.num_bits
    groups = {"group": -(-in_f // (scheme.group_size or in_f)), "channel": 1, "tensor": 1}[scheme.strategy]
    scale_shape = (1,) if scheme.strategy == "tensor" else (out_f, groups)
    scale_dtype = dtype_name(scheme.scale_dtype) if scheme.scale_dtype else weight_dtype
    out = {f"{module}.weight_packed": ("weight_packed", (out_f, -(-in_f * b // 32)), "I32"),
           f"{module}.weight_scale": ("weight_scale", scale_shape, scale_dtype),
           f"{module}.weight_shape": ("weight_shape", (2,), "I64")}
    if not scheme.symmetric:
        out[f"{module}.weight_zero_point"] = ("weight_zero_point", (-(-out_f * b // 32), groups), "I32")
    return out


Entry = tuple[tuple[int, ...], str, Callable[[], np.ndarray]]  # (shape on disk, safetensors dtype, get)


def packed_entries(module: str, scheme, shape: tuple[int, int], weight_dtype: str,
                   compute: Callable[[], tuple]) -> dict[str, Entry]:
    """The compressed-tensors tensors of one quantized module as checkpoint entries (key → (shape, dtype, get)):
    RTN, AutoRound's assembly and the auto_round reader all encode through here.

    ``compute()`` returns ``(weight, scale, zero_point)``: int32 packed words ``[out, ceil(in·b/32)]`` (or float8
    E4M3 values ``[out, in]`` for MXFP8), the scales ``[out, G]`` (``[1]`` per tensor; E8M0 bytes for MXFP8) and the
    signed zero points ``[out, G]`` unpacked (None when symmetric). It runs on the first access; each field is
    released after it is read, so a module's tensors are held once, briefly.
    """
    specs = packed_tensors(module, scheme, shape, weight_dtype)
    cache: dict[str, np.ndarray] = {}

    def encode() -> None:
        weight, scale, zero_point = compute()
        fields = {"weight" if scheme.is_mxfp8 else "weight_packed": np.asarray(weight), "weight_scale": scale}
        if not scheme.is_mxfp8:
            fields["weight_shape"] = np.asarray(shape, np.int64)
        if zero_point is not None:
            fields["weight_zero_point"] = pack_zero_point(np.asarray(zero_point, np.int32), scheme.num_bits)
        for key, (field, disk_shape, dtype) in specs.items():
            arr = np.asarray(fields.pop(field)).astype(numpy_dtype(dtype), copy=False)
            if tuple(arr.shape) != tuple(disk_shape):
                raise AssertionError(f"{key}: encoded as {list(arr.shape)}, the layout says {list(disk_shape)}")
            cache[field] = arr
        if fields:
            raise AssertionError(f"{module}: {sorted(fields)} have no place in the layout of {scheme}")

    def getter(field: str) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            if field not in cache:
                cache.clear()
                encode()
            return cache.pop(field)
        return get

    return {key: (tuple(disk_shape), dtype, getter(field)) for key, (field, disk_shape, dtype) in specs.items()}


# ---------------------------------------------------------------------------------------------------------------------
# model → tensors (the writers' direction)
# ---------------------------------------------------------------------------------------------------------------------
def _values(model) -> tuple[dict[tuple, jax.Array], dict[tuple, bool]]:
    """Variable values by path, and whether each is a trainable Param (cast to the output dtype) or packed storage
    (written bit for bit)."""
    values, is_param = {}, {}
    for p, v in nnx.to_flat_state(nnx.state(model)):
        values[tuple(p)] = v.get_value() if hasattr(v, "get_value") else v.value
        is_param[tuple(p)] = isinstance(v, nnx.Param)
    return values, is_param


def checkpoint_tensors(model, *, fused_experts: bool | Mapping[str, bool] = False, dtype=None,
                       text_prefix: str = "model.") -> list[tuple[str, int, Callable]]:
    """Every checkpoint tensor as ``(hf_key, nbytes, get)``; ``get()`` pulls that one tensor to the host.

    Quantized modules are written in compressed-tensors' layout (``weight_packed`` + ``weight_scale`` +
    ``weight_shape`` [+ ``weight_zero_point`` packed along rows], or float8 ``weight`` + U8 ``weight_scale``; FP8 KV
    ``k_scale``/``v_scale``): the inverse of the loader's transforms.

    Args:
      fused_experts: write dense experts as ``mlp.experts.gate_up_proj``/``down_proj`` stacks (the official BF16
        layout) instead of transformers' per-expert keys; or, per layer, a map of key stems (``"mtp.layers.0."``)
        to whether that layer's are fused (:func:`expert_layouts` of another checkpoint), the others per expert.
        Quantized experts are always per expert.
      dtype: dtype of the float parameters on disk (default: the model dtype; ``A_log``/``dt_bias``, fp32 in memory,
        follow it like transformers' checkpoints do). Quantization scales keep their own dtype, and the vision
        tower the dtype it is held in.
      text_prefix: ``"model."`` (text-only checkpoints) or ``"model.language_model."`` (composite ones).
    """
    cfg = model.config
    values, is_param = _values(model)
    per_expert = per_expert_layout(cfg, prefix=text_prefix, mtp_layers=mtp_layers(model))
    if isinstance(fused_experts, Mapping):
        layouts = {**per_expert, **fused_experts}
    else:
        layouts = {} if fused_experts else per_expert
    targets = expected_tensors(model, variable_shapes(model), fused_experts=layouts, text_prefix=text_prefix)
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)
    quant = getattr(model, "quant", None)
    kv_dtype = np.dtype(jnp.dtype(quant.kv_scale_dtype)) if quant is not None else np.dtype(np.float32)
    per_tensor_kv = quant is not None and quant.kv_cache == "tensor"

    def stored_dtype(t) -> np.dtype:
        # the vision tower is written in the dtype it is held in (its checkpoint's, unless loaded otherwise): a
        # checkpoint's BF16 tower stays BF16 next to a float32 or quantized body
        return np.dtype(values[t.path].dtype) if t.path is not None and t.path[0] == "visual" else out_dtype

    def getter(t):
        def get() -> np.ndarray:
            if t.transform == "weight_shape":
                return np.asarray(t.info, np.int64)
            arr = values[t.path]
            host = np.asarray(arr[t.index(arr.ndim)])
            if t.transform == "zero_point":
                return pack_zero_point(host.astype(np.int8), t.info[0]).astype(np.int32)
            if t.transform == "kv_scale":
                return (host[:1] if per_tensor_kv else host).astype(kv_dtype)
            want = stored_dtype(t)
            if is_param[t.path] and host.dtype != want and host.dtype.kind in "fV":
                return host.astype(want)
            return host.reshape(t.shape)
        return get

    def nbytes(t) -> int:
        if t.transform == "weight_shape":
            return 16
        if t.transform == "kv_scale":
            return kv_dtype.itemsize * (1 if per_tensor_kv else t.info[0])
        kind = np.dtype(values[t.path].dtype)
        itemsize = stored_dtype(t).itemsize if is_param[t.path] and kind.kind in "fV" else kind.itemsize
        if t.transform == "zero_point":
            itemsize = 4
        return int(np.prod(t.shape)) * itemsize

    return [(key, nbytes(targets[key]), getter(targets[key])) for key in sorted(targets)]
