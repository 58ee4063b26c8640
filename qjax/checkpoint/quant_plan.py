"""The loader's compressed-tensors half: which modules of a checkpoint are quantized, and how.

The config decides bits, group size, symmetry and format; the tensors present decide whether a module is quantized
(``.weight_packed`` → pack-quantized, float8 ``.weight`` + ``.weight_scale`` → MXFP8, plain ``.weight`` → dense), as
docs/formats.md §2 recommends. A module whose tensors and config disagree is an error, never a guess.
"""

from __future__ import annotations

import dataclasses

from qjax.checkpoint.safetensors_io import numpy_dtype
from qjax.kernels import QuantMeta
from qjax.model.config import FULL, TextConfig
from qjax.model.linears import layer_linears
from qjax.model.quant_spec import ModelQuant
from qjax.quant import schemes
from qjax.quant.config import QuantizationConfig, WeightScheme


class QuantLoadError(ValueError):
    """Quantized tensors that do not agree with ``quantization_config`` (names the file/tensor and the group)."""


def stored_format(name: str, keys: set[str], dtype_of) -> str | None:
    """'int', 'mxfp8' or None (dense), from the tensors present for module ``name``."""
    if f"{name}.weight_packed" in keys:
        return "int"
    if f"{name}.weight" in keys and dtype_of(f"{name}.weight") == "F8_E4M3":
        if f"{name}.weight_scale" not in keys:
            raise QuantLoadError(f"{name}.weight is float8 but {name}.weight_scale is missing")
        return "mxfp8"
    return None


def module_meta(name: str, scheme: WeightScheme | None, fmt: str, out_in: tuple[int, int], scale_dtype: str,
                source: str) -> QuantMeta:
    """The kernel description of module ``name`` stored as ``fmt`` (:func:`stored_format`) with its config
    ``scheme``; a module no group targets, a format that differs from its group's, or a group size that does not
    divide the input columns is a :class:`QuantLoadError` naming the module."""
    if scheme is None:
        raise QuantLoadError(f"{name}: stored quantized ({fmt}) but no config_group of {source} targets it "
                             "(or it is in 'ignore')")
    want = "mxfp8" if scheme.format == "mxfp8-quantized" else "int"
    if want != fmt:
        raise QuantLoadError(f"{name}: stored as {fmt} but its config_group says {scheme.format}")
    out, k = out_in
    if fmt == "mxfp8":
        if k % 32:
            raise QuantLoadError(f"{name}: MXFP8 needs in_features divisible by 32, got {k}")
        return schemes.to_meta(scheme, out, k, "uint8")
    group = scheme.group_size if scheme.strategy == "group" else k
    if group < k and k % group:
        # a scale shape can fit by accident (96 on 128 columns needs 2 groups, as 64 does); compressed-tensors
        # refuses such groups ("tensor column shape must be divisible"). A group wider than the layer is one group,
        # which compressed-tensors writes (a 64-wide layer under group_size 128).
        raise QuantLoadError(f"{name}: group_size {group} of its config_group does not divide its {k} input columns "
                             f"({source})")
    return schemes.to_meta(scheme, out, k, scale_dtype)


