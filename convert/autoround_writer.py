"""Write an INT-quantized qjax model in auto-round's own checkpoint format (``--format auto_round``).

The folder mirrors what auto-round 0.16.1 writes for a ``qwen3_5_moe_text`` model (docs/autoround.md §16.1) and loads in
transformers through its auto-round quantizer (``AutoModelForCausalLM.from_pretrained`` with auto-round installed):

* every quantized ``nn.Linear`` (routed experts per expert: ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj``,
  as auto-round unfuses them) as ``qweight`` / ``qzeros`` / ``scales`` (F16) in the packing auto-round picks —
  symmetric → ``auto_round:auto_gptq`` (GPTQ v1, zp − 1), asymmetric and all 4-bit → ``auto_round:auto_awq``, other
  asymmetric → ``auto_round``; the codecs live in :mod:`qjax.checkpoint.auto_round`, the loader's half;
* everything else (embeddings, norms, router ``mlp.gate``, ``shared_expert_gate``, GDN parameters, dense linears,
  an unquantized ``lm_head``) exactly as :func:`qjax.convert.save_pretrained` writes it: same keys, same dtype;
* ``config.json`` with auto-round's ``quantization_config`` (also written alone as ``quantization_config.json``).

The values come from the model's compressed-tensors tensors (``checkpoint_tensors``), so writer, loader and the
compressed-tensors writer share one key map. MXFP8 layers, FP8 KV caches and per-tensor INT scales have no
auto_round-format equivalent here and are refused; use ``save_pretrained`` (compressed-tensors) for them.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from qjax.convert.hf_writer import (
    DEFAULT_SHARD_BYTES,
    hf_config,
    write_atomically,
    write_json,
    write_weights,
)

from qjax.checkpoint.auto_round import (
    AUTOROUND_METHOD,
    AWQ,
    GPTQ,
    NATIVE,
    PACKING_FORMATS,
    AutoRoundError,
    check_layer_dims,
    ct_to_autoround,
    standard_regex,
)
from qjax.checkpoint.layout import checkpoint_tensors
from qjax.checkpoint.source import export_prefix, export_tensors, opened_source
from qjax.model.linears import layer_linears
from qjax.quant.packing import unpack_zero_point
from qjax.quant.schemes import ArScheme, to_autoround
from qjax.quant.unquantized import KeptPart, parts_held

__all__ = ["AUTOROUND_VERSION", "AutoRoundError", "autoround_quantization_config", "save_autoround"]

# The auto-round release whose on-disk format this writer reproduces (recorded as ``autoround_version``).
AUTOROUND_VERSION = "0.16.1"
TEXT_PREFIX = "model."  # a text-only folder; a composite one (from a composite source) has model.language_model.
# auto-round's ``filter_quantization_config`` drops tuning keys equal to these defaults (lr/minmax_lr: 1/iters, or
# 5e-3 when iters is 0); order = its SerializedCompressorConfig field order.
_TUNING_DEFAULTS: dict[str, object] = {
    "amp": True, "batch_size": 8, "enable_minmax_tuning": True, "enable_norm_bias_tuning": False,
    "enable_quanted_input": True, "gradient_accumulate_steps": 1, "iters": 200, "lr": None,
    "low_gpu_mem_usage": False, "minmax_lr": None, "nsamples": 128, "scale_dtype": "torch.float16", "seqlen": 2048,
    "dataset": "NeelNanda/pile-10k",
}
_LAYER_CONFIG_KEYS = ("bits", "group_size", "sym", "data_type")


# ---------------------------------------------------------------------------------------------------------------------
# which linears are quantized, and how
# ---------------------------------------------------------------------------------------------------------------------
Linear = tuple[str, "ArScheme | None", tuple[int, int]]  # (module name, scheme or None = 16-bit, (out, in))


def _linears(model, text_prefix: str = TEXT_PREFIX) -> list[Linear]:
    """Every linear module inside the decoder blocks, in model order (experts per expert)."""
    cfg, quant = model.config, model.quant
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    out: list[Linear] = []
    for i, kind in enumerate(cfg.layer_types):
        stem = f"{text_prefix}layers.{i}."
        metas = quant.layer(i)
        for rel, shape in layer_linears(cfg, kind).items():
            out.append((stem + rel, _scheme(stem + rel, metas.get(rel)), shape))
        gate_up = _scheme(f"{stem}mlp.experts", metas.get("mlp.experts.gate_up_proj"))
        down = _scheme(f"{stem}mlp.experts", metas.get("mlp.experts.down_proj"))
        for e in range(cfg.num_experts):
            out += [(f"{stem}mlp.experts.{e}.gate_proj", gate_up, (inter, h)),
                    (f"{stem}mlp.experts.{e}.up_proj", gate_up, (inter, h)),
                    (f"{stem}mlp.experts.{e}.down_proj", down, (h, inter))]
    return out


def _scheme(name: str, meta) -> ArScheme | None:
    """auto-round's (bits, group_size, sym) of a qjax QuantMeta; group_size -1 = one group per row (channel)."""
    if meta is None:
        return None
    if meta.fmt == "mxfp8":
        raise AutoRoundError(f"{name}: MXFP8 layers cannot be written in the auto_round INT format; use "
                             "qjax.convert.save_pretrained (compressed-tensors mxfp8-quantized)")
    if meta.strategy == "tensor":
        raise AutoRoundError(f"{name}: per-tensor INT scales have no auto_round equivalent (group or channel only)")
    return to_autoround(meta)


