"""RTN (qjax.autoround.rtn.quantize_model): the same bits as compressed-tensors' own RTN, and clear refusals."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from oracles.ct import RECIPES, write_ct_checkpoint

import qjax


def test_rtn_in_qjax_equals_compressed_tensors_rtn(hf128, tmp_path):
    """qjax's own RTN (quantize_model) packs the same bits as compressed-tensors' calculate_qparams + compress."""
    import copy

    import torch

    from qjax.autoround.rtn import quantize_model

    # a bf16 model, as llmcompressor runs it: compressed-tensors computes in the weight dtype
    hf = copy.deepcopy(hf128).to(torch.bfloat16)
    recipe = RECIPES["int4_asym_g32"]
    folder = write_ct_checkpoint(hf, tmp_path / "ct", recipe)
    ct_model = qjax.load_model(folder)
    dense_dir = tmp_path / "dense"
    hf.save_pretrained(dense_dir)
    dense = qjax.load_model(dense_dir, dtype=ct_model.dtype)
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    ours = quantize_model(dense, qc)
    from qjax.checkpoint.layout import checkpoint_tensors
    a = {k: g() for k, _, g in checkpoint_tensors(ours)}
    b = {k: g() for k, _, g in checkpoint_tensors(ct_model)}
    assert set(a) == set(b)
    diff = [k for k in a if np.asarray(a[k]).tobytes() != np.asarray(b[k]).tobytes()]
    assert not diff, diff[:5]


def test_rtn_names_the_module_when_groups_do_not_divide(tiny_hf):
    from qjax.convert.planner import recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    model = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    with pytest.raises(ValueError,
                       match=r"model\.layers\.\d+\..*\[.*\]: 64 columns are not divisible by group_size 128"):
        quantize_model(model, recipe_to_qconfig("w4a16"))


# ---------------------------------------------------------------------------------------------------------------------
# the parts every seed keeps in BF16 (qjax.quant.unquantized): the MTP head and the vision tower
# ---------------------------------------------------------------------------------------------------------------------
# W4 g32 with INT2 g32 experts; in_proj_a/b (4 rows) dense, as auto-round leaves them, so both formats can hold it
RECIPE = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"experts": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                        "weights": {"num_bits": 2, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": 32}},
                            "rest": {"targets": ["Linear"],
                                     "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                 "strategy": "group", "group_size": 32}}},
          "ignore": ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*in_proj_[ab]$"]}


@pytest.fixture(scope="module")
def bf16_official(tmp_path_factory):
    """The tiny model in bf16 in the official Qwen3.6 layout: composite config, fused experts, a BF16 vision tower
    and a BF16 MTP head with fused experts (tests/oracles/hf.py)."""
    import torch
    from oracles.hf import make_hf_model, save_hf, tiny_text_config, write_official_layout

    tmp = tmp_path_factory.mktemp("bf16-official")
    hf = make_hf_model(tiny_text_config(), seed=0).to(torch.bfloat16)
    return write_official_layout(save_hf(hf, tmp / "src"), tmp / "official", shards=1, mtp_fused=True)


def _state(module) -> dict:
    from flax import nnx

    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def assert_kept_as_stored(source: str, export: str) -> None:
    """Every mtp.* and model.visual.* tensor of ``source`` is in ``export`` under the same key, dtype and bytes,
    nothing else of them is, and the export's quantization config lists both parts as unquantized (compressed-tensors
    ``ignore`` or auto-round ``extra_config``)."""
    from oracles.autoround import read_tensors

    from qjax.checkpoint.view import Checkpoint
    from qjax.quant.unquantized import KEPT_UNQUANTIZED, kept_part

    src, dst = Checkpoint(source), Checkpoint(export)
    try:
        kept = sorted(k for k in src.keys() if kept_part(k) is not None)
        assert {kept_part(k) for k in kept} == set(KEPT_UNQUANTIZED)
        assert kept == sorted(k for k in dst.keys() if kept_part(k) is not None)
        assert any(k.endswith("mlp.experts.gate_up_proj") and k.startswith("mtp.") for k in kept)  # fused, as stored
        for k in kept:
            assert src.dtype(k) == dst.dtype(k) == "BF16", k
        a, b = read_tensors(source), read_tensors(export)
        assert all(a[k].tobytes() == b[k].tobytes() for k in kept)
    finally:
        src.close()
        dst.close()
    cfg = json.load(open(os.path.join(export, "config.json")))
    assert "vision_config" in cfg and cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    qc = cfg["quantization_config"]
    listed = qc.get("ignore") or [k for k, v in qc["extra_config"].items() if v.get("bits") == 16]
    assert all((p.ignore_entry if "ignore" in qc else p.regex) in listed for p in KEPT_UNQUANTIZED)


@pytest.mark.slow  # two quantize + write + load round trips and MTP-head forwards (~15 s on 2 cores)
@pytest.mark.parametrize("fmt", ["llm_compressor", "auto_round"])
def test_rtn_export_keeps_mtp_head_and_vision_as_stored(bf16_official, fmt, tmp_path):
    """RTN leaves the MTP head as loaded although the Linear target matches its modules; exported with its source,
    both writers copy the BF16 head (fused experts and all) and vision tower byte for byte next to an F32 body, list
    them unquantized, and the folder reloads with a head that computes the source model's MTP logits exactly."""
    from qjax.convert import save_autoround, save_pretrained

    from qjax.autoround.rtn import quantize_model

    dense = qjax.load_model(bf16_official, dtype=jnp.float32)
    qm = quantize_model(dense, RECIPE)
    assert qm.quant is not None and qm.mtp is not None
    before, after = _state(dense.mtp), _state(qm.mtp)
    assert before.keys() == after.keys() and all(np.array_equal(before[p], after[p]) for p in before)
    save = save_pretrained if fmt == "llm_compressor" else save_autoround
    out = save(qm, tmp_path / fmt, source=bf16_official)
    assert_kept_as_stored(bf16_official, out)
    back = qjax.load_model(out)
    assert back.dtype == jnp.float32 and back.quant is not None
    if fmt == "llm_compressor":  # (auto_round stores float16 scales: the same plan but for the scale dtype)
        assert back.quant == qm.quant
    ids = np.random.default_rng(9).integers(0, 512, (2, 10)).astype(np.int32)
    hidden = dense.forward(jnp.asarray(ids)).hidden
    np.testing.assert_array_equal(np.asarray(back.mtp_logits(ids, hidden)), np.asarray(dense.mtp_logits(ids, hidden)))


def test_rtn_export_without_source_lists_the_head_and_refuses_a_changed_one(bf16_official, tmp_path):
    """Without a source the model's own head is written (per expert, in the model dtype) and still listed as
    unquantized; a source whose head the model no longer holds is refused, naming the tensor, and nothing is left."""
    from qjax.convert import save_pretrained

    from qjax.autoround.rtn import quantize_model
    from qjax.quant.unquantized import KEPT_UNQUANTIZED

    qm = quantize_model(qjax.load_model(bf16_official, dtype=jnp.float32), RECIPE)
    out = save_pretrained(qm, tmp_path / "own")
    ignore = json.load(open(os.path.join(out, "config.json")))["quantization_config"]["ignore"]
    mtp, visual = KEPT_UNQUANTIZED
    assert mtp.ignore_entry in ignore and visual.ignore_entry in ignore  # the model holds the source's tower
    qm.mtp.norm.weight.set_value(qm.mtp.norm.weight[...] + 1.0)
    with pytest.raises(ValueError, match=r"mtp\.norm\.weight: the MTP head of the model differs"):
        save_pretrained(qm, tmp_path / "changed", source=bf16_official)
    assert sorted(os.listdir(tmp_path)) == ["own"]