def plan_quantization(cfg: TextConfig, qc: QuantizationConfig | None, keys: set[str], dtype_of, *,
                      text_prefix: str, source: str) -> ModelQuant | None:
    """Build the :class:`ModelQuant` of a checkpoint (None when nothing is quantized).

    Args:
      keys: every tensor name of the checkpoint; dtype_of: name → safetensors dtype string.
      text_prefix: ``"model.language_model."`` or ``"model."``.
      source: the config.json path, for messages.
    """
    any_quant = any(k.endswith((".weight_packed", ".k_scale")) for k in keys) or any(
        dtype_of(k) == "F8_E4M3" for k in keys if k.endswith(".weight"))
    if qc is None:
        if any_quant:
            raise QuantLoadError(f"{source}: the checkpoint holds quantized tensors but config.json has no "
                                 "quantization_config")
        return None

    def scheme(name):
        return qc.scheme_for(name, is_linear=True)

    def scale_dtype(name):
        if f"{name}.weight_scale" not in keys:
            raise QuantLoadError(f"{name} is stored quantized but {name}.weight_scale is missing (checkpoint of "
                                 f"{source})")
        return numpy_dtype(dtype_of(f"{name}.weight_scale")).name

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        stem = f"{text_prefix}layers.{i}."
        entries: dict[str, QuantMeta] = {}
        for rel, out_in in layer_linears(cfg, kind).items():
            fmt = stored_format(stem + rel, keys, dtype_of)
            if fmt is not None:
                entries[rel] = module_meta(stem + rel, scheme(stem + rel), fmt, out_in, scale_dtype(stem + rel),
                                           source)
        gate_up, down = _expert_metas(cfg, stem, keys, dtype_of, scheme, scale_dtype, source)
        if gate_up is not None:
            entries["mlp.experts.gate_up_proj"] = gate_up
        if down is not None:
            entries["mlp.experts.down_proj"] = down
        layers.append(tuple(sorted(entries.items())))

    lm_head = None
    fmt = stored_format("lm_head", keys, dtype_of)
    if fmt is not None:
        lm_head = module_meta("lm_head", scheme("lm_head"), fmt, (cfg.vocab_size, cfg.hidden_size),
                              scale_dtype("lm_head"), source)

    kv = None
    kv_dtype = "float32"
    if qc.kv_cache is not None:
        kv = qc.kv_cache.strategy
        full = [i for i, k in enumerate(cfg.layer_types) if k == FULL]
        missing = [f"{text_prefix}layers.{i}.self_attn.{s}" for i in full for s in ("k_scale", "v_scale")
                   if f"{text_prefix}layers.{i}.self_attn.{s}" not in keys]
        if missing:
            raise QuantLoadError(f"{source}: kv_cache_scheme is set but these KV scales are missing: "
                                 + ", ".join(missing))
        if full:
            kv_dtype = {"BF16": "bfloat16", "F16": "float16"}.get(
                dtype_of(f"{text_prefix}layers.{full[0]}.self_attn.k_scale"), "float32")
    elif any(k.endswith(".k_scale") for k in keys):
        raise QuantLoadError(f"{source}: the checkpoint has k_scale/v_scale tensors but no kv_cache_scheme")
    return ModelQuant(layers=tuple(layers), lm_head=lm_head, kv_cache=kv, kv_scale_dtype=kv_dtype)


def _expert_metas(cfg, stem, keys, dtype_of, scheme, scale_dtype, source):
    """Metas of a layer's stacked ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, each None if dense.

    Stacking needs one scheme (or none) for every expert's gate and up projections, and one for every down
    projection; the two sides may differ (a quantized gate/up beside a dense down is what auto-round writes when
    the intermediate size is not a multiple of the group size).
    """
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    found: dict[tuple, list[str]] = {}
    for e in range(cfg.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{stem}mlp.experts.{e}.{proj}"
            fmt = stored_format(name, keys, dtype_of)
            sig = None
            if fmt is not None:
                sc = scheme(name)
                out_in = (h, inter) if proj == "down_proj" else (inter, h)
                sig = (proj == "down_proj", module_meta(name, sc, fmt, out_in, scale_dtype(name), source))
            found.setdefault((proj == "down_proj", sig), []).append(name)
    sigs = {k for k in found}
    gate_up = {s for (is_down, s) in sigs if not is_down}
    down = {s for (is_down, s) in sigs if is_down}
    if len(gate_up) != 1 or len(down) != 1:
        detail = "; ".join(f"{'dense' if s is None else s[1].fmt + str(s[1].bits)}: {names[0]} (+{len(names) - 1})"
                           for (_, s), names in found.items())
        raise QuantLoadError(f"{stem}mlp.experts: the experts of a layer are stacked, so every gate and up projection "
                             f"must share one quantization scheme (or all be dense), and likewise every down "
                             f"projection; found {detail}")
    gu, dn = next(iter(gate_up)), next(iter(down))
    return (None if gu is None else dataclasses.replace(gu[1], out_features=2 * inter)), (None if dn is None else dn[1])
