"""Write a qjax model as a Hugging Face checkpoint folder (``qwen3_5_moe_text``) that transformers and qjax load.

Key names come from :func:`qjax.checkpoint.layout.expected_tensors` — the loader's own map, read backwards — so writer
and loader cannot drift. The folder is written next to the target under a temporary name and renamed at the end: a
failed or interrupted write never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable

import numpy as np

from qjax.checkpoint.layout import checkpoint_tensors
from qjax.checkpoint.safetensors_io import INDEX_FILE_NAME, write_safetensors
from qjax.checkpoint.source import Source, export_tensors, opened_source
from qjax.model.linears import layer_linears
from qjax.quant import schemes
from qjax.quant.config import KVCacheScheme, QuantizationConfig, WeightScheme
from qjax.quant.unquantized import KeptPart, parts_held
from qjax.validation import new_folder

DEFAULT_SHARD_BYTES = 2 * 1024**3

logger = logging.getLogger("qjax")


def quantization_config(model, *, kept: Iterable[KeptPart] | None = None) -> dict | None:
    """The compressed-tensors ``quantization_config`` of a quantized model: one config group per distinct scheme.

    Targets are ``re:`` patterns by module kind, as llmcompressor writes them (docs/formats.md §10), so that every
    consumer resolves every module: transformers 5 (routed experts fused into one ``mlp.experts`` module whose
    tensors it decompresses with the group whose ``re:`` target names the experts), vLLM (fused MoE layers matched
    through their per-expert names) and compressed-tensors on a per-expert model. A kind whose layers do not all
    share one scheme gets per-layer patterns; dense kinds go to ``ignore``, and so do the parts kept unquantized
    (``kept``: the ones the folder holds; default: the model's MTP head if it has one) — vLLM builds the MTP head
    with the checkpoint's quantization config, so a ``Linear``-like target would otherwise make it expect packed
    weights.
    """
    quant = getattr(model, "quant", None)
    if quant is None:
        return None
    if kept is None:
        kept = parts_held(k for k, _, _ in checkpoint_tensors(model))
    by_kind = schemes_by_kind(model)
    groups: dict[WeightScheme, list[tuple[str, int | None]]] = {}
    dense: list[tuple[str, int | None]] = []
    for kind, layers in by_kind.items():
        distinct = set(layers.values())
        units = [(kind, None, distinct.pop())] if len(distinct) == 1 else [(kind, i, s) for i, s in layers.items()]
        for name, layer, scheme in units:
            (dense if scheme is None else groups.setdefault(scheme, [])).append((name, layer))
    targets = {sch: _patterns(units) for sch, units in groups.items()}
    if quant.lm_head is not None:
        targets.setdefault(schemes.from_meta(quant.lm_head), []).append("lm_head")
    ignore = ["lm_head"] if quant.lm_head is None else []
    ignore += _patterns(dense)
    ignore += [part.ignore_entry for part in kept]
    kv = None if quant.kv_cache is None else KVCacheScheme(num_bits=8, type="float", strategy=quant.kv_cache)
    # the experts' group first: transformers 5 takes the first group whose re: targets name the experts
    order = sorted(targets.items(), key=lambda kv_: not any(EXPERTS_WORD in t for t in kv_[1]))
    qc = QuantizationConfig(groups=tuple((f"group_{i}", tuple(names), sch) for i, (sch, names) in enumerate(order)),
                            ignore=tuple(ignore), kv_cache=kv)
    return qc.to_dict()


def schemes_by_kind(model) -> dict[str, dict[int, WeightScheme | None]]:
    """Every quantizable module kind of a quantized ``model`` (``self_attn.q_proj``, ``mlp.experts.down_proj``, …)
    → {layer index: its scheme, None when dense}."""
    quant, cfg = model.quant, model.config
    by_kind: dict[str, dict[int, WeightScheme | None]] = {}
    for i, kind in enumerate(cfg.layer_types):
        metas = quant.layer(i)
        for rel in layer_linears(cfg, kind):
            by_kind.setdefault(rel, {})[i] = schemes.from_meta(metas[rel]) if rel in metas else None
        for proj, stacked in EXPERT_PROJECTIONS.items():
            meta = metas.get(stacked)
            by_kind.setdefault(f"{EXPERTS}.{proj}", {})[i] = None if meta is None else schemes.from_meta(meta)
    return by_kind


# Layers vLLM builds from several checkpoint modules; it needs one scheme for all of them (docs/formats.md §10.2)
VLLM_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
              ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
              ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
              ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"))


def consumer_limits(model) -> list[str]:
    """What the PyTorch consumers cannot load correctly in a compressed-tensors export of ``model`` (one sentence
    each; empty when transformers 5 and vLLM both take it). Measured with transformers 5.24 + compressed-tensors
    0.20.1 (the same failures with llmcompressor's own checkpoints) and read from vLLM 0.34's matching code."""
    if getattr(model, "quant", None) is None:
        return []
    by_kind = schemes_by_kind(model)
    used = {s for layers in by_kind.values() for s in layers.values() if s is not None}
    if model.quant.lm_head is not None:
        used.add(schemes.from_meta(model.quant.lm_head))
    experts = {by_kind[f"{EXPERTS}.{p}"][i] for p in EXPERT_PROJECTIONS for i in by_kind[f"{EXPERTS}.{p}"]}
    out = []
    if any(not s.symmetric for s in used):
        out.append("transformers 5.24 cannot load asymmetric pack-quantized modules (it sizes weight_zero_point "
                   "unpacked and drops it for experts; llmcompressor's own W4A16_ASYM export fails the same way)")
    if any(s is not None and s.is_mxfp8 for s in experts):
        out.append("transformers 5.24 cannot load MXFP8 experts (it decompresses 8-bit float experts as per-channel "
                   "FP8, multiplying by the raw E8M0 scale bytes; llmcompressor's own MXFP8A16 export fails the same "
                   "way)")
    if len(experts) > 1:
        out.append(f"transformers 5.24 decompresses every layer's routed experts with one scheme, but these experts "
                   f"use {len(experts)} ({', '.join(sorted(_describe(s) for s in experts))}): it would compute "
                   "wrong logits")
    if model.quant.kv_cache is not None:
        out.append("transformers 5.24 emulates a kv_cache_scheme at another point than vLLM and qjax (which quantize "
                   "K after k_norm + RoPE, and V, with the stored scales): its logits differ from theirs")
    for shards in VLLM_FUSED:
        for i in sorted(by_kind.get(shards[0], {})):
            seen = {by_kind[k][i] for k in shards if k in by_kind}
            if len(seen) > 1:
                out.append(f"vLLM fuses {', '.join(shards)} into one layer and needs one scheme for them; layer {i} "
                           f"has {', '.join(sorted(_describe(s) for s in seen))}")
                break
    return out


def _describe(s: WeightScheme | None) -> str:
    if s is None:
        return "dense"
    if s.is_mxfp8:
        return "mxfp8"
    group = f"g{s.group_size}" if s.strategy == "group" else s.strategy
    return f"int{s.num_bits} {group}{'' if s.symmetric else ' asym'}"


EXPERTS = "mlp.experts"
EXPERTS_WORD = "experts"
# the per-expert projections transformers and vLLM name, and the stacked variable each lives in
EXPERT_PROJECTIONS = {"gate_proj": "mlp.experts.gate_up_proj", "up_proj": "mlp.experts.gate_up_proj",
                      "down_proj": "mlp.experts.down_proj"}


def _patterns(units: list[tuple[str, int | None]]) -> list[str]:
    """``re:`` patterns matching exactly the module kinds ``units`` ((kind, layer or None for every layer)), kinds
    under one parent merged as llmcompressor writes them (``re:.*self_attn\\.(q_proj|k_proj)$``).

    A routed-expert pattern also matches the fused ``mlp.experts`` module itself: transformers 5 has no per-expert
    modules, and compressed-tensors warns about a target that matches nothing (matching a module that is not a
    Linear quantizes nothing)."""
    merged: dict[tuple[str, int | None], list[str]] = {}
    for kind, layer in units:
        parent, _, leaf = kind.rpartition(".")
        merged.setdefault((parent, layer), []).append(leaf)
    out = []
    for (parent, layer), leaves in merged.items():
        where = "" if layer is None else rf"layers\.{layer}\."
        alt = leaves[0] if len(leaves) == 1 else "(" + "|".join(leaves) + ")"
        if parent == EXPERTS:
            out.append(rf"re:.*{where}mlp\.experts(\.\d+\.{alt})?$")
        else:
            prefix = re.escape(parent + ".") if parent else ""
            out.append(rf"re:.*{where}{prefix}{alt}$")
    return out


def save_pretrained(model, out_dir: str | os.PathLike, *, dtype=None, fused_experts: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                    extra_files: Iterable[str] = (), source: str | os.PathLike | None = None) -> str:
    """Write ``model`` to ``out_dir`` as config.json + generation_config.json + safetensors (+ index when sharded).

    Args:
      extra_files: paths copied into the folder as they are (tokenizer.json, tokenizer_config.json, …).
      overwrite: replace an existing ``out_dir`` (the old folder is removed only after the new one is complete).
      source: the checkpoint folder ``model`` was loaded from (``qjax quantize`` passes its ``--model``). Its parts
        kept unquantized (:mod:`qjax.quant.unquantized`: ``mtp.*``, ``model.visual.*``) are then copied as stored —
        same keys, dtypes and bytes — after checking the model still holds the same MTP head; a composite source
        (``text_config`` + ``vision_config``, text under ``model.language_model.``) gives a composite folder, so
        the vision tower stays loadable.
    Returns:
      ``out_dir`` as a string.
    """
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)

    def write(folder: str) -> None:
        with opened_source(source) as src:
            tensors = export_tensors(model, src, fused_experts=fused_experts, dtype=out_dtype)
            hf_cfg = hf_config(model, out_dtype, src)
            qc = quantization_config(model, kept=parts_held(k for k, _, _ in tensors))
            if qc is not None:
                hf_cfg["quantization_config"] = qc
                for limit in consumer_limits(model):
                    logger.warning("%s: %s", out_dir, limit)
            write_json(os.path.join(folder, "config.json"), hf_cfg)
            write_weights(folder, tensors, model=model, max_shard_bytes=max_shard_bytes, extra_files=extra_files)

    return write_atomically(out_dir, write, overwrite=overwrite)


def write_atomically(out_dir: str | os.PathLike, write: Callable[[str], None], *, overwrite: bool) -> str:
    """Run ``write(tmp)`` into a temporary folder next to ``out_dir`` and rename it into place when complete, so a
    failure leaves nothing behind; an existing ``out_dir`` is refused unless ``overwrite`` (then replaced only after
    the new folder is complete). Returns ``out_dir`` as an absolute path."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    clean_stale(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = new_folder(parent, f".{os.path.basename(out_dir)}.tmp-")
    try:
        try:
            write(tmp)
        except OSError as e:  # full disk, lost permission, …: say which file, and leave nothing behind
            # named where it was going to be (the temporary folder is removed below)
            name = f" ({e.filename.replace(tmp, out_dir)})" if isinstance(e.filename, str) else ""
            raise OSError(e.errno, f"writing {out_dir} failed{name}: {str(e.strerror or e).replace(tmp, out_dir)}") \
                from None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "previous"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def clean_stale(out_dir: str | os.PathLike) -> None:
    """Remove what a run killed during :func:`write_atomically` left next to ``out_dir``: its temporary folders
    (``.NAME.tmp-*``), and a previous ``out_dir`` moved aside (``.NAME.old-*/previous``) is put back when the new
    one never replaced it."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent, base = os.path.dirname(out_dir), os.path.basename(out_dir)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith(f".{base}.old-") and os.path.isdir(os.path.join(path, "previous")) \
                and not os.path.exists(out_dir):
            os.rename(os.path.join(path, "previous"), out_dir)
        if name.startswith((f".{base}.tmp-", f".{base}.old-")) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def preflight(out_dir: str | os.PathLike, need_bytes: int) -> None:
    """Fail now, not after loading and calibrating for an hour: ``out_dir``'s parent must be a folder this process
    can write (created when missing), with at least ``need_bytes`` free. Raises ``OSError`` naming the path."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(out_dir)}.probe-", dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OSError(e.errno, f"cannot write next to {out_dir} ({parent}): {e.strerror or e}") from None
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"{parent} has {free / 2**30:.2f} GiB free, but writing {out_dir} needs about "
                                    f"{need_bytes / 2**30:.2f} GiB")


def hf_config(model, out_dtype: np.dtype, source: Source | None = None) -> dict:
    """config.json of ``model`` (without quantization_config): ``qwen3_5_moe_text``, or — from a composite
    ``source`` — the source's own ``qwen3_5_moe`` config (vision config, token ids) with the model's text fields over
    its ``text_config`` (fields qjax does not model, such as ``mamba_ssm_dtype``, are kept); without a source, a
    model holding a vision tower gets a ``qwen3_5_moe`` config built from its own vision config."""
    hf_cfg = model.config.to_hf_dict()
    hf_cfg["dtype"] = out_dtype.name
    if getattr(model, "mtp", None) is not None:
        hf_cfg["mtp_num_hidden_layers"] = max(1, model.config.mtp_num_hidden_layers)
    if source is not None and source.composite:
        text = {**source.config["text_config"], **{k: v for k, v in hf_cfg.items() if k != "architectures"}}
        out = {k: v for k, v in source.config.items() if k != "quantization_config"}
        out.update(text_config=text, dtype=out_dtype.name)
        return out
    if source is None and getattr(model, "visual", None) is not None:  # the tower needs the composite config
        vision = model.vision_config
        text = {k: v for k, v in hf_cfg.items() if k != "architectures"}
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "text_config": text, "vision_config": vision.to_hf_dict(), **vision.token_ids,
                "tie_word_embeddings": model.config.tie_word_embeddings, "dtype": out_dtype.name}
    return hf_cfg


