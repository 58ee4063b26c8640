"""Write a qjax model as a Hugging Face checkpoint folder (``qwen3_5_moe_text``) that transformers and qjax load.

Key names come from :func:`qjax.checkpoint.layout.expected_tensors` — the loader's own map, read backwards — so writer
and loader cannot drift. The folder is written next to the target under a temporary name and renamed at the end: a
failed or interrupted write never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

import numpy as np

from qjax.checkpoint.layout import checkpoint_tensors
from qjax.checkpoint.safetensors_io import INDEX_FILE_NAME, write_safetensors
from qjax.model.linears import layer_linears
from qjax.quant.config import KVCacheScheme, QuantizationConfig, WeightScheme

DEFAULT_SHARD_BYTES = 2 * 1024**3


def quantization_config(model) -> dict | None:
    """The compressed-tensors ``quantization_config`` of a quantized model: one config group per distinct scheme
    with explicit module names as targets (exact, as auto-round writes them), dense linears in ``ignore``."""
    quant = getattr(model, "quant", None)
    if quant is None:
        return None
    cfg = model.config
    groups: dict[WeightScheme, list[str]] = {}
    ignore: list[str] = []
    for i, kind in enumerate(cfg.layer_types):
        stem = f"model.layers.{i}."
        metas = quant.layer(i)
        for rel in layer_linears(cfg, kind):
            if rel in metas:
                groups.setdefault(_scheme(metas[rel]), []).append(stem + rel)
            else:
                ignore.append(stem + rel)
        # either side of the stacked experts may be dense (not listed: targets are explicit module names)
        if "mlp.experts.gate_up_proj" in metas:
            sch = _scheme(metas["mlp.experts.gate_up_proj"])
            for e in range(cfg.num_experts):
                groups.setdefault(sch, []).extend(f"{stem}mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj"))
        if "mlp.experts.down_proj" in metas:
            dn = _scheme(metas["mlp.experts.down_proj"])
            groups.setdefault(dn, []).extend(f"{stem}mlp.experts.{e}.down_proj" for e in range(cfg.num_experts))
    if quant.lm_head is not None:
        groups.setdefault(_scheme(quant.lm_head), []).append("lm_head")
    else:
        ignore.append("lm_head")
    kv = None if quant.kv_cache is None else KVCacheScheme(num_bits=8, type="float", strategy=quant.kv_cache)
    qc = QuantizationConfig(groups=tuple((f"group_{i}", tuple(names), sch) for i, (sch, names) in
                                         enumerate(groups.items())), ignore=tuple(ignore), kv_cache=kv)
    return qc.to_dict()


def _scheme(meta) -> WeightScheme:
    if meta.fmt == "mxfp8":
        return WeightScheme(format="mxfp8-quantized", num_bits=8, type="float", symmetric=True, strategy="group",
                            group_size=32, scale_dtype="uint8")
    return WeightScheme(format="pack-quantized", num_bits=meta.bits, type="int", symmetric=meta.symmetric,
                        strategy=meta.strategy, group_size=meta.group_size if meta.strategy == "group" else None,
                        scale_dtype=meta.scale_dtype)


def save_pretrained(model, out_dir: str | os.PathLike, *, dtype=None, fused_experts: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                    extra_files: Iterable[str] = ()) -> str:
    """Write ``model`` to ``out_dir`` as config.json + generation_config.json + safetensors (+ index when sharded).

    Args:
      extra_files: paths copied into the folder as they are (tokenizer.json, tokenizer_config.json, …).
      overwrite: replace an existing ``out_dir`` (the old folder is removed only after the new one is complete).
    Returns:
      ``out_dir`` as a string.
    """
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.dtype)

    def write(folder: str) -> None:
        hf_cfg = hf_config(model, out_dtype)
        qc = quantization_config(model)
        if qc is not None:
            hf_cfg["quantization_config"] = qc
        write_json(os.path.join(folder, "config.json"), hf_cfg)
        write_weights(folder, checkpoint_tensors(model, fused_experts=fused_experts, dtype=out_dtype),
                      model=model, max_shard_bytes=max_shard_bytes, extra_files=extra_files)

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
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        try:
            write(tmp)
        except OSError as e:  # full disk, lost permission, …: say which folder, and leave nothing behind
            raise OSError(e.errno, f"writing {out_dir} failed: {e.strerror or e}", e.filename) from None
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


def hf_config(model, out_dtype: np.dtype) -> dict:
    """config.json of ``model`` (without quantization_config)."""
    hf_cfg = model.config.to_hf_dict()
    hf_cfg["dtype"] = out_dtype.name
    if getattr(model, "mtp", None) is not None:
        hf_cfg["mtp_num_hidden_layers"] = max(1, model.config.mtp_num_hidden_layers)
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
