"""qjax.research.lens and ``qjax compare --lens``: the last layer's lens is the model's own prediction; against a
reference, the lens KL is zero for the model itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qjax
from qjax.cli import main
from qjax.research.lens import logit_lens, logit_lens_array


def test_last_layer_lens_is_the_final_prediction(tiny_hf):
    model = qjax.load_model(tiny_hf[1])
    ids = np.random.default_rng(2).integers(0, 512, (2, 16))
    arr = logit_lens_array(model, ids, reference=model)
    assert arr["loss"].shape == (4, 2, 15) and arr["kl_reference"].shape == (4, 2, 15)
    assert arr["top1_final"][-1].all() and np.abs(arr["kl_final"][-1]).max() < 1e-6
    np.testing.assert_allclose(arr["loss"][-1], arr["final_loss"], rtol=1e-6)
    assert np.abs(arr["kl_reference"]).max() < 1e-6  # a model against itself
    report = logit_lens(model, ids)
    assert report.tokens == 30 and report.layers[-1].top1_final == 1.0 and "KL to final" in report.format()
    with pytest.raises(ValueError, match="2 tokens"):
        logit_lens_array(model, ids[:, :1])


def test_lens_command(tiny_hf, capsys):
    assert main(["compare", "--lens", "--model", tiny_hf[1], "--seqlen", "16", "--max-tokens", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in report["layers"]] == [0, 1, 2, 3] and report["reference"] is None
    assert main(["compare", "--lens", "--damage", "--model", tiny_hf[1]]) == 2
    assert "one of --routing, --damage, --lens" in capsys.readouterr().err
