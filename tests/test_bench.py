"""``qjax bench`` (issue 8): the scaled config, the decode-bound bytes against docs/kernels.md's derivation, and
the bench's tokens against ``qjax.generate`` for every recipe on the random 1/8-width model."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax.cli import main as cli_main
from qjax.model.config import FULL, LINEAR
from qjax.runtime import bench
from qjax.runtime.random_model import abstract_recipe_model, random_model

pytestmark = pytest.mark.slow

# tiny shapes: the path, not the speed, is under test here (benchmarks/e2e.py times the real settings)
TINY = dict(prefill=((8, 8),), decode_batches=(8,), context=8, new_tokens=4, repeats=1)
TINY_FLAGS = ["--scale", "8", "--dtype", "float32", "--prefill", "8x8", "--decode-batches", "8", "--context", "8",
              "--new-tokens", "4", "--repeats", "1"]


@pytest.fixture(scope="module")
def scaled():
    return bench.load_config(scale=8, layers=8)


def test_scaled_config(scaled):
    real = bench.load_config()
    assert (scaled.hidden_size, scaled.head_dim, scaled.linear_key_head_dim, scaled.linear_value_head_dim,
            scaled.moe_intermediate_size, scaled.shared_expert_intermediate_size, scaled.vocab_size) == (
        256, 32, 16, 16, 64, 64, 31040)
    # head counts, experts and routing stay; the pattern is the real one
    for k in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
              "num_experts", "num_experts_per_tok", "linear_conv_kernel_dim"):
        assert getattr(scaled, k) == getattr(real, k), k
    assert scaled.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    raw = scaled.to_hf_dict()
    assert sum(raw["rope_parameters"]["mrope_section"]) == scaled.rotary_dim // 2
    with pytest.raises(ValueError, match="hidden_size = 2048 is not divisible by width 3"):
        bench.scaled_config(real.to_hf_dict(), width=3)
    with pytest.raises(ValueError, match="41 layers asked, the config has 40"):
        bench.scaled_config(real.to_hf_dict(), width=8, layers=41)


def test_expected_active_experts():
    """E·(1 − (1 − k/E)^B): k at batch 1, and docs/kernels.md's table (57 at B=8, 222 at B=64, ~256 from B=128)."""
    assert bench.expected_active_experts(256, 8, 1) == pytest.approx(8)
    assert round(bench.expected_active_experts(256, 8, 8)) == 57
    assert round(bench.expected_active_experts(256, 8, 64)) == 222
    assert bench.expected_active_experts(256, 8, 512) == pytest.approx(256, abs=0.1)
    rng = np.random.default_rng(0)  # and a Monte Carlo of uniform top-8 routing at B = 8
    draws = [len({e for _ in range(8) for e in rng.choice(256, 8, replace=False)}) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(bench.expected_active_experts(256, 8, 8), rel=0.01)


@pytest.mark.parametrize("recipe, weights_mb, experts_mb", [
    ("bf16", 5893, 2013), ("w8a16-g32", 3629, 1069.5), ("w2w4", 2071, 283.1),
    ("w2w4,lm_head=int8:channel", 2071.2 - 1017.1 + 509.1, 283.1), ("w2w4,lm_head=int4:g128", 2071.2 - 1017.1 + 262.2,
                                                                    283.1)])
def test_decode_bytes_of_the_real_model(recipe, weights_mb, experts_mb):
    """Bytes per batch-1 decode step of the real 35B-A3B shapes, counted from qjax's own model, against
    docs/kernels.md's independent derivation: D (BF16) 5893 MB, B′ (W8A16 g32, BF16 LM head) 3629 MB, routed
    experts INT2 g64 283 MB. (docs/kernels.md's A, 2042 MB, has the shared expert in INT2; the w2w4 preset keeps it
    INT4 g128, +29 MB.) GDN state 2 × 63 MB fp32 + conv windows, KV ~84 MB at 4K context. A quantized head replaces
    the BF16 head's 248320 × 2048 × 2 B = 1017.1 MB: int8 per channel 248320 × (2048 + 2 B scale) = 509.1 MB, int4
    g128 248320 × (1024 + 16 × 2 B scales) = 262.2 MB."""
    model = abstract_recipe_model(bench.load_config(), recipe)
    d = bench.decode_bytes(model, 1, 4096)
    assert (d["weights"] + d["experts"]) / 1e6 == pytest.approx(weights_mb, rel=2e-3)
    assert d["experts"] / 1e6 == pytest.approx(experts_mb, rel=2e-3)
    assert d["state"] / 1e6 == pytest.approx(2 * 62.9 + 2 * 1.47, rel=1e-2)
    assert d["kv"] / 1e6 == pytest.approx(83.9, rel=1e-3)
    d8 = bench.decode_bytes(model, 8, 4096)
    assert d8["experts"] == pytest.approx(d["experts"] * bench.expected_active_experts(256, 8, 8) / 8)


@pytest.mark.parametrize("recipe", bench.RECIPES)
def test_bench_tokens_equal_generate(recipe, scaled):
    """The bench times qjax.generate's programs: its greedy tokens are qjax.generate's, for every recipe; the
    plain-XLA baseline (timed beside quantized recipes) decodes the same tokens in float32."""
    model = random_model(scaled, recipe, dtype=jnp.float32, seed=0)
    # decode only (prefill rows and TTFT: test_cli_bench); the warm-up prefill is the same program as its 8×8 row
    res = bench.run_bench(model, bench.Settings(**{**TINY, "prefill": ()}, baseline=recipe == "w2w4"))
    assert [r["kind"] for r in res["rows"]] == ["decode"]
    for row in res["rows"]:
        assert row["s"] > 0 and row["tok_s"] > 0 and len(row["times"]) == 1
    prompt = bench.decode_prompt(scaled, 8, 8, 0)
    want = qjax.generate(model, prompt, max_new_tokens=5, eos_token_id=[])[:, 8:]
    np.testing.assert_array_equal(res["tokens"][8], want)
    assert len(set(want.reshape(-1).tolist())) > 1  # a random model that is not stuck on one token
    decode = res["rows"][-1]
    if recipe == "w2w4":
        assert decode["baseline_token_match"] == 1.0 and decode["speedup"] > 0
    else:
        assert "baseline_s" not in decode


def test_cli_bench(tmp_path, capsys):
    """``qjax bench`` end to end on the scaled config: table, bound, memory, a per-op profile and the JSON file."""
    out = tmp_path / "r.json"
    # the baseline's tokens and speed-up are checked in test_bench_tokens_equal_generate[w2w4]
    rc = cli_main(["bench", "--recipe", "w2w4", *TINY_FLAGS, "--no-baseline", "--profile", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| w2w4 | decode B=8 (ctx 8) |" in text and "| w2w4 | TTFT 1×8 (ms) |" in text
    [r] = json.loads(out.read_text())
    assert r["recipe"] == "w2w4" and r["config"]["hidden_size"] == 256 and r["copy_bandwidth"] > 0
    decode = r["rows"][-1]
    assert decode["bound_tok_s"] > 0 and 0 < decode["of_bound"]
    assert decode["bytes_per_step"]["experts"] > 0 and "tokens" not in r
    prof = r["profile"]
    assert prof["ops"] and prof["busy_us_per_step"] > 0 and prof["wall_us_per_step"] > 0
    assert "decode B=1" in text  # the profile table


def test_cli_bench_errors(capsys, monkeypatch):
    assert cli_main(["bench", "--scale", "8", "--prefill", "2by16"]) == 2
    assert "prefill shape '2by16': use BATCHxTOKENS" in capsys.readouterr().err
    assert cli_main(["bench", "--scale", "8", "--decode-batches", "0"]) == 2
    assert "decode batches must be ≥ 1" in capsys.readouterr().err
    assert cli_main(["bench", "--scale", "3"]) == 2
    assert "not divisible by width 3" in capsys.readouterr().err
    # the full-size model does not fit this host: refused before anything is allocated, with the numbers
    monkeypatch.setattr(bench, "host_available", lambda: 8 << 30)
    assert cli_main(["bench", "--recipe", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'bf16': the weights need 64.6 GiB per device, available host memory is 8.0 GiB" in err