def _global_scheme(linears: list[Linear]) -> ArScheme:
    """The recipe's main scheme: the most common one among non-expert linears (W4A16 in "W4A16 + int2 experts"),
    else among all. auto-round lists every layer that differs from it in ``extra_config``."""
    for pool in ([s for n, s, _ in linears if s is not None and ".mlp.experts." not in n],
                 [s for _, s, _ in linears if s is not None]):
        if pool:
            return collections.Counter(pool).most_common(1)[0][0]
    raise AutoRoundError("the model has no quantized linear layers: quantize it first (e.g. "
                         "qjax.autoround.rtn.quantize_model) or write it with qjax.convert.save_pretrained")


def _pick_packing(schemes: list[ArScheme], requested: str | None) -> str:
    """auto-round's choice (``AutoRoundFormat.__init__``), or a checked override."""
    syms = {s[2] for s in schemes}
    if len(syms) > 1:
        raise AutoRoundError("symmetric and asymmetric layers cannot share one auto_round packing_format")
    sym = syms.pop()
    if requested is None:
        if sym:
            return GPTQ
        return AWQ if all(s[0] == 4 for s in schemes) else NATIVE
    if requested not in PACKING_FORMATS:
        raise AutoRoundError(f"packing_format {requested!r} is not one of {', '.join(PACKING_FORMATS)}")
    if requested == GPTQ and not sym:
        raise AutoRoundError(f"{GPTQ} holds symmetric layers only (its zp − 1 cannot store a zero point of 0); "
                             f"use {NATIVE!r} or {AWQ!r}")
    if requested == AWQ and any(s[0] != 4 for s in schemes):
        raise AutoRoundError(f"{AWQ} packs 4-bit layers only")
    return requested


# ---------------------------------------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------------------------------------
def _fields(s: ArScheme | None) -> dict:
    if s is None:
        return {"bits": 16, "data_type": "float"}
    return {"bits": s[0], "group_size": s[1], "sym": s[2], "data_type": "int"}


def _differing(fields: Mapping, top: Mapping) -> dict:
    """auto-round's ``check_neq_config``: only the fields that differ from the top-level scheme, in scheme order."""
    return {k: fields[k] for k in _LAYER_CONFIG_KEYS if k in fields and fields[k] != top.get(k)}


