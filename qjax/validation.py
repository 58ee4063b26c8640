"""Untrusted input, checked in one place: checkpoint folders come from the internet.

Three things every reader of a checkpoint folder goes through:

- :func:`confined` — a file that a folder's own files name (an index's shard, a template file) or that a listing
  finds must resolve, after symlinks, inside that folder; anything else is refused *before* it is opened, and the
  message never echoes what the outside file holds or how big it is. A Hugging Face cache snapshot
  (``models--org--name/snapshots/<rev>/``) links its files to ``../../blobs/``: that ``blobs`` folder counts as
  inside.
- :func:`read_json` — a JSON file read with a size bound and a nesting bound checked on the raw bytes *before*
  parsing (Python's parser recurses: 100,000 nested brackets would be a ``RecursionError``), strict UTF-8, and a
  one-line error naming the file and the position.
- :class:`Fields` — a JSON object's fields read by type and range (``must be a positive integer, got "sixty-four"``):
  booleans that are booleans, integers that are not booleans, finite floats, strings among the allowed ones.

Every error is a ``ValueError`` subclass chosen by the caller (``ConfigError``, ``SafetensorsError``, …), so the
command line reports it as one ``error: …`` line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["confined", "trusted_roots", "read_json", "json_depth", "Fields", "REQUIRED", "MAX_JSON_BYTES",
           "MAX_JSON_DEPTH", "show"]

# config.json, generation_config.json, tokenizer_config.json and indexes are kilobytes to a few megabytes (the 35B
# index: 3 MB); tokenizer.json is ~11 MB. A larger "JSON" file in a checkpoint folder is not one we should parse.
MAX_JSON_BYTES = 64 << 20
# The deepest real file we know nests 6 levels (tokenizer.json's normalizer/pre_tokenizer sequences).
MAX_JSON_DEPTH = 64

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def show(value: Any, limit: int = 60) -> str:
    """``repr`` of a bad value, cut to ``limit`` characters (a field can hold a megabyte of garbage)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---------------------------------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------------------------------
def trusted_roots(folder: str | os.PathLike) -> tuple[str, ...]:
    """The real folders whose files a checkpoint ``folder`` may use: itself, and the ``blobs`` folder of a Hugging
    Face cache repository when ``folder`` is one of its snapshots."""
    root = os.path.realpath(os.fspath(folder))
    roots = [root]
    snaps = os.path.dirname(root)
    repo = os.path.dirname(snaps)
    if os.path.basename(snaps) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.join(repo, "blobs"))
    return tuple(roots)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def confined(folder: str | os.PathLike, name: str, *, what: str, error: type[Exception] = ValueError) -> str:
    """``folder/name`` for a relative file name found in or named by ``folder``'s files, checked to lie, after
    symlinks, inside ``folder`` (see :func:`trusted_roots`); raises ``error`` naming ``what`` (e.g. the index file and
    its entry) otherwise. Nothing outside is opened, and its size or contents are never reported."""
    folder = os.fspath(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{what}: {show(name)} is not a file name")
    if os.path.isabs(name):
        raise error(f"{what}: {show(name)} is an absolute path; a checkpoint may only name files inside its folder "
                    f"{folder}")
    path = os.path.join(folder, name)
    if not _inside(os.path.realpath(path), trusted_roots(folder)):
        raise error(f"{what}: {show(name)} resolves outside the checkpoint folder {folder}; refused")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------------------------------
def json_depth(data: bytes) -> int:
    """Deepest bracket nesting of JSON text ``data`` (brackets inside strings do not count); linear time, no
    recursion."""
    if b"[" not in data and b"{" not in data:
        return 0
    stripped = _STRING.sub(b'""', data)
    a = np.frombuffer(stripped, np.uint8)
    step = np.zeros(a.shape, np.int32)
    step[(a == ord("{")) | (a == ord("["))] = 1
    step[(a == ord("}")) | (a == ord("]"))] = -1
    return int(np.cumsum(step).max(initial=0))


def parse_json(data: bytes, where: str, *, error: type[Exception] = ValueError, max_depth: int = MAX_JSON_DEPTH,
               duplicate_keys: bool = True) -> Any:
    """Parse JSON bytes from ``where`` (a file name, or a file and a part of it), refusing non-UTF-8 text, nesting
    deeper than ``max_depth`` and, unless ``duplicate_keys``, an object with a key twice."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    depth = json_depth(data)
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} levels deep (the limit is {max_depth})")

    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise error(f"{where}: duplicate key {show(k) if len(k) > 60 else repr(k)} in one object")
            out[k] = v
        return out

    try:
        return json.loads(text, object_pairs_hook=None if duplicate_keys else pairs)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def read_json(path: str | os.PathLike, *, error: type[Exception] = ValueError, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH, expect: type | None = dict) -> Any:
    """The JSON value in file ``path`` (whose place the caller has checked, see :func:`confined`), read with the
    bounds above; ``expect``: the type the top level must have (None: any)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than the {max_bytes}-byte limit for a JSON file")
    value = parse_json(data, path, error=error, max_depth=max_depth)
    if expect is not None and not isinstance(value, expect):
        kind = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise error(f"{path}: must be {kind}, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object"), (type(None), "null")):
        if isinstance(value, t):
            return name
    return type(value).__name__


