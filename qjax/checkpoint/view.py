"""Checkpoint views: what the loader reads tensors through. One protocol, three implementations side by side — a
folder of safetensors files on disk (:class:`Checkpoint`), tensors computed in memory (:class:`MemoryCheckpoint`:
RTN and AutoRound results), and an auto-round folder seen in compressed-tensors' layout
(:class:`qjax.checkpoint.auto_round.AutoRoundCheckpoint`, a MemoryCheckpoint over a Checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import numpy as np

from qjax.checkpoint.safetensors_io import (
    INDEX_FILE_NAME,
    SafetensorsError,
    SafetensorsFile,
    checkpoint_index,
    list_checkpoint_files,
)

# (shape on disk, safetensors dtype, a function that returns the array)
Entry = tuple[tuple[int, ...], str, Callable[[], np.ndarray]]


class CheckpointView(Protocol):
    """The tensors of a checkpoint by key; data is produced on demand, each tensor once per :meth:`get`."""

    folder: str  # named in every error message

    def keys(self) -> list[str]: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> str: ...
    def get(self, key: str) -> np.ndarray: ...
    def file_of(self, key: str) -> str: ...
    def close(self) -> None: ...


class Checkpoint:
    """The tensors of a HF checkpoint folder (headers only; data is read on demand)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        names = list_checkpoint_files(self.folder)
        self.files = []
        try:
            for name in names:
                self.files.append(SafetensorsFile(os.path.join(self.folder, name)))
            self.where = self._locate()
        except BaseException:
            self.close()
            raise

    def _locate(self) -> dict[str, SafetensorsFile]:
        """tensor → its file. A tensor stored twice, or not where the index says, is an error: which copy a reader
        takes would otherwise depend on its file order."""
        where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for k in f.keys():
                if k in where:
                    raise SafetensorsError(f"{self.folder}: tensor {k!r} is stored twice, in "
                                           f"{os.path.basename(where[k].path)} and {os.path.basename(f.path)}")
                where[k] = f
        index = checkpoint_index(self.folder)  # None: model.safetensors is read (it wins over an index)
        if index is not None:
            for k, shard in index.items():
                if k not in where:
                    raise SafetensorsError(f"{self.folder}: {INDEX_FILE_NAME} maps tensor {k!r} to {shard}, which "
                                           "does not hold it")
                if os.path.normpath(shard) != os.path.normpath(os.path.relpath(where[k].path, self.folder)):
                    raise SafetensorsError(f"{self.folder}: {INDEX_FILE_NAME} maps tensor {k!r} to {shard}, but it "
                                           f"is stored in {os.path.basename(where[k].path)}")
            unlisted = [k for k in where if k not in index]
            if unlisted:
                raise SafetensorsError(f"{self.folder}: {len(unlisted)} tensor(s) stored in the shards are not in "
                                       f"{INDEX_FILE_NAME}, e.g. {unlisted[0]!r} in "
                                       f"{os.path.basename(where[unlisted[0]].path)}")
        return where

    def keys(self) -> list[str]:
        """All tensor names, file by file in on-disk order."""
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.where[key].shape(key))

    def dtype(self, key: str) -> str:
        return self.where[key].dtype(key)

    def get(self, key: str) -> np.ndarray:
        return self.where[key].get(key)

    def file_of(self, key: str) -> str:
        return os.path.basename(self.where[key].path)

    def drop_pages(self) -> None:
        """Unmap every page read so far (:meth:`SafetensorsFile.drop_pages`): a caller reading the checkpoint part by
        part keeps its resident size at one part."""
        for f in self.files:
            f.drop_pages()

    def close(self) -> None:
        for f in self.files:
            f.close()


class MemoryCheckpoint:
    """A view whose tensors are computed on demand: ``entries`` maps each key to ``(shape, safetensors dtype, get)``
    (RTN's and AutoRound's quantized models, auto-round folders converted to compressed-tensors' layout)."""

    def __init__(self, folder: str, entries: dict[str, Entry]):
        self.folder = folder
        self.entries = entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][0]

    def dtype(self, key: str) -> str:
        return self.entries[key][1]

    def get(self, key: str) -> np.ndarray:
        return self.entries[key][2]()

    def file_of(self, key: str) -> str:
        return "<memory>"

    def close(self) -> None:
        pass