def _tuning_keys(tuning: Mapping | None) -> dict:
    """Non-default tuning keys, filtered like auto-round's ``filter_quantization_config``."""
    if not tuning:
        return {}
    unknown = sorted(set(tuning) - set(_TUNING_DEFAULTS))
    if unknown:
        raise AutoRoundError(f"unknown tuning keys {unknown} (known: {', '.join(_TUNING_DEFAULTS)})")
    iters = tuning.get("iters") or 0
    lr = 1.0 / iters if iters > 0 else 5e-3
    defaults = {**_TUNING_DEFAULTS, "lr": lr, "minmax_lr": lr}
    return {k: tuning[k] for k in _TUNING_DEFAULTS if k in tuning and tuning[k] is not None
            and tuning[k] != defaults[k]}


def _regex_entries(linears: list[Linear], layer_config: Mapping, top: Mapping) -> dict:
    """The recipe's ``layer_config`` patterns as auto-round records them; each must describe what it matches."""
    names = {n for n, _, _ in linears}
    out = {}
    for pattern, fields in layer_config.items():
        bad = sorted(set(fields) - set(_LAYER_CONFIG_KEYS))
        if bad:
            raise AutoRoundError(f"layer_config[{pattern!r}]: unsupported keys {bad} ({', '.join(_LAYER_CONFIG_KEYS)})")
        if pattern in names:
            continue  # an exact layer name: its explicit extra_config entry (if it differs) already says it
        regex = standard_regex(pattern)
        matched = [(n, s) for n, s, _ in linears if re.search(regex, n)]
        if not matched:
            raise AutoRoundError(f"layer_config[{pattern!r}] ({regex}) matches no linear layer")
        for n, s in matched:
            have = _fields(s)
            wrong = {k: v for k, v in fields.items() if have.get(k) != v and not (k == "data_type" and s is None)}
            if wrong:
                raise AutoRoundError(f"layer_config[{pattern!r}] says {wrong} but {n} is {have}")
        entry = _differing(fields, top)
        if entry:
            out[regex] = entry
    return out


