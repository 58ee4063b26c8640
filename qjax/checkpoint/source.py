"""What an export takes from the checkpoint its model was loaded from: the parts kept unquantized
(:mod:`qjax.quant.unquantized`: the MTP head, the vision tower) as stored, and the layout that holds them.

The seeds carry ``mtp.*`` and ``model.visual.*`` in BF16 next to a quantized body; an export copies those tensors
byte for byte (same keys — a Qwen3.6 MTP head's fused experts stay fused —, dtypes and bytes) rather than writing
them from the model: the model never holds the vision tower, and may compute in another dtype than the source stores.
A copy is only right while the model still holds what it loaded, so the MTP head is compared with the model's first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import numpy as np

from qjax.checkpoint import layout
from qjax.checkpoint.view import Checkpoint
from qjax.model.config import read_config
from qjax.quant.unquantized import KeptPart, kept_part

Item = tuple[str, int, Callable[[], np.ndarray]]  # (key, bytes on disk, get)


@dataclasses.dataclass(frozen=True)
class Source:
    """A source checkpoint folder, open for reading (close it with :meth:`close`)."""

    ckpt: Checkpoint
    config: dict  # its config.json, as read

    @property
    def composite(self) -> bool:
        """A ``qwen3_5_moe`` config (``text_config`` + ``vision_config``), as the official releases have."""
        return isinstance(self.config.get("text_config"), dict)

    @property
    def text_prefix(self) -> str:
        return layout.text_prefix(self.ckpt.keys())

    @property
    def kept_keys(self) -> list[str]:
        """Its tensors of the parts kept unquantized, in on-disk order."""
        return [k for k in self.ckpt.keys() if kept_part(k) is not None]

    def close(self) -> None:
        self.ckpt.close()


def open_source(folder: str | os.PathLike) -> Source:
    """The checkpoint in ``folder`` (headers and config.json only; tensors are read when written)."""
    _, raw = read_config(os.fspath(folder))
    return Source(Checkpoint(folder), raw)


@contextlib.contextmanager
def opened_source(folder: str | os.PathLike | None) -> Iterator[Source | None]:
    """The source of an export, open while the export is written (None: no source)."""
    if folder is None:
        yield None
        return
    src = open_source(folder)
    try:
        yield src
    finally:
        src.close()


def export_prefix(model, source: Source | None) -> str:
    """Where an export of ``model`` puts its text weights: the source's prefix; without a source
    ``model.language_model.`` when the model holds a vision tower (a composite folder, as the official releases),
    else ``model.`` (a text-only one)."""
    if source is not None:
        return source.text_prefix
    return "model.language_model." if getattr(model, "visual", None) is not None else "model."


def export_tensors(model, source: Source | None, *, fused_experts: bool = False, dtype=None) -> list[Item]:
    """Every tensor of an export of ``model`` as ``(key, bytes, get)``, sorted by key: the model's own
    (:func:`~qjax.checkpoint.layout.checkpoint_tensors`, under the source's text prefix), except that each kept
    part the source has is the source's, as stored.

    Raises:
      ValueError: the model holds other values for a kept part than the source stores (its MTP head was changed
        after loading: write it without a source).
    """
    prefix = export_prefix(model, source)
    own = layout.checkpoint_tensors(model, fused_experts=fused_experts, dtype=dtype, text_prefix=prefix)
    if source is None:
        return own
    copied = source.kept_keys
    parts = {kept_part(k) for k in copied}
    for part in parts:
        _check_same(model, source, part, [k for k in copied if part.holds(k)])
    where = source.ckpt.where
    items = [item for item in own if kept_part(item[0]) not in parts]
    items += [(k, where[k].nbytes(k), (lambda k=k: source.ckpt.get(k))) for k in copied]
    return sorted(items, key=lambda it: it[0])


def _check_same(model, source: Source, part: KeptPart, keys: list[str]) -> None:
    """What the model holds of ``part`` (the MTP head; never the vision tower) equals the source's ``keys`` after
    the cast the loader made: the same tensors in the source's expert layout, and the same values."""
    mine = {k: get for k, _, get in layout.checkpoint_tensors(model, dtype=model.dtype,
                                                              fused_experts=layout.expert_layouts(source.ckpt.keys()),
                                                              text_prefix=source.text_prefix)
            if part.holds(k)}
    if not mine:
        return
    folder = source.ckpt.folder
    packed = [k for k in keys if k.endswith(".weight_packed") or source.ckpt.dtype(k) == "F8_E4M3"]
    if packed:  # qjax decoded it at load (qjax.checkpoint.dense_mtp); a copy would contradict the written config
        raise ValueError(f"{folder} stores {part.what} quantized ({packed[0]}), which the export lists as "
                         "unquantized; write the model without a source to export the head as qjax holds it")
    if set(mine) != set(keys):
        diff = sorted(set(mine) ^ set(keys))
        raise ValueError(f"{part.what} of the model has other tensors than {folder}'s (e.g. {diff[0]}): the "
                         "model was not loaded from this source")
    for k in keys:
        want = mine[k]()
        have = np.asarray(source.ckpt.get(k)).astype(want.dtype)
        if not np.array_equal(have, want):
            raise ValueError(f"{k}: {part.what} of the model differs from {folder}'s (changed after loading?); "
                             "write the model without a source to export its own")
