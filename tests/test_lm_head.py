"""A quantized LM head: the recipe grammar that asks for it, the logits path that runs it (the packed qmatmul, not a
dequantized copy), the writer round trip, the decode-step bytes, and ``qjax quantize --quant_lm_head``."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.hf import tiny_text_config
from qjax.convert import save_pretrained
from qjax.convert.planner import PRESETS, RecipeError, plan_recipe_cfg, recipe_items, recipe_to_qconfig

import qjax
from qjax.model.config import TextConfig
from qjax.quant.config import QuantizationConfig

BODY = "experts=int2:g32,rest=int4:g32"  # the seed-000 shape of recipe at the tiny model's group sizes


def small_config() -> TextConfig:
    """The tiny config cut to one GDN and one attention layer (the model tests compile in half the time)."""
    return TextConfig.from_dict(tiny_text_config(num_hidden_layers=2, layer_types=["linear_attention",
                                                                                    "full_attention"]))


def _qconfig(folder):
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)["quantization_config"]


def _head_scheme(recipe):
    raw = recipe_to_qconfig(recipe)
    return None if raw is None else QuantizationConfig.from_dict(raw, source="test").scheme_for("lm_head")


def test_recipe_grammar_quantizes_the_head_only_when_asked():
    """Every preset keeps the head BF16; ``PRESET,lm_head=S`` adds it as its own config group (a name target, out
    of the ignore list); a later item replaces an earlier one of the same selector, wherever it comes from."""
    for preset in PRESETS:
        assert _head_scheme(preset) is None, preset
    raw = recipe_to_qconfig("w2w4,lm_head=int8:channel")
    head = [g for g in raw["config_groups"].values() if g["targets"] == ["lm_head"]]
    assert len(head) == 1 and "lm_head" not in raw["ignore"]
    assert head[0]["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                  "group_size": None}
    s = _head_scheme("w2w4,lm_head=int4:g128")
    assert (s.num_bits, s.strategy, s.group_size) == (4, "group", 128)
    assert _head_scheme("w2w4,lm_head=int4:g128,lm_head=bf16") is None
    assert list(recipe_items("w2w4,lm_head=int8:channel,experts=int4:g32")) == ["rest", "lm_head", "experts"]
    assert recipe_items("mxfp8-experts,kv=bf16")["kv"] == "bf16" and recipe_to_qconfig("mxfp8-experts,kv=bf16")[
        "kv_cache_scheme"] is None


@pytest.mark.parametrize("recipe, message", [
    ("w2w4,lm_head=fp8", "lm_head=fp8: unknown scheme 'fp8'"),
    ("w2w4,lm_head=int8:channel:g128", "lm_head=int8:channel:g128: channel and g128 both given"),
    ("w2w4,lm_head=int4:g128:asym:sym", "asym and sym both given"),
    ("w2w4,lm_head=int4:g64x", "unknown scheme option 'g64x'"),
    ("w2w4,lm_head=mxfp8:g64", "mxfp8 takes no options"),
    ("w2w4,lm_head", "recipe item 'lm_head' is not SELECTOR=SCHEME"),
    ("w2w4,head=int8:channel", "recipe selector 'head' unknown"),
    ("head=bf16", "recipe selector 'head' unknown"),
])
def test_bad_head_specs_are_one_line_errors(recipe, message):
    with pytest.raises(RecipeError, match=message) as e:
        recipe_to_qconfig(recipe)
    assert "\n" not in str(e.value)


def test_bad_head_specs_against_the_config():
    """What needs the config: a group that does not divide the hidden size, and a head tied to the embedding."""
    cfg = TextConfig.from_dict(tiny_text_config())
    with pytest.raises(ValueError, match="lm_head: group_size 48 .* does not divide its 64 input columns") as e:
        plan_recipe_cfg(cfg, "lm_head=int8:g48")
    assert "\n" not in str(e.value)
    tied = TextConfig.from_dict(tiny_text_config(tie_word_embeddings=True))
    with pytest.raises(RecipeError, match="lm_head: this config ties it to the embedding"):
        plan_recipe_cfg(tied, "w2w4,lm_head=int8:channel")
    assert plan_recipe_cfg(tied, "experts=int2:g32").lm_head_bytes == 0  # no head of its own: nothing refused


def test_inspect_prints_the_head_in_the_decode_step_bytes():
    """The decode-step line: the head's bytes (BF16 V·H·2; int8 channel V·H + V bf16 scales) inside the weights."""
    cfg = TextConfig.from_dict(tiny_text_config())
    v, h = cfg.vocab_size, cfg.hidden_size
    bf16, int8 = plan_recipe_cfg(cfg, BODY), plan_recipe_cfg(cfg, BODY + ",lm_head=int8:channel")
    assert bf16.lm_head_bytes == v * h * 2 and int8.lm_head_bytes == v * h + v * 2
    assert bf16.decode["weights"] - int8.decode["weights"] == bf16.lm_head_bytes - int8.lm_head_bytes
    from qjax.convert.planner import format_plan

    line = [x for x in format_plan(int8, title="t").splitlines() if x.startswith("decode step at batch 1")]
    assert line and f"lm_head {int8.lm_head_bytes / 1e6:,.1f} MB" in line[0]


