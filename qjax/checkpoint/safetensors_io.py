"""A small, zero-copy reader (and streaming writer) of the safetensors format.

Layout of a ``.safetensors`` file::

    [8 bytes]  N, little-endian u64: length of the header
    [N bytes]  UTF-8 JSON object: {"__metadata__": {str: str} (optional),
                                   "<name>": {"dtype": "BF16", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
    [rest]     the data buffer; ``data_offsets`` are relative to its start (byte 8 + N), row-major, little-endian

The reader memory-maps the file read-only and hands out numpy views straight onto the map, so a tensor costs no host
copy until something (e.g. ``jax.device_put``) actually reads it. The header is validated up front so that a corrupt
or truncated checkpoint fails at open time with a message naming the file and the tensor, not later as a segfault or
a silently wrong shape.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from qjax.validation import confined, open_regular, parse_json, read_json, replacing

__all__ = [
    "SafetensorsError",
    "SafetensorsFile",
    "read_index",
    "list_checkpoint_files",
    "checkpoint_index",
    "write_safetensors",
    "INDEX_FILE_NAME",
]

INDEX_FILE_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
METADATA_KEY = "__metadata__"

# The reference implementation refuses headers above 100 MB; a larger value is almost certainly garbage (e.g. a file
# that is not safetensors at all), and refusing it early avoids trying to decode gigabytes as JSON.
MAX_HEADER_BYTES = 100_000_000
# A header is an object of objects of lists: 3 levels. Checked on the raw bytes before parsing (see validation.py).
MAX_HEADER_DEPTH = 4


class SafetensorsError(ValueError):
    """A safetensors file, index or folder that cannot be read: the message names the path and, where one is
    involved, the tensor."""


def _build_dtype_table() -> dict[str, np.dtype]:
    table: dict[str, Any] = {
        "BOOL": np.bool_,
        "U8": np.uint8,
        "I8": np.int8,
        "U16": np.uint16,
        "I16": np.int16,
        "U32": np.uint32,
        "I32": np.int32,
        "U64": np.uint64,
        "I64": np.int64,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "F32": np.float32,
        "F64": np.float64,
        "C64": np.complex64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        # Older ml_dtypes lack the MX scale type; the raw exponent bytes are still useful as uint8.
        "F8_E8M0": getattr(ml_dtypes, "float8_e8m0fnu", np.uint8),
    }
    # Explicit little-endian: the format is little-endian regardless of the host.
    return {name: np.dtype(t).newbyteorder("<") for name, t in table.items()}


_DTYPES: dict[str, np.dtype] = _build_dtype_table()

# Reverse map for the writer. Without float8_e8m0fnu the F8_E8M0 entry is plain uint8, which must keep meaning "U8".
_DTYPE_NAMES: dict[np.dtype, str] = {}
for _name, _dt in _DTYPES.items():
    _DTYPE_NAMES.setdefault(_dt, _name)
_DTYPE_NAMES[np.dtype(np.uint8)] = "U8"
del _name, _dt


class SafetensorsFile:
    """A read-only, memory-mapped safetensors file.

    ``get(name)`` returns a read-only numpy array of shape ``shape(name)`` that aliases the map (no copy). Arrays
    handed out stay valid after ``close()``: the map itself is released once the last of them is garbage-collected.
    """

    path: str
    metadata: dict[str, str]

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.metadata = {}
        self._mmap: mmap.mmap | None = None
        # name -> (safetensors dtype, numpy dtype, shape, begin, end); begin/end are absolute file offsets.
        self._entries: dict[str, tuple[str, np.dtype, tuple[int, ...], int, int]] = {}
        try:
            # a regular file only (a FIFO would block open() forever), opened non-blocking (validation.py)
            with open_regular(self.path, what="a safetensors file", error=SafetensorsError) as f:
                file_size = os.fstat(f.fileno()).st_size
                if file_size < 8:
                    self._fail(f"file is {file_size} bytes, shorter than the 8-byte header length prefix")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > file_size - 8:
                    self._fail(f"header length {header_len} is larger than the file allows ({file_size - 8} bytes "
                               f"after the length prefix); the file is truncated or not safetensors")
                if header_len > MAX_HEADER_BYTES:
                    self._fail(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
                header_bytes = f.read(header_len)
                self._data_start = 8 + header_len
                self._parse_header(header_bytes, data_start=8 + header_len, file_size=file_size)
                # mmap cannot map an empty range, but the file is always >= 8 bytes here.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot open: {e}") from e

    # ---- header validation -------------------------------------------------------------------------------------
    def _fail(self, msg: str, tensor: str | None = None) -> NoReturn:
        where = f"{self.path}: tensor {tensor!r}: " if tensor is not None else f"{self.path}: "
        raise SafetensorsError(where + msg)

    def _parse_header(self, header_bytes: bytes, data_start: int, file_size: int) -> None:
        # the reference reader's order of checks: the header is a JSON object (starts with "{"), then its entries
        if not header_bytes.startswith(b"{"):
            self._fail("header does not start with '{': not a safetensors file")
        header = parse_json(header_bytes, f"{self.path}: header", error=SafetensorsError,
                            max_depth=MAX_HEADER_DEPTH, duplicate_keys=False)
        if not isinstance(header, dict):
            self._fail(f"header must be a JSON object, got {type(header).__name__}")

        data_size = file_size - data_start
        for name, info in header.items():
            if name == METADATA_KEY:
                self._parse_metadata(info)
                continue
            self._entries[name] = self._parse_entry(name, info, data_start, data_size, file_size)
        self._check_layout(data_size)

    def _parse_metadata(self, info: Any) -> None:
        if not isinstance(info, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in info.items()):
            self._fail(f"{METADATA_KEY!r} must be an object mapping str to str")
        self.metadata = dict(info)

    def _parse_entry(
        self, name: str, info: Any, data_start: int, data_size: int, file_size: int
    ) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
        if not isinstance(info, dict):
            self._fail("entry must be an object with dtype, shape and data_offsets", name)
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                self._fail(f"entry is missing {key!r}", name)

        dtype_str = info["dtype"]
        if not isinstance(dtype_str, str) or dtype_str not in _DTYPES:
            self._fail(f"unknown or unsupported dtype {dtype_str!r} (supported: {', '.join(_DTYPES)})", name)
        np_dtype = _DTYPES[dtype_str]

        shape = info["shape"]
        # bool is an int subclass in Python; JSON true/false in a shape is corruption, not a dimension.
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            self._fail(f"shape must be a list of integers, got {shape!r}", name)
        if any(d < 0 for d in shape):
            self._fail(f"shape {shape} has a negative dimension", name)

        offsets = info["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            self._fail(f"data_offsets must be two integers [begin, end], got {offsets!r}", name)
        begin, end = offsets
        if begin < 0 or begin > end:
            self._fail(f"data_offsets [{begin}, {end}] must satisfy 0 <= begin <= end", name)
        if end > data_size:
            self._fail(f"truncated: tensor {name} needs bytes up to {data_start + end} but the file has only "
                       f"{file_size}", name)

        # Python ints: a product of large dims must not wrap around as it would in int64.
        expected = math.prod(shape) * np_dtype.itemsize
        if end - begin != expected:
            self._fail(f"byte size {end - begin} (data_offsets [{begin}, {end}]) does not match shape {shape} x "
                       f"{dtype_str} ({np_dtype.itemsize} bytes/element) = {expected} bytes", name)
        return dtype_str, np_dtype, tuple(shape), data_start + begin, data_start + end

    def _check_layout(self, data_size: int) -> None:
        """The tensors tile the data buffer exactly, as the reference reader requires: in offset order each starts
        where the previous ends (no overlap, no gap) and the last ends at the end of the file (no trailing bytes)."""
        spans = sorted((b - self._data_start, e - self._data_start, n) for n, (_, _, _, b, e) in self._entries.items())
        end, prev = 0, None
        for b, e, n in spans:
            if b < end:
                self._fail(f"overlaps tensor {prev!r}: its bytes start at {b}, before {end} where that one ends", n)
            if b > end:
                self._fail(f"a gap of {b - end} unused bytes precedes it (data_offsets begin {b}, the previous "
                           f"tensor ends at {end}); the reference reader refuses such files", n)
            end, prev = e, n
        if end != data_size:
            self._fail(f"{data_size - end} trailing bytes after the last tensor (the data buffer is {data_size} "
                       f"bytes, the tensors cover {end}); the reference reader refuses such files")

    # ---- queries -----------------------------------------------------------------------------------------------
    def _entry(self, name: str) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def keys(self) -> list[str]:
        """Tensor names in header order (``__metadata__`` excluded)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def dtype(self, name: str) -> str:
        """The safetensors dtype string, e.g. ``"BF16"``."""
        return self._entry(name)[0]

    def nbytes(self, name: str) -> int:
        _, _, _, begin, end = self._entry(name)
        return end - begin

    def get(self, name: str) -> np.ndarray:
        """Read-only numpy view of tensor ``name`` with shape ``shape(name)``, aliasing the file map (no copy).

        The view may be unaligned (the format only guarantees byte alignment); numpy and ``jax.device_put`` handle
        that, at worst with one copy on transfer.
        """
        _, np_dtype, shape, begin, end = self._entry(name)
        if self._mmap is None:
            raise SafetensorsError(f"{self.path}: tensor {name!r}: file is closed")
        if end == begin:
            # Nothing to alias; frombuffer also rejects an offset at the very end of the buffer.
            arr = np.empty(shape, dtype=np_dtype)
        else:
            arr = np.frombuffer(self._mmap, dtype=np_dtype, count=math.prod(shape), offset=begin).reshape(shape)
        # ACCESS_READ maps are already non-writeable buffers; be explicit so the contract never depends on that.
        arr.flags.writeable = False
        return arr

    def drop_pages(self) -> None:
        """Unmap the pages read so far from this process (``MADV_DONTNEED``; they stay in the page cache and a later
        read maps them again). A read-only file map counts every page read in the process's resident size until it
        is unmapped: a run that reads a large checkpoint one part at a time calls this after each part to keep its
        resident size at one part, not the checkpoint."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the map. Views returned by ``get`` keep it alive until they are gone."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError:
            # Live numpy views still export the buffer; dropping our reference lets it unmap when they die.
            pass
        self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else "open"
        return f"SafetensorsFile({self.path!r}, {len(self._entries)} tensors, {state})"


# ---- checkpoint folders --------------------------------------------------------------------------------------------
def read_index(folder: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> shard file name (relative to ``folder``) from ``model.safetensors.index.json``'s weight_map.

    Every shard the index names must be a file inside ``folder`` (after symlinks): an absolute path, a ``../`` path or
    a link that leads elsewhere is refused before anything is opened (validation.confined)."""
    folder = os.fspath(folder)
    index_path = confined(folder, INDEX_FILE_NAME, what=folder, error=SafetensorsError)
    if not os.path.isfile(index_path):
        raise SafetensorsError(f"{index_path}: index file not found")
    index = read_json(index_path, error=SafetensorsError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index_path}: malformed index: expected an object with a 'weight_map' object")
    checked: dict[str, str] = {}
    for name, shard in weight_map.items():
        if shard not in checked:
            checked[shard] = confined(folder, shard, what=f"{index_path}: weight_map[{name!r}]",
                                      error=SafetensorsError)
    missing = sorted(s for s, path in checked.items() if not os.path.isfile(path))
    if missing:
        raise SafetensorsError(f"{index_path}: index lists shard file(s) that do not exist: {', '.join(missing)}")
    return dict(weight_map)


