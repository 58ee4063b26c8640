"""qjax.research.routing and ``qjax compare --routing``: seed 002's incident — AWQ-style smoothing scales folded into
``post_attention_layernorm`` and divided out of the routed experts' and the shared expert's gate/up inputs, the router
(``mlp.gate``) and ``mlp.shared_expert_gate`` left uncompensated — is flagged at every affected layer (exit 1); the
correctly compensated checkpoint (router and shared-expert gate divided too) and a quantized build are not (exit 0).

The scales are AWQ's rule on the tiny model's own MoE inputs (``mean |x| ** 0.5``; 0.51–1.46 here): on 128 tokens the
uncompensated router's isolated agreement reads 0.90–0.95 and its KL ≥ 5e-3 (threshold 0.99 / 1e-4), the compensated
one 1.0 and ~3e-15.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from qjax.convert import save_pretrained

import qjax
from qjax.cli import main
from qjax.research.routing import compare_routing, fold_smoothing_scales, smoothing_scales

ARGS = ["--seqlen", "64", "--max-tokens", "128"]  # two rows of seeded random ids


@pytest.fixture(scope="module")
def folded(tiny_hf, tmp_path_factory):
    model = qjax.load_model(tiny_hf[1])
    scales = smoothing_scales(model, np.random.default_rng(0).integers(0, 512, (2, 64)))
    tmp = tmp_path_factory.mktemp("routing")
    return {name: str(save_pretrained(fold_smoothing_scales(model, scales, compensate_router=comp), tmp / name))
            for name, comp in (("uncompensated", False), ("compensated", True))}


def test_uncompensated_router_is_flagged_at_every_layer(tiny_hf, folded, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["compare", "--routing", "--model", folded["uncompensated"], "--reference", tiny_hf[1], *ARGS,
                 "--json", str(out)])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 1, text
    assert report["flagged"] == [0, 1, 2, 3] and report["tokens"] == 128
    assert "flagged: layers 0, 1, 2, 3" in text and text.count("FLAG") == 4
    for r in report["layers"]:
        assert r["isolated_agreement"] < 0.99 and r["isolated_kl"] > 1e-3, r
        assert sum(r["load"]) == pytest.approx(1.0) and len(r["reference_load"]) == 8


def test_compensated_router_is_not_flagged(tiny_hf, folded, capsys):
    code = main(["compare", "--routing", "--model", folded["compensated"], "--reference", tiny_hf[1], *ARGS,
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["flagged"] == []
    assert report["min_agreement"] == 0.99 and report["max_router_kl"] == 1e-4
    for r in report["layers"]:
        assert r["isolated_agreement"] == 1.0 and r["isolated_kl"] < 1e-12, r


def test_a_quantized_build_routes_the_reference_stream_exactly(tiny_hf):
    """Quantization keeps the norms and the router in float: isolated routing identical, end to end drifting."""
    from qjax.autoround.rtn import quantize_model

    model = qjax.load_model(tiny_hf[1])
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    ids = np.random.default_rng(0).integers(0, 512, (2, 64))
    report = compare_routing(quantize_model(model, qc), model, ids)
    assert report.flagged == []
    assert all(r.isolated_agreement == 1.0 and r.isolated_kl == 0.0 for r in report.layers)
    assert min(r.agreement for r in report.layers) < 1.0  # INT2 moves the stream, hence the end-to-end routing


def test_bad_input_is_one_line(tiny_hf, capsys):
    assert main(["compare", "--routing", "--model", tiny_hf[1]]) == 2
    assert main(["compare", "--routing", "--model", tiny_hf[1], "--reference", "/nonexistent/folder"]) == 2
    assert main(["compare", "--model", tiny_hf[1], "--min-agreement", "0.9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err), err
    assert "--reference" in err[0] and "/nonexistent/folder" in err[1] and "--routing" in err[2]


def test_cli_defaults_are_the_library_defaults():
    from qjax.cli.evaluate import ROUTING_MAX_ROUTER_KL, ROUTING_MIN_AGREEMENT
    from qjax.research.routing import DEFAULT_MAX_ROUTER_KL, DEFAULT_MIN_AGREEMENT

    assert (ROUTING_MIN_AGREEMENT, ROUTING_MAX_ROUTER_KL) == (DEFAULT_MIN_AGREEMENT, DEFAULT_MAX_ROUTER_KL)
