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

import numpy as np
import pytest
import torch

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
    assert [r["kind"] for r in got["rows"][1:5]] == ["linear_attention"] * 3 + ["full_attention"]
    assert got["tokens"] == 80 and got["qjax_dtype"] == "float32"
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
