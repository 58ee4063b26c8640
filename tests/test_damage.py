"""qjax.research.damage and ``qjax compare --damage``: per-block repair / damage KL of a quantized build against its
source, through the real command line; the ranking's suggestion is a ``--layer_config`` qjax quantize reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from qjax.convert import save_pretrained

import qjax
from qjax.cli import main


@pytest.fixture(scope="module")
def int2_folder(tiny_hf, tmp_path_factory):
    from qjax.autoround.rtn import quantize_model

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    return str(save_pretrained(quantize_model(qjax.load_model(tiny_hf[1]), qc), tmp_path_factory.mktemp("dmg") / "q"))


def test_damage_ranks_blocks_and_suggests_a_layer_config(tiny_hf, int2_folder, capsys):
    from qjax.autoround.schemes import parse_layer_config

    code = main(["compare", "--damage", "--model", int2_folder, "--reference", tiny_hf[1], "--seqlen", "32",
                 "--max-tokens", "64", "--suggest-group-size", "32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["tokens"] == 64 and report["base_kl"] > 0
    blocks = report["blocks"]
    assert sorted(report["ranking"]) == [0, 1, 2, 3]
    gains = [blocks[i]["gain"] for i in report["ranking"]]
    assert gains == sorted(gains, reverse=True) and gains[0] > 0
    for b in blocks:
        assert b["repair_kl"] == pytest.approx(report["base_kl"] - b["gain"])
        assert b["damage_kl"] >= 0
    config = parse_layer_config(json.dumps(report["layer_config"]))
    assert len(config) == 2 and all(f"layers.{i}." in k for k, i in zip(config, report["ranking"]))
    assert all(v["group_size"] == 32 for v in config.values())


def test_repairing_every_block_leaves_no_divergence(tiny_hf, int2_folder):
    """The source's blocks patched into every layer of the quantized model give the source's logits exactly."""
    from qjax.research.damage import mean_kl
    from qjax.research.patch import swap_blocks

    source, q = qjax.load_model(tiny_hf[1]), qjax.load_model(int2_folder)
    ids = np.random.default_rng(1).integers(0, 512, (2, 32))
    total, n = mean_kl(source(ids), swap_blocks(q, source, ids, range(4)).logits)
    assert total == 0.0 and n == 64
