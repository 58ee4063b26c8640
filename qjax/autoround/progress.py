"""Resumable runs: each finished block is saved (packed codes, scales, KV scales, its report) to a progress folder, so
a killed run restarts from the last finished block with ``--resume``.

The folder holds ``state.json`` (the run's fingerprint — model, data and every option — and the number of finished
blocks) and one ``block_NNNN.npz`` per block, each written to a temporary name and renamed
(:func:`qjax.validation.replacing`), so a kill mid-write leaves the previous state intact and a failed write (a full
disk) leaves no partial file and names the file. On resume the two streams are recomputed through the finished
blocks (forward passes only) instead of being stored: they are the largest thing a run holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import zipfile

import ml_dtypes
import numpy as np

from qjax.validation import read_json, replacing

from .results import BlockReport, UnitResult
from .schemes import Scheme

STATE = "state.json"


class ResumeError(ValueError):
    pass


def _block_path(folder: str, i: int) -> str:
    return os.path.join(folder, f"block_{i:04d}.npz")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def state_checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_state(folder: str, fingerprint: dict, blocks: list[str]) -> None:
    """state.json: the fingerprint, each finished block file's SHA-256, and a checksum over both (so an edited or
    damaged progress folder is refused by name instead of resuming into a different result)."""
    body = {"fingerprint": fingerprint, "done": len(blocks), "blocks": blocks}
    with replacing(os.path.join(folder, STATE), "w") as f:
        json.dump({**body, "checksum": state_checksum(body)}, f, indent=2, sort_keys=True)


def _read_state(folder: str) -> dict:
    path = os.path.join(folder, STATE)
    state = read_json(path, error=ResumeError)
    body = {k: v for k, v in state.items() if k != "checksum"}
    if state.get("checksum") != state_checksum(body) or not isinstance(state.get("blocks"), list) \
            or state.get("done") != len(state["blocks"]):
        raise ResumeError(f"--resume: {path} is damaged (its checksum does not match its content); start the run "
                          "again without --resume")
    return state


def start(ar) -> None:
    os.makedirs(ar.progress_dir, exist_ok=True)
    for name in os.listdir(ar.progress_dir):
        # the files of an earlier run, and the temporary files of one killed mid-write (replacing's ".NAME.*.tmp")
        if name.startswith(("block_", ".block_", f".{STATE}.")) or name == STATE:
            os.remove(os.path.join(ar.progress_dir, name))
    _write_state(ar.progress_dir, ar.fingerprint, [])


def save_block(ar, i: int) -> None:
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"units": {}, "report": dataclasses.asdict(ar.reports[-1]) if ar.reports else None}
    for name, r in ar.results[i].items():
        packed = np.asarray(r.packed)
        is_f8 = packed.dtype == ml_dtypes.float8_e4m3fn
        arrays[f"{name}/packed"] = packed.view(np.uint8) if is_f8 else packed
        arrays[f"{name}/scale"] = np.asarray(r.scale)
        if r.zp is not None:
            arrays[f"{name}/zp"] = np.asarray(r.zp)
        meta["units"][name] = {"scheme": dataclasses.asdict(r.scheme), "in_features": r.in_features,
                               "scale_dtype": r.scale_dtype, "float8": is_f8}
    if i in ar.kv_scales:
        arrays["kv/k_scale"], arrays["kv/v_scale"] = ar.kv_scales[i]
    # float tensors the algorithm changed (AWQ's smoothed norms, compensated router): raw bytes + dtype name, since
    # npz cannot hold bfloat16
    meta["floats"] = {}
    for key, v in getattr(ar, "floats", {}).get(i, {}).items():
        v = np.ascontiguousarray(v)
        arrays[f"float/{key}"] = v.view(np.uint8).reshape(-1)
        meta["floats"][key] = {"dtype": v.dtype.name, "shape": list(v.shape)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    path = _block_path(ar.progress_dir, i)
    # a full disk mid-write leaves no partial file behind, and the error names the block file
    with replacing(path) as f:
        np.savez(f, **arrays)
    blocks = _read_state(ar.progress_dir)["blocks"][:i] if i else []
    _write_state(ar.progress_dir, ar.fingerprint, [*blocks, _sha256(path)])


def load(ar, keep_results: bool = True) -> int:
    """Restore the finished blocks into ``ar`` — their reports and KV scales, and their results unless
    ``keep_results`` is False (a streamed run reads each block's when it needs it: :func:`read_results`) — after
    checking every block file against the SHA-256 recorded when it was written; returns how many there are."""
    folder = ar.progress_dir
    state_path = os.path.join(folder or "", STATE)
    if not folder or not os.path.isfile(state_path):
        raise ResumeError(f"--resume: no saved progress in {folder} (start the run without --resume)")
    state = _read_state(folder)
    saved = state.get("fingerprint", {})
    if saved != ar.fingerprint:
        diff = sorted(k for k in set(saved) | set(ar.fingerprint) if saved.get(k) != ar.fingerprint.get(k))
        raise ResumeError(f"--resume: {folder} was made by a different run (differs in: {', '.join(diff)}); "
                          "rerun with the same options or without --resume")
    done = int(state["done"])
    for i in range(done):
        path = _block_path(folder, i)
        if not os.path.isfile(path) or _sha256(path) != state["blocks"][i]:
            raise ResumeError(f"--resume: {path} is missing or altered (its SHA-256 differs from the one recorded "
                              "when it was written); start the run again without --resume")
        try:
            _load_block(ar, i, path, keep_results)
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
            raise ResumeError(f"--resume: {path} cannot be read ({type(e).__name__}: {e})") from None
    return done


def _read_block(folder: str, i: int, part):
    """``part(npz, meta)`` of block ``i``'s file in ``folder``; an unreadable file is one :class:`ResumeError`."""
    path = _block_path(folder, i)
    try:
        with np.load(path, allow_pickle=False) as z:
            return part(z, json.loads(bytes(z["meta"]).decode()))
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ResumeError(f"{path} cannot be read ({type(e).__name__}: {e}); start the run again without "
                          "--resume") from None


def read_results(folder: str, i: int) -> dict[str, UnitResult]:
    """Block ``i``'s ``{unit: UnitResult}`` as saved in ``folder`` (a streamed run's finished block)."""
    return _read_block(folder, i, _results)


def read_floats(folder: str, i: int) -> dict[str, np.ndarray]:
    """Block ``i``'s changed float tensors as saved in ``folder`` (``{layer-relative key: array}``)."""
    return _read_block(folder, i, _floats)


def _floats(z, meta: dict) -> dict[str, np.ndarray]:
    out = {}
    for key, m in meta.get("floats", {}).items():
        dt = np.dtype(getattr(ml_dtypes, m["dtype"])) if hasattr(ml_dtypes, m["dtype"]) else np.dtype(m["dtype"])
        out[key] = z[f"float/{key}"].view(dt).reshape(m["shape"])
    return out


def _results(z, meta: dict) -> dict[str, UnitResult]:
    res = {}
    for name, m in meta["units"].items():
        packed = z[f"{name}/packed"]
        if m["float8"]:
            packed = packed.view(ml_dtypes.float8_e4m3fn)
        res[name] = UnitResult(Scheme(**m["scheme"]), packed, z[f"{name}/scale"], m["in_features"],
                               z[f"{name}/zp"] if f"{name}/zp" in z else None, m["scale_dtype"])
    return res


def _load_block(ar, i: int, path: str, keep_results: bool) -> None:

    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if keep_results:
            ar.results[i] = _results(z, meta)
            if meta.get("floats"):
                ar.floats[i] = _floats(z, meta)
        if "kv/k_scale" in z:
            ar.kv_scales[i] = (z["kv/k_scale"], z["kv/v_scale"])
        if meta["report"] is not None:
            ar.reports.append(BlockReport(**meta["report"]))


def finish(folder: str) -> None:
    """Remove the progress folder after the checkpoint is written."""

    shutil.rmtree(folder, ignore_errors=True)
