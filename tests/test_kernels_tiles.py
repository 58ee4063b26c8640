"""Measured GEMV tiles per chip (kernels/tiles.py, kernels/tiles.json) and how choose_config takes them."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qjax.kernels import qmatmul_pallas as qp
from qjax.kernels import tiles
from qjax.kernels.qmatmul_reference import qmatmul as ref_qmatmul
from qjax.kernels.quant_meta import QuantMeta

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated:DeprecationWarning")

INT4 = QuantMeta("int", 4, 128, 2048, 8192, True, "group", "bfloat16")


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    tiles._fallbacks.cache_clear()  # "said once per chip and process": each test starts unsaid
    yield
    tiles._fallbacks.cache_clear()


def _table(tmp_path, entries, version=1):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"version": version, "entries": entries}))
    tiles.load.cache_clear()
    return path


def _row(**over):
    row = {"chip": "H200", "scheme": "int4_g128", "n": 256, "k": 512, "m": 1, "bn": 16, "bk": 256, "split_k": 2,
           "num_warps": 2, "num_stages": 1, "us": 1.0, "source": "test"}
    return {**row, **over}


def test_committed_table_is_valid_and_measured():
    table = tiles.load()
    assert table, "kernels/tiles.json holds the H200 sweep's tiles"
    assert all(k.chip in tiles.CHIPS and k.m in tiles.M_BUCKETS for k in table)
    doc = json.loads(tiles.TABLE.read_text())
    assert all(e["us"] > 0 and "sweep_gemv.py" in e["source"] for e in doc["entries"])


def test_choose_config_takes_the_measured_tile_and_says_a_miss_once(tmp_path):
    """On the chip of an entry, its scheme / shape / M bucket get the measured tile; M = 2…16 is another bucket;
    another chip or shape gets the rule, said once per chip (one warning naming the first miss); no chip (CPU):
    the rule, silently."""
    path = _table(tmp_path, [_row(n=8192, k=2048, bn=16, bk=1024, split_k=1, num_stages=3)])
    rule = qp.choose_config(1, 8192, 2048, INT4, chip=None, table=path)
    got = qp.choose_config(1, 8192, 2048, INT4, chip="H200", table=path)
    assert (got.path, got.bn, got.bk, got.split_k, got.num_warps, got.num_stages) == ("gemv", 16, 1024, 1, 2, 3)
    assert got != rule
    with pytest.warns(tiles.TileFallback, match="int4_g128 8192×2048 at M ≤ 16 on the H200"):
        assert qp.choose_config(8, 8192, 2048, INT4, chip="H200", table=path) == qp.choose_config(
            8, 8192, 2048, INT4, chip=None, table=path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said already for this chip
        qp.choose_config(1, 4096, 2048, QuantMeta("int", 4, 128, 2048, 4096), chip="H200", table=path)
        assert qp.choose_config(600, 8192, 2048, INT4, chip="H200", table=path).path == "gemm"  # no GEMM table
    with pytest.warns(tiles.TileFallback, match="any shape on the H100"):
        assert qp.choose_config(1, 8192, 2048, INT4, chip="H100", table=path) == rule


def test_a_tile_that_does_not_fit_the_shape_falls_back(tmp_path):
    """N not a multiple of bn (the layer could not be read in place) or bk not whole words: the rule decides."""
    meta = QuantMeta("int", 4, 128, 512, 200)
    path = _table(tmp_path, [_row(n=200, bn=16)])
    assert qp.choose_config(1, 200, 512, meta, chip="H200", table=path) == qp.choose_config(
        1, 200, 512, meta, chip=None, table=path)


def test_a_measured_tile_computes_the_reference():
    """The table's kind of config (bn 16, a K split) through the kernel in interpret mode equals the reference."""
    meta = QuantMeta("int", 4, 128, 512, 256)
    cfg = qp._measured_config(_row(), 1, 256, 512, meta)
    assert cfg is not None and cfg.split_k == 2
    rng = np.random.default_rng(0)
    packed = jnp.asarray(rng.integers(-(2**31), 2**31, (256, meta.packed_cols), dtype=np.int64).astype(np.int32))
    scale = jnp.asarray(rng.uniform(0.01, 0.02, meta.scale_shape), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
    got = jax.jit(lambda x: qp.qmatmul_pallas(x, packed, scale, None, meta, interpret=True, config=cfg))(x)
    want = ref_qmatmul(x, packed, scale, None, meta)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5


@pytest.mark.parametrize("entries, version, match", [
    ([_row(bn=24)], 1, "entry 0: bn, bk, split_k, num_warps must be powers of two"),
    ([_row(num_stages=0)], 1, "num_stages 1…8"),
    ([{**_row(), "bk": "wide"}], 1, "entry 0: missing or non-integer field"),
    ([_row(), _row()], 1, "entry 1 repeats"),
    ([_row(chip="A100")], 1, "chip must be one of"),
    ([_row(m=8)], 1, "m one of"),
    ([], 2, "a tile table is"),
])
def test_malformed_tables_name_the_file_and_entry(tmp_path, entries, version, match):
    path = _table(tmp_path, entries, version)
    with pytest.raises(ValueError, match=match) as err:
        tiles.load(path)
    assert str(path) in str(err.value)


def test_merge_replaces_the_same_key_atomically(tmp_path):
    """What the sweep's --table-out does: new entries replace those of the same key, others stay, the file is whole
    (no temporary left), and the loaded table reflects it at once."""
    path = _table(tmp_path, [_row(), _row(n=512)])
    cfg = qp.KernelConfig("gemv", 16, 32, 256, 1, num_warps=4, num_stages=3)
    new = tiles.entry("H200", QuantMeta("int", 4, 128, 512, 256), 1, cfg, 0.75, "sweep")
    assert tiles.merge(path, [new]) == 2
    table = tiles.load(path)
    assert table[tiles.TileKey("H200", "int4_g128", 256, 512, 1)]["bn"] == 32
    assert table[tiles.TileKey("H200", "int4_g128", 512, 512, 1)]["bn"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiles.json"]
    with pytest.raises(ValueError, match="chip must be one of"):
        tiles.entry("A100", INT4, 1, cfg, 1.0, "sweep")


def test_scheme_keys_and_chips():
    assert tiles.scheme_key(INT4) == "int4_g128"
    assert tiles.scheme_key(QuantMeta("int", 8, 2048, 2048, 64, False, "channel")) == "int8_channel_asym"
    assert tiles.scheme_key(QuantMeta("mxfp8", 8, 32, 64, 64, strategy="group", scale_dtype="uint8")) == "mxfp8"
    assert tiles.chip_of("NVIDIA H100 80GB HBM3") == "H100" and tiles.chip_of("NVIDIA H200") == "H200"
    assert tiles.chip_of("cpu") is None and tiles.m_bucket(1) == 1 and tiles.m_bucket(9) == 16
    assert tiles.m_bucket(17) is None
