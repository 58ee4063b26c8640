"""``qjax compare`` (qjax.evaluation.compare): the per-block diff of qjax against transformers, through the library
and the real entry point.

Tolerances: compare's float32 blocks match transformers to ≈1e-5 relative on the tiny model (tests/test_model.py's
logit tolerance is 1e-4 absolute); a perturbed weight moves its block by > 1e-2.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from oracles.ct import RECIPES, int_weights

import qjax

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def _qjax(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "qjax.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def _json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_compare_tiny_checkpoint_against_transformers(tiny_hf):
    got = _json(_qjax("compare", "--model", tiny_hf[1], "--json", "--quiet"))
    names = [r["name"] for r in got["rows"]]
    assert names == ["embed", "block 0", "block 1", "block 2", "block 3", "final norm", "logits"]
    assert [r["kind"] for r in got["rows"][1:5]] == ["linear_attention", "full_attention"] * 2
    assert got["tokens"] == 80 and got["qjax_dtype"] == "float32" and got["reference_dtype"] == "float32"
    assert got["fp8_kv"] == "none" and "0 quantized modules" in got["reference"]
    for r in got["rows"]:
        # 2e-4 absolute as tests/test_model.py explains (two fp32 implementations; 1.6e-4 on the final norm, whose
        # values reach ~5, on an AMD EPYC host), 1e-4 relative
        assert r["max_abs"] < 2e-4 and r["max_rel"] < 1e-4, r
        assert 0 <= r["mean_abs"] <= r["max_abs"]
    assert got["first_diverging_block"] is None and got["top1_agreement"] == 1.0


def test_compare_blocks_names_the_perturbed_block(tiny_hf):
    from qjax.evaluation.compare import compare_blocks

    hf, folder = tiny_hf
    hf = copy.deepcopy(hf)
    with torch.no_grad():  # block 2's shared expert is off by a few per cent in transformers only
        w = hf.model.layers[2].mlp.shared_expert.down_proj.weight
        w.mul_(1.05)
    ids = np.random.default_rng(1).integers(0, 512, (1, 40))
    report = compare_blocks(qjax.load_model(folder), hf, ids)
    assert report.first_diverging() == 2
    rel = [r.max_rel for r in report.rows if r.block is not None]
    assert max(rel[:2]) < 1e-4 < 1e-2 < min(rel[2:]), rel
    assert "first diverging block: 2 (linear_attention)" in report.format()


def test_compare_reads_a_compressed_tensors_folder(tiny_hf, tmp_path):
    """transformers decompresses a qjax-written pack-quantized folder (per-expert packed experts included) to the
    same function qjax computes from the packed weights."""
    from qjax.convert import save_pretrained

    from qjax.autoround.rtn import quantize_model
    from qjax.evaluation.compare import compare_folder

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    out = save_pretrained(quantize_model(qjax.load_model(tiny_hf[1]), qc), tmp_path / "ct")
    report = compare_folder(out, np.arange(1, 30)[None], quiet=True)
    assert report.first_diverging() is None and report.top1_agreement == 1.0
    assert report.rows[-1].max_abs < 1e-4


def test_refusals_name_the_option(capsys, tiny_hf):
    from qjax.cli import main

    assert main(["compare", "--model", tiny_hf[1], "--ids", "1 2", "--seqlen", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "--ids and --seqlen" in err, err


# ---------------------------------------------------------------------------------------------------------------------
# every kind of checkpoint the tests build with the real tools
# ---------------------------------------------------------------------------------------------------------------------
def _verdict(folder, ids=None):
    from qjax.evaluation.compare import compare_folder

    ids = np.random.default_rng(2).integers(0, 512, (1, 70)) if ids is None else ids
    return compare_folder(str(folder), ids, quiet=True)


def test_no_diverging_block_on_compressed_tensors_checkpoints(ct_ckpt):
    """Every recipe compressed-tensors itself writes (INT2/4/8, group/channel, asymmetric, MXFP8, FP8 KV per tensor
    and per head): the reference is built from compressed-tensors' decompression, so nothing diverges."""
    name, folder = ct_ckpt
    report = _verdict(folder)
    assert report.first_diverging() is None, report.format()
    assert report.top1_agreement == 1.0
    kv = RECIPES[name]["kv_cache"] is not None
    assert report.fp8_kv == ("emulated on both sides" if kv else "none")
    assert "0 quantized modules" not in report.reference


def test_no_diverging_block_on_the_official_layout(official_dir):
    """transformers' own weights rewritten to the official composite layout (fused experts, visual, MTP)."""
    report = _verdict(official_dir)
    assert report.first_diverging() is None and report.top1_agreement == 1.0, report.format()


def test_no_diverging_block_on_qjax_exports(tiny_hf, tmp_path):
    """qjax's own exports: compressed-tensors (the MoE with INT2 experts) and auto_round (GPTQ packing)."""
    from qjax.convert import save_pretrained
    from qjax.convert.autoround_writer import save_autoround

    from qjax.autoround.rtn import quantize_model

    # the auto_round format holds layers whose dims are multiples of 32 (in_proj_a/b have 4 rows here)
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "ignore": ["lm_head", r"re:.*in_proj_[ab]$", r"re:.*shared_expert_gate$"],
          "config_groups": {"experts": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                        "weights": int_weights(2, group=32)},
                            "rest": {"targets": ["Linear"], "weights": int_weights(4, group=32)}}}
    model = quantize_model(qjax.load_model(tiny_hf[1]), qc)
    for folder in (save_pretrained(model, tmp_path / "ct"), save_autoround(model, tmp_path / "ar")):
        report = _verdict(folder)
        assert report.first_diverging() is None and report.top1_agreement == 1.0, (folder, report.format())