def generation_config(model) -> dict:
    """generation_config.json as ``save_pretrained`` writes it: only non-default warpers (transformers warns about
    top_k = 0 and friends)."""
    gc = getattr(model, "generation_config", None)
    gen: dict = {"do_sample": False}
    if gc is None:
        return gen
    gen["do_sample"] = gc.do_sample
    if gc.temperature != 1.0:
        gen["temperature"] = gc.temperature
    if gc.top_k:
        gen["top_k"] = gc.top_k
    if gc.top_p < 1.0:
        gen["top_p"] = gc.top_p
    if gc.eos_token_id:
        gen["eos_token_id"] = list(gc.eos_token_id)
    if gc.pad_token_id is not None:
        gen["pad_token_id"] = gc.pad_token_id
    return gen


def write_weights(folder: str, tensors: list[tuple[str, int, Callable]], *, model, max_shard_bytes: int,
                  extra_files: Iterable[str]) -> None:
    """generation_config.json, the safetensors shards of ``tensors`` ((key, bytes, get) — one shard on the host at a
    time) with their index when there are several, and ``extra_files`` copied as they are."""
    write_json(os.path.join(folder, "generation_config.json"), generation_config(model))
    plan: list[list[tuple[str, int, Callable]]] = [[]]
    size = 0
    for item in tensors:
        if plan[-1] and size + item[1] > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(item)
        size += item[1]
    n = len(plan)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, items in zip(names, plan):
        write_safetensors(os.path.join(folder, name), {k: get() for k, _, get in items}, metadata={"format": "pt"})
    if n > 1:
        weight_map = {k: name for name, items in zip(names, plan) for k, _, _ in items}
        write_json(os.path.join(folder, INDEX_FILE_NAME),
                    {"metadata": {"total_size": sum(b for _, b, _ in tensors)}, "weight_map": weight_map})
    for src in extra_files:
        shutil.copyfile(src, os.path.join(folder, os.path.basename(src)))


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