def autoround_quantization_config(model, *, tuning: Mapping | None = None, layer_config: Mapping | None = None,
                                  packing_format: str | None = None, kept: Iterable[KeptPart] | None = None,
                                  text_prefix: str = TEXT_PREFIX) -> dict:
    """The ``quantization_config`` auto-round writes for this model, key order included.

    ``extra_config`` lists every in-block linear whose scheme differs from the top-level one (only the differing
    fields), unquantized ones as ``{"bits": 16, "data_type": "fp"}`` when a dim is not a multiple of 32 (auto-round's
    shape rule) or ``"float"`` otherwise, a quantized ``lm_head`` with its full scheme, the recipe's patterns, the
    routers auto-round always ignores (``.*model\\.layers\\.{i}\\.mlp\\.gate.*``), and the parts kept
    unquantized that the folder holds (``kept``; default: the model's MTP head if it has one) as ``{"bits": 16}``
    patterns: they sit outside ``block_name_to_quantize`` already, but a consumer that builds them (vLLM's MTP
    drafter) then needs no rule of its own to keep them dense. Names are under ``text_prefix``.
    """
    quant = getattr(model, "quant", None)
    if quant is None or quant.is_empty:
        raise AutoRoundError("the model is not quantized: quantize it first (e.g. qjax.autoround.rtn.quantize_model) "
                             "or write it with qjax.convert.save_pretrained")
    if quant.kv_cache is not None:
        raise AutoRoundError("FP8 KV-cache scales have no place in the auto_round INT format; use save_pretrained")
    linears = _linears(model, text_prefix)
    lm_head = _scheme("lm_head", quant.lm_head)
    schemes = [s for _, s, _ in linears if s is not None] + ([lm_head] if lm_head else [])
    top_scheme = _global_scheme(linears) if any(s for _, s, _ in linears) else lm_head
    if top_scheme is None:
        raise AutoRoundError("the model has no quantized linear layers")
    fmt = _pick_packing(schemes, packing_format)
    top = _fields(top_scheme)
    cfg = model.config
    for name, s, (n, k) in [*linears, ("lm_head", lm_head, (cfg.vocab_size, cfg.hidden_size))]:
        if s is not None:
            check_layer_dims(name, n, k, s[0], s[1])  # before anything is written

    extra: dict[str, dict] = {}
    for name, s, (n, k) in linears:  # auto-round: shape-skipped / ignored layers first, then differing ones
        if s is None:
            extra[name] = {"bits": 16, "data_type": "fp" if n % 32 or k % 32 else "float"}
    for name, s, _ in linears:
        if s is not None and s != top_scheme:
            extra[name] = _differing(_fields(s), top)
    if lm_head is not None:
        extra["lm_head"] = _fields(lm_head)  # outside the blocks: auto-round records its whole scheme
    extra.update(_regex_entries(linears, layer_config or {}, top))
    block = f"{text_prefix}layers"
    for i in range(model.config.num_hidden_layers):
        extra[standard_regex(f"{block}.{i}.mlp.gate")] = {"bits": 16, "data_type": "float"}
    if kept is None:
        kept = parts_held(k for k, _, _ in checkpoint_tensors(model))
    for part in kept:
        extra[part.regex] = {"bits": 16, "data_type": "float"}

    qc: dict = {"bits": top["bits"], "data_type": "int", "group_size": top["group_size"], "sym": top["sym"]}
    qc.update(_tuning_keys(tuning))
    qc.update({"autoround_version": AUTOROUND_VERSION, "block_name_to_quantize": block,
               "quant_method": AUTOROUND_METHOD, "packing_format": fmt, "extra_config": extra})
    return qc


# ---------------------------------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------------------------------
Item = tuple[str, int, Callable[[], np.ndarray]]  # (key, nbytes, get)


def autoround_tensors(model, quantization_config: Mapping, *, dtype=None, tensors: list[Item] | None = None,
                      text_prefix: str = TEXT_PREFIX) -> list[Item]:
    """Every tensor of the auto-round folder as ``(key, nbytes, get)``, sorted by key.

    Quantized modules are converted from their compressed-tensors tensors; all other keys are ``tensors``' own
    (default: :func:`checkpoint_tensors`', per-expert layout, ``dtype`` as there), under ``text_prefix``.
    """
    fmt = quantization_config["packing_format"]
    if tensors is None:
        tensors = checkpoint_tensors(model, dtype=dtype, text_prefix=text_prefix)
    ct = {key: (nbytes, get) for key, nbytes, get in tensors}
    modules = {key[: -len(".weight_packed")] for key in ct if key.endswith(".weight_packed")}
    schemes = {name: s for name, s, _ in _linears(model, text_prefix) if s is not None}
    if model.quant.lm_head is not None:
        schemes["lm_head"] = _scheme("lm_head", model.quant.lm_head)
    items: list[Item] = [(k, nb, get) for k, (nb, get) in ct.items() if k.rpartition(".")[0] not in modules]
    for name in sorted(modules):
        items += _module_items(name, schemes[name], fmt, ct)
    return sorted(items, key=lambda it: it[0])