def list_checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """Safetensors file names (relative to ``folder``) making up the checkpoint, each checked to lie inside it — the
    one listing every reader of a folder goes through (the loader, ``qjax inspect``, compare's reference, the
    auto-round reader, exports copying a source's tensors).

    transformers' rule (5.24, ``modeling_utils._get_resolved_checkpoint_files``): ``model.safetensors`` when
    present, else the shards of ``model.safetensors.index.json``, else every ``*.safetensors``. A folder with both
    the single file and an index is one where transformers reads the single file and vLLM the index's shards, so
    the two must hold the same tensors (names, dtypes and shapes, from the headers); when they do not, the folder is
    refused naming both files rather than loading what one tool would and another would not.
    """
    folder = os.fspath(folder)
    if os.path.lexists(os.path.join(folder, SINGLE_FILE_NAME)):
        confined(folder, SINGLE_FILE_NAME, what=folder, error=SafetensorsError)
        if os.path.lexists(os.path.join(folder, INDEX_FILE_NAME)):
            _check_single_matches_index(folder)
        return [SINGLE_FILE_NAME]
    if os.path.lexists(os.path.join(folder, INDEX_FILE_NAME)):
        return sorted(set(read_index(folder).values()))
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    except OSError as e:
        raise SafetensorsError(f"{folder}: cannot list checkpoint folder: {e.strerror or e}") from None
    for n in names:
        confined(folder, n, what=folder, error=SafetensorsError)
    names = [n for n in names if os.path.isfile(os.path.join(folder, n))]
    if not names:
        raise SafetensorsError(f"{folder}: no *.safetensors files (and no {INDEX_FILE_NAME}) in checkpoint folder")
    return names


