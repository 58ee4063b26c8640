"""Measured tiles of the dequant-matmul kernel per chip: ``tiles.json`` beside this module, read by
:func:`.qmatmul_pallas.choose_config`.

A tile (block sizes, split-K, warps, stages) that is fastest on one chip is not what a shape rule predicts: the
H200 sweep of 2026-12-04 found ``choose_config``'s INT4 GEMV tile ~1.5× slower than the best swept one. So the GPU
sweep (``benchmarks/gpu/sweep_gemv.py --table-out``) writes its fastest config per (chip, scheme, N×K, M bucket)
into the table, and ``choose_config`` takes it when the chip, scheme and shape match; otherwise the shape rule
decides and the fallback is said once per chip and process (naming the first shape missing), as a
:class:`TileFallback` warning.

The file (``version`` 1): ``{"version": 1, "entries": [{"chip": "H200", "scheme": "int4_g128", "n": 8192,
"k": 2048, "m": 1, "bn": 16, "bk": 1024, "split_k": 1, "num_warps": 2, "num_stages": 3, "us": 14.6,
"source": "…"}]}`` — ``m`` is the M bucket (:data:`M_BUCKETS`: a call with M rows takes the smallest bucket ≥ M),
``us`` and ``source`` say what was measured where. Only the GEMV path (M ≤ 16, batch decode) has entries: the sweep
times M = 1; prefill's GEMM tiles follow the rule. A malformed file is an error naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import warnings
from pathlib import Path

import jax

from .quant_meta import QuantMeta

TABLE = Path(__file__).with_name("tiles.json")
M_BUCKETS = (1, 16)  # the GEMV path (M ≤ 16: M = 1 reduces rows, 2…16 use one 16-row MMA block); GEMM: the rule
CHIPS = ("H100", "H200")
_FIELDS = ("bn", "bk", "split_k", "num_warps", "num_stages")


class TileFallback(UserWarning):
    """No measured tile for a (chip, scheme, shape, M bucket): ``choose_config``'s shape rule decides."""


@dataclasses.dataclass(frozen=True)
class TileKey:
    chip: str
    scheme: str
    n: int
    k: int
    m: int  # the M bucket


def scheme_key(meta: QuantMeta) -> str:
    """``int4_g128``, ``int2_g64``, ``int8_g32_asym``, ``int8_channel``, ``int4_tensor``, ``mxfp8``, ``dense_bfloat16``:
    what decides a tile besides the shape (bits and grouping; the scale dtype does not)."""
    if meta.fmt == "dense":
        return f"dense_{meta.scale_dtype}"
    if meta.fmt == "mxfp8":
        return "mxfp8"
    grouping = f"g{meta.group_size}" if meta.strategy == "group" else meta.strategy
    return f"int{meta.bits}_{grouping}" + ("" if meta.symmetric else "_asym")


def m_bucket(m: int) -> int | None:
    """The smallest bucket ≥ m; None past the last (the GEMM path: no table)."""
    return next((b for b in M_BUCKETS if m <= b), None)


def chip_of(device_kind: str) -> str | None:
    """``"NVIDIA H200"`` → ``"H200"``, ``"NVIDIA H100 80GB HBM3"`` → ``"H100"``; other devices: None."""
    return next((c for c in CHIPS if c in device_kind.upper()), None)


def current_chip() -> str | None:
    """The chip the program being traced will run on: jax's default device if one is set (the deviceless AOT
    compiles set an H100 / H200 target so), else the first device of the default backend."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        if jax.default_backend() not in ("gpu", "cuda"):
            return None
        device = jax.devices()[0]
    return chip_of(getattr(device, "device_kind", "") or "")


def _entry(path: Path, i: int, raw) -> tuple[TileKey, dict]:
    where = f"{path}: entry {i}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not an object")
    try:
        key = TileKey(str(raw["chip"]), str(raw["scheme"]), int(raw["n"]), int(raw["k"]), int(raw["m"]))
        tile = {f: int(raw[f]) for f in _FIELDS}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: missing or non-integer field ({e})") from None
    if key.chip not in CHIPS or key.m not in M_BUCKETS or key.n <= 0 or key.k <= 0:
        raise ValueError(f"{where}: chip must be one of {CHIPS}, m one of {M_BUCKETS}, n and k positive")
    if any(tile[f] <= 0 or tile[f] & (tile[f] - 1) for f in _FIELDS[:4]) or not 1 <= tile["num_stages"] <= 8:
        raise ValueError(f"{where}: {', '.join(_FIELDS[:4])} must be powers of two and num_stages 1…8, got {tile}")
    return key, tile


@functools.lru_cache(maxsize=4)
def load(path: Path = TABLE) -> dict[TileKey, dict]:
    """The table: ``{TileKey: {bn, bk, split_k, num_warps, num_stages}}`` (empty when the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON tile table ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{path}: a tile table is {{'version': 1, 'entries': [...]}}")
    table = {}
    for i, raw in enumerate(doc["entries"]):
        key, tile = _entry(path, i, raw)
        if key in table:
            raise ValueError(f"{path}: entry {i} repeats {key}")
        table[key] = tile
    return table


@functools.lru_cache(maxsize=None)
def _fallbacks(chip: str) -> list:
    """The misses already said for ``chip`` (one warning per chip and process, naming the first miss)."""
    return []


def _say_fallback(chip: str, what: str) -> None:
    said = _fallbacks(chip)
    if not said:
        warnings.warn(f"qjax.kernels: no measured tile for {what} on the {chip} ({TABLE.name}); choose_config's "
                      f"shape rule decides (said once per chip; benchmarks/gpu/run.sh sweep measures tiles)",
                      TileFallback, stacklevel=4)
    said.append(what)


def lookup(chip: str | None, meta: QuantMeta, n: int, k: int, m: int, path: Path = TABLE) -> dict | None:
    """The measured tile for this call, or None (no chip, or not in the table: said once)."""
    bucket = m_bucket(m)
    if chip is None or bucket is None:
        return None
    table = load(path)
    key = TileKey(chip, scheme_key(meta), n, k, bucket)
    tile = table.get(key)
    if tile is None:
        has_chip = any(t.chip == chip for t in table)
        _say_fallback(chip, f"{key.scheme} {n}×{k} at M ≤ {key.m}" if has_chip else "any shape")
    return tile


def entry(chip: str, meta: QuantMeta, m: int, config, us: float, source: str) -> dict:
    """A table entry for ``config`` (a :class:`.qmatmul_pallas.KernelConfig`) measured at ``us`` µs per call."""
    e = {"chip": chip, "scheme": scheme_key(meta), "n": meta.out_features, "k": meta.in_features, "m": m_bucket(m),
         **{f: getattr(config, f) for f in _FIELDS}, "us": round(float(us), 2), "source": source}
    _entry(Path("<new entry>"), 0, e)  # the same checks as a loaded one
    return e


def merge(path: Path, new: list[dict]) -> int:
    """Write ``new`` entries into the table at ``path`` (created if missing), replacing those with the same key;
    atomically (a temporary file renamed over it). Returns the number of entries written."""
    path = Path(path)
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    keys = {_entry(path, i, e)[0] for i, e in enumerate(new)}
    kept = [e for i, e in enumerate(old) if _entry(path, i, e)[0] not in keys]
    doc = {"version": 1, "entries": kept + list(new)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    load.cache_clear()
    return len(doc["entries"])