@pytest.fixture(scope="module")
def head_models():
    """A tiny random model with the seed-000 body and an int8 per-channel head, and the same body with a BF16 head."""
    from qjax.runtime.random_model import random_model

    cfg = small_config()
    return (random_model(cfg, BODY + ",lm_head=int8:channel", dtype=jnp.float32, seed=1),
            random_model(cfg, BODY, dtype=jnp.float32, seed=1))


def test_packed_head_runs_the_qmatmul_kernel(head_models):
    """The logits of a packed head go through qjax.kernels.qmatmul like any packed linear: with the Pallas kernels
    (interpret mode here) the head is a pallas_call on the packed words, no dequantized [V, H] copy, and the float32
    logits equal the reference kernel's."""
    model, _ = head_models
    h = jax.random.normal(jax.random.key(0), (2, 3, model.config.hidden_size), jnp.float32)
    with qjax.kernels.use("interpret"):
        jaxpr = str(jax.make_jaxpr(model.logits_from_hidden)(h))
        pallas = np.asarray(jax.jit(model.logits_from_hidden)(h))
    assert "pallas_call" in jaxpr
    v, k = model.config.vocab_size, model.config.hidden_size
    assert f"f32[{v},{k}]" not in jaxpr  # no dense copy of the head
    with qjax.kernels.use("reference"):
        ref = np.asarray(model.logits_from_hidden(h))
    assert pallas.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(pallas, ref, rtol=1e-5, atol=1e-5)


def test_quantized_head_round_trips_through_the_writer(head_models, tmp_path):
    """save_pretrained writes the head in its own config group; qjax loads it back to the same plan and logits; the
    head changes the logits (it is not silently left BF16)."""
    model, body_only = head_models
    out = save_pretrained(model, tmp_path / "q")
    qc = _qconfig(out)
    groups = [g for g in qc["config_groups"].values() if "lm_head" in g["targets"]]
    assert len(groups) == 1 and groups[0]["targets"] == ["lm_head"] and "lm_head" not in qc["ignore"]
    assert (groups[0]["weights"]["num_bits"], groups[0]["weights"]["strategy"]) == (8, "channel")
    back = qjax.load_model(out, dtype=jnp.float32)
    assert back.quant == model.quant and back.quant.lm_head.bits == 8
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 7))
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))
    assert not np.array_equal(np.asarray(model(ids)), np.asarray(body_only(ids)))


# ---------------------------------------------------------------------------------------------------------------------
# qjax quantize --quant_lm_head
# ---------------------------------------------------------------------------------------------------------------------
def test_quant_lm_head_flag_and_auto_rounds_rule(caplog):
    """--quant_lm_head (auto-round's flag, --no-quant_lm_head too) reaches the config; the head then takes the global
    scheme, a --layer_config pattern that matches lm_head asks for it by itself (with its fields), --ignore_layers
    lm_head keeps it float; a tied head is refused with auto-round's warning, only when it would be quantized."""
    from qjax.autoround import head
    from qjax.autoround.api import config_from_args
    from qjax.autoround.schemes import Scheme, ignore_layers_config
    from qjax.cli import build_parser

    def cfg(*flags):
        return config_from_args(build_parser().parse_args(["quantize", "--output_dir", "x", *flags]))

    assert cfg("--quant_lm_head").quant_lm_head and not cfg("--no-quant_lm_head").quant_lm_head
    assert not cfg().quant_lm_head
    base, experts = Scheme(4, 128), {".*experts.*": {"bits": 2, "group_size": 64}}
    assert head.wanted(base, True, experts, tied=False) == base
    assert head.wanted(base, False, experts, tied=False) is None
    assert head.wanted(base, False, {"lm_head": {"bits": 8, "group_size": -1}}, tied=False) == Scheme(8, -1)
    assert head.wanted(base, False, {".*": {"bits": 8}}, tied=False) == Scheme(8, 128)  # regexes reach the head
    assert head.wanted(base, True, ignore_layers_config("lm_head,mlp.gate"), tied=False) is None
    with caplog.at_level("WARNING", logger="qjax.autoround"):
        assert head.wanted(base, True, ignore_layers_config("lm_head"), tied=True) is None
        assert "tied" not in caplog.text
        assert head.wanted(base, True, {}, tied=True) is None
    assert "tied weights" in caplog.text