def checkpoint_index(folder: str | os.PathLike) -> dict[str, str] | None:
    """The weight map the checkpoint's files follow (:func:`read_index`), or None when :func:`list_checkpoint_files`
    reads no index (``model.safetensors`` wins over one, as in transformers)."""
    folder = os.fspath(folder)
    if os.path.lexists(os.path.join(folder, SINGLE_FILE_NAME)) or \
            not os.path.lexists(os.path.join(folder, INDEX_FILE_NAME)):
        return None
    return read_index(folder)


def _check_single_matches_index(folder: str) -> None:
    """``model.safetensors`` and the shards of ``model.safetensors.index.json`` hold the same tensors, with the same
    dtypes and shapes (headers only: no tensor data is read)."""
    shards = sorted(set(read_index(folder).values()))
    opened: list[SafetensorsFile] = []
    try:
        single = SafetensorsFile(os.path.join(folder, SINGLE_FILE_NAME))
        opened.append(single)
        theirs: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name in shards:
            f = SafetensorsFile(os.path.join(folder, name))
            opened.append(f)
            theirs.update({k: (f.dtype(k), f.shape(k), name) for k in f.keys()})
        mine = {k: (single.dtype(k), single.shape(k)) for k in single.keys()}
    finally:
        for f in opened:
            f.close()
    diff = None
    for k in sorted(set(mine) | set(theirs)):
        if k not in theirs:
            diff = f"{k!r} is in {SINGLE_FILE_NAME} only"
        elif k not in mine:
            diff = f"{k!r} is in the index's {theirs[k][2]} only"
        elif mine[k] != theirs[k][:2]:
            diff = (f"{k!r} is {mine[k][0]} {list(mine[k][1])} in {SINGLE_FILE_NAME} but {theirs[k][0]} "
                    f"{list(theirs[k][1])} in {theirs[k][2]}")
        if diff:
            break
    if diff:
        raise SafetensorsError(f"{folder}: both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME} are present and hold "
                               f"different tensors ({diff}); transformers loads {SINGLE_FILE_NAME}, vLLM the index's "
                               "shards: remove the one that is not this checkpoint")


