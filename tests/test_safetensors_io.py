"""Tests for qjax.checkpoint.safetensors_io against the official ``safetensors`` package (the reference
implementation)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open

from qjax.checkpoint.safetensors_io import (
    SafetensorsError,
    SafetensorsFile,
    list_checkpoint_files,
    read_index,
    write_safetensors,
)

RNG = np.random.default_rng(0)

# numpy-native dtypes: produced with safetensors.numpy.save_file.
NUMPY_DTYPES: dict[str, Any] = {
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
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
}
# dtypes numpy lacks natively: produced with safetensors.torch.save_file.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
EXPECTED_NP_DTYPE: dict[str, Any] = {
    **NUMPY_DTYPES,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


def _random_bytes_array(np_dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Array of ``shape`` with random bit patterns (NaNs included) so the comparison is on raw bytes, not values."""
    dt = np.dtype(np_dtype)
    if dt == np.bool_:
        return RNG.integers(0, 2, size=shape).astype(np.bool_)
    raw = RNG.integers(0, 256, size=(*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _official_raw_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (torch dtype name, shape, raw little-endian bytes) as the official reader sees them."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[name] = (str(t.dtype), tuple(t.shape), raw)
    return out


def _raw_file(path: Path, header: dict[str, Any] | bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    """Write a hand-made safetensors file: u64 length, header (dict -> JSON, or raw bytes), then data."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb) if header_len is None else header_len) + hb + data)
    return path


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    """(header dict, data buffer) of an existing file, for patching."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


@pytest.fixture
def reference_file(tmp_path: Path) -> Path:
    """A small official file with two F32 tensors (weights.a: (4, 3), weights.b: (5,))."""
    path = tmp_path / "ref.safetensors"
    tensors = {"weights.a": np.arange(12, dtype=np.float32).reshape(4, 3), "weights.b": np.ones(5, np.float32)}
    safetensors.numpy.save_file(tensors, str(path))
    return path


# ---- reading official files ----------------------------------------------------------------------------------------
def test_every_dtype_bit_exact_vs_official(tmp_path: Path) -> None:
    np_path, pt_path = tmp_path / "np.safetensors", tmp_path / "pt.safetensors"
    safetensors.numpy.save_file(
        {f"t.{name}": _random_bytes_array(dt, (3, 5)) for name, dt in NUMPY_DTYPES.items()}, str(np_path)
    )
    pt_tensors = {}
    for name, tdt in TORCH_DTYPES.items():
        raw = torch.from_numpy(RNG.integers(0, 256, size=(2, 7, tdt.itemsize), dtype=np.uint8))
        pt_tensors[f"t.{name}"] = raw.view(tdt).reshape(2, 7)
    safetensors.torch.save_file(pt_tensors, str(pt_path))

    seen = set()
    for path in (np_path, pt_path):
        official = _official_raw_bytes(path)
        with SafetensorsFile(path) as f:
            assert sorted(f.keys()) == sorted(official)
            for name, (_, shape, raw) in official.items():
                st_dtype = name.removeprefix("t.")
                arr = f.get(name)
                assert f.dtype(name) == st_dtype
                assert arr.dtype == np.dtype(EXPECTED_NP_DTYPE[st_dtype]), name
                assert arr.shape == shape == f.shape(name)
                assert f.nbytes(name) == len(raw) == arr.nbytes
                assert arr.tobytes() == raw, name
                seen.add(st_dtype)
    assert seen == set(EXPECTED_NP_DTYPE)


def test_bf16_and_fp8_values_match_torch(tmp_path: Path) -> None:
    path = tmp_path / "vals.safetensors"
    x = torch.linspace(-3, 3, 24).reshape(4, 6)
    safetensors.torch.save_file({"bf": x.bfloat16(), "e4": x.to(torch.float8_e4m3fn)}, str(path))
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.get("bf").astype(np.float32), x.bfloat16().float().numpy())
        np.testing.assert_array_equal(f.get("e4").astype(np.float32), x.to(torch.float8_e4m3fn).float().numpy())


def test_views_are_zero_copy_and_read_only(reference_file: Path) -> None:
    with SafetensorsFile(reference_file) as f:
        a, a2 = f.get("weights.a"), f.get("weights.a")
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0, 0] = 1.0
        # Two gets alias the same mapped bytes: nothing was copied.
        assert np.shares_memory(a, a2)
        np.testing.assert_array_equal(a, np.arange(12, dtype=np.float32).reshape(4, 3))


def test_empty_and_scalar_tensors(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    tensors = {
        "e0": np.zeros((0,), np.float32),
        "e1": np.zeros((3, 0, 2), np.int64),
        "scalar": np.array(7.5, np.float32),
        "x": np.ones((2,), np.float16),
    }
    safetensors.numpy.save_file(tensors, str(path))
    with SafetensorsFile(path) as f:
        for name, ref in tensors.items():
            arr = f.get(name)
            assert arr.shape == ref.shape and arr.dtype == ref.dtype, name
            assert not arr.flags.writeable, name
            np.testing.assert_array_equal(arr, ref)
        assert f.nbytes("e1") == 0


def test_only_empty_tensors(tmp_path: Path) -> None:
    path = tmp_path / "only_empty.safetensors"
    safetensors.numpy.save_file({"e": np.zeros((0, 4), np.float32)}, str(path))
    with SafetensorsFile(path) as f:
        assert f.get("e").shape == (0, 4)


def test_metadata_keys_order_contains(tmp_path: Path) -> None:
    path = _raw_file(
        tmp_path / "order.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "zeta": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
            "alpha": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]},
        },
        b"\x01\x02\x03",
    )
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"}
        assert f.keys() == ["zeta", "alpha"]
        assert "alpha" in f and "__metadata__" not in f and "nope" not in f
        assert f.get("alpha").tolist() == [3]
        with pytest.raises(KeyError, match="nope"):
            f.get("nope")


