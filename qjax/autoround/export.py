"""A streamed ``qjax quantize`` run's export: the quantized checkpoint assembled from the progress folder and the
source folder, written shard by shard without the quantized model (or the source model) ever being held.

The tensors are the ones a run on a loaded model writes (:func:`qjax.autoround.assemble.build_quantized_model`,
then the writers), from the same pieces through the same code:

* every quantized unit's compressed-tensors tensors (:func:`.assemble.quantized_entries`), each block's results
  read from its progress file when the writer first asks for one of its tensors (one block held at a time: the
  writers take keys in sorted order, and every key of layer ``i`` shares the prefix ``…layers.i.``);
* every other tensor of the text model — embeddings, norms, routers, GDN parameters, layers kept in the model
  dtype, the final norm and LM head — read from the source folder as stored when written, with the loader's value
  checks; a layer whose routed experts are quantized but stored fused in the source gets its dense projections
  per expert (slices of the memory-mapped tensor), the layout its packed ones have;
* the MTP head and the vision tower copied from the source by the writers themselves (``source=``), as always.

These entries become a model through :func:`qjax.checkpoint.loading.deferred_model` (the loader's checks,
transforms and casts, each tensor read only when written), which :func:`qjax.convert.save_pretrained` and
:func:`qjax.convert.autoround_writer.save_autoround` write as they write a loaded model — atomically, one shard on
the host at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np

from qjax.checkpoint.layout import EXPERT_STEM, text_prefix
from qjax.checkpoint.loading import deferred_model, verify_values
from qjax.checkpoint.view import Checkpoint, MemoryCheckpoint
from qjax.convert.autoround_writer import save_autoround
from qjax.convert.hf_writer import save_pretrained

from . import progress as prog
from .assemble import quantized_entries

LLM_COMPRESSOR, AUTO_ROUND = "llm_compressor", "auto_round"


def save_streamed(ar, source_dir: str, dirs: dict[str, str], *, overwrite: bool = False,
                  extra_files: Iterable[str] = (), tuning: dict | None = None, layer_config: dict | None = None) -> None:
    """Write the finished streamed run ``ar`` (:class:`~qjax.autoround.driver.AutoRound` on a
    :class:`~qjax.autoround.stream.FolderBlocks`) in each format of ``dirs`` (format → folder:
    ``llm_compressor`` or ``auto_round``), from its progress folder and ``source_dir``. ``tuning`` and
    ``layer_config``: what the auto_round format records (:func:`save_autoround`)."""
    if len(ar.reports) < ar.num_layers:
        raise RuntimeError(f"AutoRound: {len(ar.reports)} of {ar.num_layers} blocks are finished; run() first")
    ckpt = Checkpoint(source_dir)
    try:
        qmodel = quantized_model_view(ar, ckpt)
        for fmt, out in dirs.items():
            if fmt == LLM_COMPRESSOR:
                save_pretrained(qmodel, out, overwrite=overwrite, extra_files=extra_files, source=source_dir)
            else:
                save_autoround(qmodel, out, overwrite=overwrite, extra_files=extra_files, tuning=tuning,
                               layer_config=layer_config, source=source_dir)
    finally:
        ckpt.close()


def quantized_model_view(ar, ckpt: Checkpoint):
    """The quantized model of a finished streamed run as the writers see it (a
    :func:`~qjax.checkpoint.loading.deferred_model`): its tensors are read from the progress folder and ``ckpt``
    (the source, open while it is written) only when written."""
    prefix = text_prefix(ckpt.keys())
    read = functools.lru_cache(maxsize=1)(lambda i: prog.read_results(ar.progress_dir, i))
    # text keys under model. (the quantization config names modules so); the writers put them back under the
    # source's prefix (model.language_model. in a composite folder)
    qc, entries, quantized = quantized_entries(ar, read)
    merged = _source_entries(ckpt, prefix, quantized, ar.source.dtype)
    merged.update(entries)
    qmodel = deferred_model(ar.mcfg, qc, MemoryCheckpoint(ckpt.folder, merged), ar.source.dtype)
    qmodel.generation_config = ar.source.generation_config
    return qmodel


def _source_entries(ckpt: Checkpoint, prefix: str, quantized: set[str], dtype) -> dict[str, tuple]:
    """The source's tensors the export takes as stored (key → (shape, dtype, get)), text keys under ``model.``: all
    but the quantized modules' weights; fused routed experts of a layer with quantized experts are given per
    expert."""

    def own(key: str) -> str:  # the model.-relative module name the quantized set holds
        return "model." + key[len(prefix):] if key.startswith(prefix) else key

    def checked(key: str):
        arr = ckpt.get(key)
        verify_values(ckpt, key, arr, dtype=dtype)
        # a copy, and the file pages unmapped: the writer frees it with its shard, a mapped page would stay in RSS
        arr = np.array(arr)
        ckpt.drop_pages()
        return arr

    out: dict[str, tuple] = {}
    for key in ckpt.keys():
        shape, dtype_ = ckpt.shape(key), ckpt.dtype(key)
        m = EXPERT_STEM.match(key)
        fused = m is not None and not m.group(2)[0].isdigit()
        if fused and any(own(m.group(1)) + f"mlp.experts.0.{p}" in quantized for p in ("gate_proj", "up_proj",
                                                                                    "down_proj")):
            out.update(_per_expert(key, m.group(1), m.group(2), shape, dtype_, own, quantized, checked))
            continue
        if key.endswith(".weight") and own(key[: -len(".weight")]) in quantized:
            continue
        out[own(key)] = (shape, dtype_, functools.partial(checked, key))
    return out


def _per_expert(key: str, stem: str, which: str, shape: tuple, dtype: str, own, quantized: set[str],
                checked) -> dict[str, tuple]:
    """The dense (not quantized) projections of a fused expert tensor ``key`` as per-expert entries."""
    e_count = shape[0]
    full = functools.lru_cache(maxsize=1)(lambda: checked(key))  # one memory-mapped read for all experts
    if which == "gate_up_proj":
        half = shape[1] // 2
        parts = {"gate_proj": slice(0, half), "up_proj": slice(half, shape[1])}
        rows = (half, shape[2])
    else:
        parts = {"down_proj": slice(0, shape[1])}
        rows = (shape[1], shape[2])
    out = {}
    for proj, sl in parts.items():
        if own(stem) + f"mlp.experts.0.{proj}" in quantized:
            continue
        for e in range(e_count):
            out[f"{own(stem)}mlp.experts.{e}.{proj}.weight"] = (rows, dtype, lambda e=e, sl=sl: full()[e, sl])
    return out