# ---- writer --------------------------------------------------------------------------------------------------------
def dtype_name(dtype) -> str | None:
    """The safetensors name of a numpy/JAX dtype (``bfloat16`` → ``"BF16"``), or None when the format has none."""
    dtype = np.dtype(dtype)
    return _DTYPE_NAMES.get(dtype.newbyteorder("<") if dtype.byteorder in "<>=" else dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (``"BF16"`` → ``bfloat16``); KeyError for an unknown one."""
    return _DTYPES[name]


def _dtype_name(path: str, name: str, dtype: np.dtype) -> str:
    found = dtype_name(dtype)
    if found is None:
        raise SafetensorsError(f"{path}: tensor {name!r}: numpy dtype {dtype} has no safetensors equivalent")
    return found


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (name -> array of any shape) to ``path`` in safetensors format.

    Tensors are laid out in sorted-name order with contiguous offsets and streamed one at a time, so peak extra memory
    is one tensor (and only when it is non-contiguous or big-endian). The file is written to a temporary name and
    renamed, so a failure never leaves a half-written checkpoint under ``path``.
    """
    path = os.fspath(path)
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise SafetensorsError(f"{path}: metadata must map str to str; bad entries: {bad}")

    arrays: list[tuple[str, np.ndarray, str]] = []
    for name in sorted(tensors):
        if not isinstance(name, str) or name == METADATA_KEY:
            raise SafetensorsError(f"{path}: tensor {name!r}: invalid tensor name")
        arr = np.asarray(tensors[name])
        arrays.append((name, arr, _dtype_name(path, name, arr.dtype)))

    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    offset = 0
    for name, arr, dtype_str in arrays:
        header[name] = {"dtype": dtype_str, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # Like the reference writer: pad with spaces so the data buffer starts 8-byte aligned.
    header_bytes += b" " * (-len(header_bytes) % 8)

    # through a temporary file renamed into place; a failure (a full disk) removes it and names `path`
    with replacing(path) as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for _, arr, _ in arrays:
            if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            # A flat uint8 view of a C-contiguous array is free; ml_dtypes types don't export a buffer format
            # that file.write understands, uint8 does.
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)