def test_head_only_rtn_run_writes_and_loads(tmp_path):
    """A run that quantizes the head alone (global bits 16, a layer_config entry for lm_head): RTN at iters 0,
    packed in the model, written in its own group, loaded back to the same logits."""
    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.model.qwen3_5_moe import init_model

    model = init_model(small_config(), dtype=jnp.float32, seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 16))
    ar = AutoRound(model, ids, AutoRoundConfig(bits=16, layer_config={"lm_head": {"bits": 8, "group_size": -1}},
                                               iters=0, nsamples=4, seqlen=16, batch_size=4), progress=False)
    ar.run()
    q = ar.quantized_model()
    assert q.quant.lm_head.bits == 8 and q.quant.lm_head.strategy == "channel"
    assert not any(q.quant.layers)  # the decoder stays float
    assert [r.kind for r in ar.reports][-1] == "lm_head"
    out = save_pretrained(q, tmp_path / "q")
    qc = _qconfig(out)
    assert [g["targets"] for g in qc["config_groups"].values()] == [["lm_head"]] and "lm_head" not in qc["ignore"]
    np.testing.assert_array_equal(np.asarray(qjax.load_model(out, dtype=jnp.float32)(ids)), np.asarray(q(ids)))


def test_tuned_head_keeps_its_best_iteration():
    """iters > 0: the head is tuned after the last block; iteration 0 is RTN, the kept iteration's loss is no worse,
    and the tuned codes differ from RTN's."""
    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.model.qwen3_5_moe import init_model

    model = init_model(small_config(), dtype=jnp.float32, seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 16))
    common = {"bits": 16, "layer_config": {"lm_head": {"bits": 2, "group_size": 32}}, "nsamples": 8, "seqlen": 16,
              "batch_size": 4}
    tuned = AutoRound(model, ids, AutoRoundConfig(iters=20, **common), progress=False)
    tuned.run()
    rep = tuned.reports[-1]
    assert rep.kind == "lm_head" and rep.best_loss < rep.init_loss and rep.best_iter > 0
    rtn = AutoRound(model, ids, AutoRoundConfig(iters=0, disable_opt_rtn=True, **common), progress=False)
    rtn.run()
    assert not np.array_equal(tuned.head_result.packed, rtn.head_result.packed)


@pytest.mark.slow
@pytest.mark.subprocess
def test_rtn_head_matches_auto_round(tmp_path):
    """iters 0 without optimized RTN, --quant_lm_head: qjax's head equals auto-round 0.16.1's own (which stores it
    fake-quantized in the model dtype in its auto_round export: compared after the same rounding)."""
    from oracles.autoround import run_auto_round, write_base, write_calibration
    from qjax.kernels import dequantize
    from safetensors import safe_open

    from qjax.autoround.driver import AutoRound, AutoRoundConfig

    base = write_base(tmp_path / "base")
    calib = write_calibration(tmp_path / "calib.json")
    theirs_dir = run_auto_round(base, calib, str(tmp_path / "ar"), bits=4, group_size=32, layer_config={}, iters=0,
                                disable_opt_rtn=True, quant_lm_head=True, fmt="auto_round", disable_model_free=True)
    with safe_open(os.path.join(theirs_dir, "model.safetensors"), "pt") as f:
        theirs = f.get_tensor("lm_head.weight").float().numpy()
    model = qjax.load_model(base)
    ar = AutoRound(model, np.zeros((8, 64), np.int32), AutoRoundConfig(bits=4, group_size=32, iters=0,
                                                                       disable_opt_rtn=True, quant_lm_head=True),
                   progress=False)
    ar.run()
    head = ar.quantized_model().lm_head
    ours = np.asarray(dequantize(*head.arrays(), head.meta, model.dtype)).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)
