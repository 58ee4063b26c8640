"""Untrusted input, checked in one place: checkpoint folders come from the internet.

What every reader of a checkpoint folder goes through:

- :func:`confined` — a file that a folder's own files name (an index's shard, a template file) or that a listing
  finds must resolve, after symlinks, inside that folder; anything else is refused *before* it is opened, and the
  message never echoes what the outside file holds or how big it is. A Hugging Face cache snapshot
  (``models--org--name/snapshots/<rev>/``) links its files to ``../../blobs/``: that ``blobs`` folder counts as
  inside.
- :func:`open_regular` / :func:`read_regular` — a file is opened only when it is a regular file (a FIFO named
  ``generation_config.json`` would block ``open`` forever; a device or a socket is no checkpoint file) of at most the
  size its kind allows, checked with ``stat`` before it is opened and with ``fstat`` after (opened non-blocking,
  so a file swapped for a FIFO in between cannot hang the reader either).
- :func:`read_json` — a JSON file read with a size bound and a nesting bound checked on the raw bytes *before*
  parsing (Python's parser recurses: 100,000 nested brackets would be a ``RecursionError``), strict UTF-8, and a
  one-line error naming the file and the position.
- :class:`Fields` — a JSON object's fields read by type and range (``must be a positive integer, got "sixty-four"``):
  booleans that are booleans, integers that are not booleans, finite floats, strings among the allowed ones.
- :func:`compile_pattern` — a regular expression a file holds (``quantization_config`` targets, auto-round's
  ``extra_config`` keys), matched by RE2 in time linear in the name's length, never by Python's backtracking engine.

And one for what qjax writes: :func:`replacing` — a file written under a temporary name and renamed over its own
name when whole; a failure (a full disk) removes the temporary file and is an ``OSError`` naming the file.

Every error is a ``ValueError`` subclass chosen by the caller (``ConfigError``, ``SafetensorsError``, …), so the
command line reports it as one ``error: …`` line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import warnings
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy as np
import re2

__all__ = ["confined", "trusted_roots", "open_regular", "read_regular", "new_folder", "read_json", "json_depth",
           "Fields", "REQUIRED", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_TOKENIZER_BYTES", "MAX_TOKEN_ID",
           "MAX_PATTERN_CHARS", "compile_pattern", "replacing", "show"]

# config.json, generation_config.json, tokenizer_config.json and indexes are kilobytes to a few megabytes (the 35B
# index: 3 MB); tokenizer.json is ~11 MB. A larger "JSON" file in a checkpoint folder is not one we should parse.
MAX_JSON_BYTES = 64 << 20
# The deepest real file we know nests 6 levels (tokenizer.json's normalizer/pre_tokenizer sequences).
MAX_JSON_DEPTH = 64
# tokenizer.json: the `tokenizers` library holds ~6x the file while it parses (a 350 MB file took 2.25 GB); the
# Qwen3.6 one is ~11 MB.
MAX_TOKENIZER_BYTES = 64 << 20
# A token id where no vocabulary is known yet (generation_config.json read alone): int32, as every consumer holds ids.
MAX_TOKEN_ID = (1 << 31) - 1
# A target / ignore pattern names a module kind (``re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$``): tens of characters.
MAX_PATTERN_CHARS = 4096

# a JSON string literal, written as an unrolled loop: a run of plain characters at a time (the alternation
# ``(?:[^"\\]|\\.)*`` takes a regex step per character, 6 s for a 30 MB string; this, 0.25 s)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


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
# files
# ---------------------------------------------------------------------------------------------------------------------
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(st: os.stat_result, head: str, what: str, max_bytes: int | None) -> str | None:
    """Why a file with status ``st`` may not be read as ``what`` (None: it may)."""
    if stat.S_ISREG(st.st_mode):
        if max_bytes is not None and st.st_size > max_bytes:
            return f"{head} is {st.st_size} bytes, over the limit of {max_bytes} bytes for {what}"
        return None
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
    if stat.S_ISDIR(st.st_mode):
        return f"{head} is a directory, not {what}"
    return f"{head} is not a regular file ({kind}); {what} is read only from a regular file"


def open_regular(path: str | os.PathLike, *, what: str, max_bytes: int | None = None,
                 error: type[Exception] = ValueError, where: str | None = None) -> IO[bytes]:
    """``path`` opened for binary reading — only when it is a regular file of at most ``max_bytes`` bytes (None: any
    size). ``what`` names the kind of file in the message ("a JSON file", "an image file"); ``where`` (e.g. the
    command-line option) starts it, else the path does. Raises ``error`` (one line naming the path) otherwise.

    The status is checked before opening — opening a FIFO blocks until a writer comes, opening a device can act
    on it — and again on the open descriptor, which is opened non-blocking so that a FIFO swapped in between
    returns at once instead of hanging (``O_NONBLOCK`` changes nothing for a regular file's reads)."""
    path = os.fspath(path)
    head = f"{where}: {path}" if where else path
    if "\x00" in path:
        raise error(f"{where or path}: {show(path)} is not a file name")
    try:
        why = _not_regular(os.stat(path), head, what, max_bytes)
        if why is not None:
            raise error(why)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(f"{where}: no such file: {path}" if where else f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{where}: cannot read {path}: {e.strerror or e}" if where
                    else f"{path}: cannot read ({e.strerror or e})") from None
    try:
        why = _not_regular(os.fstat(fd), head, what, max_bytes)
        if why is not None:
            raise error(why)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, *, what: str, max_bytes: int, error: type[Exception] = ValueError,
                 where: str | None = None) -> bytes:
    """The bytes of ``path`` through :func:`open_regular`; a file that grew past ``max_bytes`` since its status was
    read is refused too (at most ``max_bytes + 1`` bytes are read)."""
    path = os.fspath(path)
    with open_regular(path, what=what, max_bytes=max_bytes, error=error, where=where) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise error(f"{where}: cannot read {path}: {e.strerror or e}" if where
                        else f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{f'{where}: ' if where else ''}{path} is over the limit of {max_bytes} bytes for {what}")
    return data


def _new_temporary(folder: str, name: str) -> tuple[int, str]:
    """A new file ``folder/.name.<random>.tmp`` opened for writing, with the permissions the umask gives (mkstemp's
    0600 would make every written checkpoint file private)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name for {name} in {folder}")


def new_folder(parent: str, prefix: str) -> str:
    """A new empty folder ``parent/<prefix><random>`` with the permissions the umask gives (0755 under umask 022):
    ``tempfile.mkdtemp``'s 0700 would make a folder renamed into place unreadable to every other user, who then
    cannot serve the checkpoint written into it."""
    for _ in range(100):
        path = os.path.join(parent, f"{prefix}{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary folder name {prefix}* in {parent}")


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A file object to write ``path`` through: a temporary file next to it, renamed over ``path`` once the block
    ends without an error, so a reader (or a resumed run) sees the old file or the whole new one. On any failure the
    temporary file is removed (a full disk must not leave a 0-byte ``.tmp`` behind), and an ``OSError`` is re-raised
    as one naming ``path`` (``[Errno 28] cannot write PATH: No space left on device``)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = _new_temporary(folder, name)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise OSError(e.errno or errno.EIO, f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


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
    opening = (a == ord("{")) | (a == ord("["))
    brackets = np.flatnonzero(opening | (a == ord("}")) | (a == ord("]")))  # only they move the depth
    step = np.where(opening[brackets], 1, -1).astype(np.int32)
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
    data = read_regular(path, what="a JSON file", max_bytes=max_bytes, error=error)
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

    def int_list(self, name: str, default: Any = REQUIRED, *, min: int | None = None, max: int | None = None,
                 length: int | None = None, scalar: bool = False) -> Any:
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
            if not isinstance(x, int) or isinstance(x, bool) or (min is not None and x < min) \
                    or (max is not None and x > max):
                bounds = (f" from {min} to {max}" if min is not None and max is not None else
                          f" ≥ {min}" if min is not None else f" ≤ {max}" if max is not None else "")
                self.fail(name, want + bounds, v)
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


# ---------------------------------------------------------------------------------------------------------------------
# regular expressions
# ---------------------------------------------------------------------------------------------------------------------
# Patterns from a file are matched by RE2 (google-re2): time linear in the name's length, whatever the pattern —
# Python's backtracking engine takes exponential time on `re:(a+)+$` against a long module name, and a size bound
# alone cannot tell such patterns from good ones. The pattern must first be valid Python syntax (what the producers,
# compressed-tensors (`re.match`) and auto-round (`re.search`), compile), so RE2 only decides how it runs; where the
# same text means something else to RE2 it is rewritten or refused, never silently read otherwise:
#   - `\Z` (Python: end of string) is RE2's `\z`; Python 3.11's `x{,n}` (0 to n) is written `x{0,n}` for RE2, which
#     would read `{,n}` as literal text;
#   - `[:…:]`, `[=…=]`, `[.….]` inside a class are POSIX classes to RE2 but literal characters to Python: refused;
#   - backreferences, lookarounds, atomic groups, possessive repeats, `(?x)` and the like have no linear-time
#     match: RE2 refuses them, and so does qjax, naming the field and the pattern;
#   - the classes `\d \w \s \b` are Unicode in Python and ASCII in RE2, and Python's `$` also matches before a final
#     newline: the strings matched are module names qjax builds from config.json (ASCII, no newline), where the two
#     engines agree.
# RE2 bounds a compiled program's memory itself (`max_mem`, 8 MiB by default: "pattern too large"), and a pattern
# longer than MAX_PATTERN_CHARS is refused before either engine sees it.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is our one-line error, not an absl log line on stderr
_NO_CONTENT_OP = re.compile(r"\{,(\d+)\}")


def _for_re2(pattern: str) -> str | None:
    """``pattern`` (valid Python syntax) in RE2's syntax with Python's meaning, or None when a construct in it means
    something else to RE2 (see above)."""
    out, i, n = [], 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append("\\z" if pattern[i + 1:i + 2] == "Z" and not in_class else pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[" and pattern[i + 1:i + 2] in (":", "=", "."):
                return None
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":  # a ']' right after '[' or '[^' is a literal in both engines
                j += 1
            out.append(pattern[i:j])
            i = j
            continue
        m = _NO_CONTENT_OP.match(pattern, i)
        if m:
            out.append(f"{{0,{m.group(1)}}}")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def compile_pattern(pattern: str, *, where: str, error: type[Exception] = ValueError, invalid_ok: bool = False):
    """The RE2 program of ``pattern`` (a regular expression from a file; ``where``: the file and field, e.g.
    ``config.json: quantization_config.ignore``): ``.match(name)`` anchors at the start as ``re.match`` does,
    ``.search(name)`` looks anywhere as ``re.search`` does. Raises ``error`` naming ``where`` and the pattern when it
    is too long, not valid Python regex syntax (``invalid_ok``: returns None instead, for readers that take such a
    string as a plain name), or has no linear-time match (see above)."""
    if not isinstance(pattern, str):
        raise error(f"{where}: pattern {show(pattern)} is not a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise error(f"{where}: pattern {show(pattern)} is {len(pattern)} characters long, over the limit of "
                    f"{MAX_PATTERN_CHARS}")
    try:
        with warnings.catch_warnings():  # "Possible nested set": the POSIX-bracket case, refused below by name
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        if invalid_ok:
            return None
        raise error(f"{where}: invalid regex {show(pattern)}: {e}") from None
    translated = _for_re2(pattern)
    if translated is None:
        raise error(f"{where}: regex {show(pattern)} has a POSIX bracket ('[:', '[=' or '[.') inside a character "
                    "class, which Python reads as literal characters and RE2 as a class; escape the '['")
    try:
        return re2.compile(translated, _RE2_OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise error(f"{where}: regex {show(pattern)} cannot be matched in linear time ({reason}); qjax matches "
                    "patterns from files with RE2, which has no backreferences, lookarounds, atomic groups or "
                    "possessive repeats") from None