def _module_items(name: str, scheme: ArScheme, fmt: str, ct: Mapping[str, tuple[int, Callable]]) -> list[Item]:
    """``qweight``/``qzeros``/``scales`` of one module, converted together on first access and released after use."""
    bits, gs, _ = scheme
    n, k = (int(v) for v in ct[f"{name}.weight_shape"][1]())
    groups = 1 if gs == -1 else k // gs
    cache: dict[str, np.ndarray] = {}

    def field(key: str) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            if not cache:
                zp = ct.get(f"{name}.weight_zero_point")
                zp = None if zp is None else unpack_zero_point(zp[1](), bits, n)
                cache.update(ct_to_autoround(ct[f"{name}.weight_packed"][1](), ct[f"{name}.weight_scale"][1](), zp,
                                             bits=bits, packing_format=fmt, name=name))
            return cache.pop(key)
        return get

    words = n * bits // 32
    qweight_bytes = 4 * (k * words if fmt == AWQ else k * bits // 32 * n)
    return [(f"{name}.qweight", qweight_bytes, field("qweight")),
            (f"{name}.qzeros", 4 * groups * words, field("qzeros")),
            (f"{name}.scales", 2 * groups * n, field("scales"))]


# ---------------------------------------------------------------------------------------------------------------------
# the folder
# ---------------------------------------------------------------------------------------------------------------------
def save_autoround(model, out_dir: str | os.PathLike, *, overwrite: bool = False, extra_files: Iterable[str] = (),
                   tuning: Mapping | None = None, layer_config: Mapping | None = None,
                   packing_format: str | None = None, dtype=None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, source: str | os.PathLike | None = None) -> str:
    """Write an INT-quantized ``model`` as an auto-round (``--format auto_round``) checkpoint folder.

    Args:
      out_dir: the folder; written under a temporary name next to it and renamed when complete, so a failure
        leaves nothing behind.
      overwrite: replace an existing ``out_dir`` (removed only after the new folder is complete).
      extra_files: copied into the folder as they are (tokenizer.json, tokenizer_config.json, …).
      tuning: how the model was tuned (``iters``, ``nsamples``, ``lr``, ``seqlen``, …); keys equal to auto-round's
        defaults are dropped, as auto-round does.
      layer_config: the recipe's per-layer overrides as given to auto-round (``{".*experts.*": {"bits": 2,
        "group_size": 64}}``), recorded in ``extra_config`` like auto-round records them; each pattern must match
        layers that really have those fields.
      packing_format: override auto-round's choice (``auto_round:auto_gptq`` for symmetric, ``auto_round:auto_awq``
        for all-4-bit asymmetric, else ``auto_round``); ``"auto_round"`` suits asymmetric models on CPU, where
        auto-round 0.16.1 has no working AWQ kernel.
      dtype: dtype of the unquantized tensors (default: the model dtype). Scales are always float16.
      source: the checkpoint folder ``model`` was loaded from; its parts kept unquantized (``mtp.*``,
        ``model.visual.*``) are copied as stored and its layout is kept, as :func:`qjax.convert.save_pretrained`
        does.
    Returns:
      ``out_dir`` as a string.
    Raises:
      AutoRoundError: a dense model, MXFP8 layers, FP8 KV scales, per-tensor scales, a quantized layer whose dims
        are not multiples of 32, mixed symmetry, or scales that overflow float16.
    """
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)
    # everything auto-round would refuse is refused here, before a folder or the source is touched
    autoround_quantization_config(model, tuning=tuning, layer_config=layer_config, packing_format=packing_format)

    def write(folder: str) -> None:
        with opened_source(source) as src:
            prefix = export_prefix(model, src)
            tensors = export_tensors(model, src, dtype=out_dtype)
            qc = autoround_quantization_config(model, tuning=tuning, layer_config=layer_config,
                                               packing_format=packing_format,
                                               kept=parts_held(k for k, _, _ in tensors), text_prefix=prefix)
            hf_cfg = hf_config(model, out_dtype, src)
            hf_cfg["quantization_config"] = qc
            write_json(os.path.join(folder, "config.json"), hf_cfg)
            write_json(os.path.join(folder, "quantization_config.json"), qc)  # auto-round writes it alongside
            write_weights(folder, autoround_tensors(model, qc, tensors=tensors, text_prefix=prefix), model=model,
                          max_shard_bytes=max_shard_bytes, extra_files=extra_files)

    return write_atomically(out_dir, write, overwrite=overwrite)