def test_views_survive_close(reference_file: Path) -> None:
    f = SafetensorsFile(reference_file)
    b = f.get("weights.b")
    f.close()
    f.close()  # idempotent
    np.testing.assert_array_equal(b, np.ones(5, np.float32))
    with pytest.raises(SafetensorsError, match="closed"):
        f.get("weights.b")


# ---- writing -------------------------------------------------------------------------------------------------------
def test_write_read_back_by_official(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        f"np.{name}": _random_bytes_array(dt, (4, 3)) for name, dt in EXPECTED_NP_DTYPE.items()
    }
    tensors["strided"] = np.arange(20, dtype=np.int32).reshape(4, 5).T  # non-contiguous input
    tensors["big_endian"] = np.arange(6, dtype=">f4").reshape(2, 3)
    tensors["empty"] = np.zeros((0, 3), np.float32)
    tensors["scalar"] = np.array(2.5, np.float64)
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "note": "qjax"})

    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header_bytes = blob[8 : 8 + n]
    # Padding is spaces after the closing brace, up to a multiple of 8 (as the reference writer does).
    assert n % 8 == 0 and header_bytes.rstrip(b" ").endswith(b"}")
    assert len(header_bytes) - len(header_bytes.rstrip(b" ")) < 8
    header = json.loads(header_bytes)
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(tensors)
    offsets = [header[k]["data_offsets"] for k in names]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1][1] == len(blob) - 8 - n

    official = _official_raw_bytes(path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "qjax"}
    for name, ref in tensors.items():
        _, shape, raw = official[name]
        assert shape == ref.shape, name
        assert raw == np.ascontiguousarray(ref.astype(ref.dtype.newbyteorder("<"))).tobytes(), name
    # The official numpy backend has no float8 types, so only spot-check values through it.
    with safe_open(str(path), framework="np") as f:
        for name in ("strided", "big_endian", "np.BF16"):
            np.testing.assert_array_equal(f.get_tensor(name), tensors[name])

    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "qjax"}
        for name, ref in tensors.items():
            assert f.get(name).tobytes() == np.ascontiguousarray(ref.astype(ref.dtype.newbyteorder("<"))).tobytes()


def test_write_byte_identical_to_official_for_one_dtype(tmp_path: Path) -> None:
    # With a single dtype the reference orders tensors by name too, so the files must match byte for byte.
    tensors = {"b": RNG.standard_normal((3, 4)).astype(np.float32), "a": np.zeros((5,), np.float32)}
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    write_safetensors(ours, tensors, metadata={"format": "np"})
    safetensors.numpy.save_file(tensors, str(ref), metadata={"format": "np"})
    assert ours.read_bytes() == ref.read_bytes()


def test_write_rejects_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(SafetensorsError, match="'strs'"):
        write_safetensors(path, {"strs": np.array(["a", "b"])})
    with pytest.raises(SafetensorsError, match="metadata"):
        write_safetensors(path, {"x": np.zeros(2, np.float32)}, metadata={"k": 1})  # type: ignore[dict-item]
    assert not path.exists() and not (tmp_path / "bad.safetensors.tmp").exists()