def test_no_diverging_block_on_an_auto_round_export(tmp_path):
    """auto-round 0.16.1's own auto_round export (run in a subprocess, as tests/oracles/autoround.py does)."""
    from oracles.autoround import isolated
    from oracles.hf import make_hf_model, save_hf, tiny_text_config

    source = save_hf(make_hf_model(tiny_text_config(), seed=0, dtype=torch.bfloat16), tmp_path / "src")
    folder = isolated("autoround_export_here", source=source, out=str(tmp_path / "ar"), sym=True,
                      layer_config={".*experts.*": {"bits": 2, "group_size": 16}})
    report = _verdict(folder)
    assert report.first_diverging() is None and report.top1_agreement == 1.0, report.format()
    assert "0 quantized modules" not in report.reference


@pytest.mark.parametrize("recipe,layer", [("w2_experts_w4_rest", 0), ("w2_experts_w4_rest", 3),
                                          ("int4_asym_kv_head", 3)])
def test_a_corrupted_layer_is_named(hf128, tmp_path, recipe, layer):
    """qjax's model of a correct checkpoint with one layer's packed weights corrupted in memory (what a wrong
    decoder or kernel would do) diverges exactly at that block (with FP8 KV too, past its rounding tolerance)."""
    from oracles.ct import write_ct_checkpoint

    from qjax.evaluation.compare import compare_blocks
    from qjax.evaluation.torch_reference import build_reference

    calib = np.random.default_rng(0).integers(0, 512, (2, 24))
    folder = write_ct_checkpoint(hf128, tmp_path / recipe, RECIPES[recipe], calib_ids=calib)
    model = qjax.load_model(folder)
    kind = model.config.layer_types[layer]
    period = len(model.layer_kinds)
    block = model.groups.layers[layer % period]
    target = block.linear_attn.out_proj if kind == "linear_attention" else block.self_attn.o_proj
    packed = np.array(target.weight_packed[...])
    packed[layer // period, :2] ^= 0x11111111  # one bit of every 4-bit value of two output rows
    target.weight_packed.set_value(jnp.asarray(packed))
    ref = build_reference(folder)
    report = compare_blocks(model, ref.model, np.random.default_rng(2).integers(0, 512, (1, 70)), fp8_kv=ref.fp8_kv)
    assert report.first_diverging() == layer, report.format()
    assert f"first diverging block: {layer} ({kind})" in report.format()


def test_ground_truth_mode_through_the_cli(tiny_hf):
    """``qjax compare --dtype float64``: qjax float64 = transformers float64 everywhere; float32 and bfloat16 of both
    side by side against it."""
    got = _json(_qjax("compare", "--model", tiny_hf[1], "--dtype", "float64", "--json", "--quiet", "--seqlen", "70"))
    assert got["truth"] == "transformers float64 everywhere" and got["dtypes"] == ["float32", "bfloat16"]
    assert [r["name"] for r in got["rows"]] == ["embed", "block 0", "block 1", "block 2", "block 3", "final norm",
                                                "logits"]
    for r in got["rows"]:
        assert r["float64"] <= 1e-10, r
        for d in ("float32", "bfloat16"):
            for side in ("qjax", "transformers"):
                max_rel, rms_rel = r["errors"][d][side]
                assert 0 <= rms_rel <= max_rel
        if r["name"] != "embed":  # embeddings are exact in float32; every later row carries float32 rounding
            assert 1e-9 < r["errors"]["float32"]["qjax"][1] < 1e-5 < r["errors"]["bfloat16"]["qjax"][1] < 0.1, r
    assert got["top1_agreement"]["float32"] == {"qjax": 1.0, "transformers": 1.0}


def test_float64_quantized_equals_the_decompressed_float64_oracle(ct_ckpt, x64):
    """A compressed-tensors checkpoint in float64 (packed weights dequantized to compressed-tensors' decompression
    output, exact in float64; FP8 KV emulated on both sides) = transformers float64 everywhere on the decompressed
    weights, to 1e-10 of the logits' scale; and compare_truth's table says so block by block."""
    from qjax.evaluation.compare import compare_truth
    from qjax.evaluation.torch_reference import build_reference

    name, folder = ct_ckpt
    ids = np.random.default_rng(7).integers(0, 512, (2, 70))
    ref = build_reference(folder, "float64")
    with torch.no_grad(), ref.running():
        want = ref.model(input_ids=torch.as_tensor(ids), use_cache=False).logits.numpy()
    model = qjax.load_model(folder, dtype="float64")
    assert model.dtype == jnp.float64 and ref.decompressed > 0
    got = np.asarray(model(ids))
    assert got.dtype == np.float64
    assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max(), name
    if name == "int4_asym_kv_head":  # asymmetric INT4 + FP8 KV per head through the ground-truth report too
        report = compare_truth(folder, ids[:1], dtypes=("float32",), quiet=True)
        assert max(r.float64 for r in report.rows) <= 1e-10 and report.fp8_kv == ref.fp8_kv