# ---------------------------------------------------------------------------------------------------------------------
# typed fields
# ---------------------------------------------------------------------------------------------------------------------
class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class Fields:
    """Read the fields of a JSON object by type and range; every error is ``error(f"{where}: field 'x' must be …,
    got …")``. A field that is absent or ``null`` takes its ``default`` (``REQUIRED``: an error)."""

    def __init__(self, raw: Mapping[str, Any], where: str, error: type[Exception] = ValueError):
        if not isinstance(raw, Mapping):
            raise error(f"{where}: must be a JSON object, got {_json_type(raw)}")
        self.raw, self.where, self.error = raw, where, error

    def fail(self, name: str, want: str, value: Any) -> None:
        raise self.error(f"{self.where}: field {name!r} must be {want}, got {show(value)}")

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def _get(self, name: str, default: Any) -> tuple[bool, Any]:
        value = self.raw.get(name)
        if value is None:
            if default is REQUIRED:
                raise self.error(f"{self.where}: required field {name!r} is missing")
            return False, default
        return True, value

    def int(self, name: str, default: Any = REQUIRED, *, min: int | None = None, max: int | None = None) -> Any:
        found, v = self._get(name, default)
        if not found:
            return v
        return self.check_int(name, v, min=min, max=max)

    def check_int(self, name: str, v: Any, *, min: int | None = None, max: int | None = None) -> int:
        want = ("a positive integer" if min == 1 else "a non-negative integer" if min == 0
                else f"an integer ≥ {min}" if min is not None else "an integer")
        if max is not None:
            want += f" ≤ {max}"
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(name, want, v)
        if (min is not None and v < min) or (max is not None and v > max):
            self.fail(name, want, v)
        return int(v)

    def float(self, name: str, default: Any = REQUIRED, *, min: float | None = None, max: float | None = None,
              positive: bool = False) -> Any:
        found, v = self._get(name, default)
        if not found:
            return v
        want = "a positive number" if positive else "a finite number"
        if min is not None:
            want += f" ≥ {min}"
        if max is not None:
            want += f" ≤ {max}"
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            self.fail(name, want, v)
        if (positive and v <= 0) or (min is not None and v < min) or (max is not None and v > max):
            self.fail(name, want, v)
        return float(v)

    def bool(self, name: str, default: Any = REQUIRED) -> Any:
        found, v = self._get(name, default)
        if found and not isinstance(v, bool):
            self.fail(name, "true or false", v)
        return v

    def str(self, name: str, default: Any = REQUIRED, *, choices: tuple[str, ...] | None = None) -> Any:
        found, v = self._get(name, default)
        if not found:
            return v
        if not isinstance(v, str) or (choices is not None and v not in choices):
            self.fail(name, "one of " + ", ".join(map(repr, choices)) if choices else "a string", v)
        return v

    def obj(self, name: str, default: Any = REQUIRED) -> Any:
        found, v = self._get(name, default)
        if found and not isinstance(v, Mapping):
            self.fail(name, "a JSON object", v)
        return v

    def sub(self, name: str, *, required: bool = False) -> "Fields":
        """The fields of the object-valued field ``name`` (absent: an empty object, unless ``required``)."""
        v = self.obj(name, REQUIRED if required else {})
        return Fields(v, f"{self.where}: {name}", self.error)

    def int_list(self, name: str, default: Any = REQUIRED, *, min: int | None = None, length: int | None = None,
                 scalar: bool = False) -> Any:
        """A list of integers (``scalar``: a lone integer is a list of one)."""
        found, v = self._get(name, default)
        if not found:
            return v
        if scalar and isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        want = f"a list of {length} integers" if length is not None else "a list of integers"
        if not isinstance(v, list) or (length is not None and len(v) != length):
            self.fail(name, want, v)
        for x in v:
            if not isinstance(x, int) or isinstance(x, bool) or (min is not None and x < min):
                self.fail(name, want + (f" ≥ {min}" if min is not None else ""), v)
        return [int(x) for x in v]

    def str_list(self, name: str, default: Any = REQUIRED, *, choices: tuple[str, ...] | None = None) -> Any:
        found, v = self._get(name, default)
        if not found:
            return v
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            self.fail(name, "a list of strings", v)
        if choices is not None:
            bad = [x for x in v if x not in choices]
            if bad:
                self.fail(name, "a list of " + " / ".join(map(repr, choices)), bad[0])
        return list(v)