# ---- checkpoint folders --------------------------------------------------------------------------------------------
def _sharded_folder(folder: Path) -> dict[str, str]:
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                  "c": "model-00001-of-00002.safetensors"}
    for shard in set(weight_map.values()):
        names = [n for n, s in weight_map.items() if s == shard]
        safetensors.numpy.save_file({n: np.full((2,), ord(n), np.int32) for n in names}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_index(tmp_path: Path) -> None:
    weight_map = _sharded_folder(tmp_path)
    assert read_index(tmp_path) == weight_map
    assert list_checkpoint_files(tmp_path) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, shard in read_index(tmp_path).items():
        with SafetensorsFile(tmp_path / shard) as f:
            assert f.get(name).tolist() == [ord(name)] * 2


def test_index_missing_shard(tmp_path: Path) -> None:
    _sharded_folder(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    for fn in (read_index, list_checkpoint_files):
        with pytest.raises(SafetensorsError) as info:
            fn(tmp_path)
        msg = str(info.value)
        assert "model-00002-of-00002.safetensors" in msg and "model.safetensors.index.json" in msg, msg


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"metadata": {}}', '{"weight_map": {"a": 3}}'])
def test_index_malformed(tmp_path: Path, content: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(SafetensorsError) as info:
        read_index(tmp_path)
    assert str(index) in str(info.value)


def test_list_checkpoint_files_fallbacks(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError) as info:
        list_checkpoint_files(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(SafetensorsError, match="index file not found"):
        read_index(tmp_path)

    for name in ("b.safetensors", "a.safetensors"):
        safetensors.numpy.save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / name))
    (tmp_path / "notes.txt").write_text("ignored")
    assert list_checkpoint_files(tmp_path) == ["a.safetensors", "b.safetensors"]

    safetensors.numpy.save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    assert list_checkpoint_files(tmp_path) == ["model.safetensors"]


# ---- header validation: one test per error, each checking the file (and tensor) is named ---------------------------
def test_error_file_shorter_than_8_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    _expect_error(path, "shorter than")


def test_error_header_length_larger_than_file(reference_file: Path) -> None:
    header, data = _split(reference_file)
    _raw_file(reference_file, header, data, header_len=10**6)
    _expect_error(reference_file, "header length")


@pytest.mark.parametrize("header", [b"{not json}", b"\xff\xfe{}", b"[1, 2, 3]"])
def test_error_header_not_json_object(tmp_path: Path, header: bytes) -> None:
    path = _raw_file(tmp_path / "badjson.safetensors", header)
    _expect_error(path, "header")


def test_error_unknown_dtype(reference_file: Path) -> None:
    header, data = _split(reference_file)
    header["weights.a"]["dtype"] = "F4"
    _raw_file(reference_file, header, data)
    _expect_error(reference_file, "'weights.a'", "dtype", "'F4'")


def test_error_negative_shape(reference_file: Path) -> None:
    header, data = _split(reference_file)
    header["weights.b"]["shape"] = [-5]
    _raw_file(reference_file, header, data)
    _expect_error(reference_file, "'weights.b'", "negative")


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [0.0, 20.0], "0-20", [20, 0], [-4, 20]])
def test_error_bad_data_offsets(reference_file: Path, offsets: Any) -> None:
    header, data = _split(reference_file)
    header["weights.b"]["data_offsets"] = offsets
    _raw_file(reference_file, header, data)
    _expect_error(reference_file, "'weights.b'", "data_offsets")


def test_error_truncated(reference_file: Path) -> None:
    header, _ = _split(reference_file)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    blob = reference_file.read_bytes()
    reference_file.write_bytes(blob[:-3])
    msg = _expect_error(reference_file, f"'{last}'", "truncated", f"has only {len(blob) - 3}")
    assert f"needs bytes up to {len(blob)}" in msg


def test_error_byte_size_mismatch(reference_file: Path) -> None:
    header, data = _split(reference_file)
    header["weights.a"]["shape"] = [4, 4]  # the bytes hold (4, 3)
    _raw_file(reference_file, header, data)
    _expect_error(reference_file, "'weights.a'", "[4, 4]", "48")


def test_error_overlapping(reference_file: Path) -> None:
    header, data = _split(reference_file)
    a, b = header["weights.a"]["data_offsets"], header["weights.b"]["data_offsets"]
    # Move the later tensor to start 4 bytes before the earlier one ends (same size, so only the overlap is wrong).
    first, second = ("weights.a", "weights.b") if a[0] < b[0] else ("weights.b", "weights.a")
    end_first = header[first]["data_offsets"][1]
    size_second = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [end_first - 4, end_first - 4 + size_second]
    _raw_file(reference_file, header, data)
    _expect_error(reference_file, "overlap", "'weights.a'", "'weights.b'")


def test_error_duplicate_and_bad_metadata(tmp_path: Path) -> None:
    dup = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    path = _raw_file(tmp_path / "dup.safetensors", dup, b"\x00")
    _expect_error(path, "duplicate", "'x'")
    path = _raw_file(tmp_path / "meta.safetensors", {"__metadata__": {"k": 1}})
    _expect_error(path, "__metadata__")


def test_zero_size_tensors_sit_between_tensors_not_inside_them(tmp_path: Path) -> None:
    """As the reference reader (safetensors 0.8) decides: an empty tensor at a tensor boundary is fine, one whose
    offset falls inside another tensor is an invalid offset."""
    x = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
    for at in (0, 2):
        path = _raw_file(tmp_path / f"zeros{at}.safetensors",
                         {"x": x, "e": {"dtype": "F32", "shape": [0], "data_offsets": [at, at]}}, b"\x05\x06")
        with SafetensorsFile(path) as f:
            assert f.get("e").shape == (0,) and f.get("x").tolist() == [5, 6]
    path = _raw_file(tmp_path / "inside.safetensors",
                     {"x": x, "e": {"dtype": "F32", "shape": [0], "data_offsets": [1, 1]}}, b"\x05\x06")
    _expect_error(path, "'e'", "overlaps tensor 'x'")
