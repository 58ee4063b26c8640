"""HF folder writer: what qjax writes, transformers and qjax load back identically; writes are atomic."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from oracles.ct import IGNORE, int_weights
from qjax.convert import save_pretrained

import qjax


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_round_trip_through_transformers(official_dir, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    model = qjax.load_model(official_dir)
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=200_000)  # forces several shards + index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    ids = np.random.default_rng(0).integers(0, 512, (2, 40)).astype(np.int32)
    want = np.asarray(model(ids))
    again = qjax.load_model(out)
    np.testing.assert_array_equal(np.asarray(again(ids)), want)
    assert again.mtp is not None
    np.testing.assert_array_equal(np.asarray(again.mtp_logits(ids)), np.asarray(model.mtp_logits(ids)))
    hf = Qwen3_5MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs - want).max() <= 2e-4  # two fp32 implementations: see tests/test_model.py


def test_fused_bf16_layout(tiny_hf, tmp_path):
    model = qjax.load_model(tiny_hf[1])
    out = save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16, fused_experts=True)
    from qjax.checkpoint.safetensors_io import SafetensorsFile
    f = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert f.dtype("model.layers.0.mlp.experts.gate_up_proj") == "BF16"
    assert f.shape("model.layers.0.mlp.experts.gate_up_proj") == [8, 64, 64] or \
        tuple(f.shape("model.layers.0.mlp.experts.gate_up_proj")) == (8, 64, 64)
    f.close()
    back = qjax.load_model(out)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back.embed_tokens[...]),
                                  np.asarray(model.embed_tokens[...]).astype(jnp.bfloat16))


def test_existing_target_is_protected_and_failed_write_leaves_nothing(tiny_hf, tmp_path, monkeypatch):
    model = qjax.load_model(tiny_hf[1])
    target = tmp_path / "ckpt"
    save_pretrained(model, target)
    with pytest.raises(FileExistsError, match="already exists"):
        save_pretrained(model, target)

    from qjax.convert import hf_writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_writer, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "new")
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, target, overwrite=True)
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folders left behind
    qjax.load_model(target)  # the old checkpoint is intact


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_folders_and_files_follow_the_umask(tiny_hf, tmp_path, umask):
    """Both writers' folders and files get the permissions the umask gives (0755 / 0644 under 022), not a temporary
    folder's 0700: another user must be able to serve the checkpoint."""
    from qjax.autoround.rtn import quantize_model
    from qjax.convert import save_autoround
    from qjax.convert.planner import recipe_to_qconfig

    model = qjax.load_model(tiny_hf[1])
    quantized = quantize_model(model, recipe_to_qconfig("experts=int4:g32"))
    old = os.umask(umask)
    try:
        outs = [save_pretrained(model, tmp_path / "ct"), save_autoround(quantized, tmp_path / "ar")]
    finally:
        os.umask(old)
    for out in outs:
        for root, dirs, files in os.walk(out):
            assert os.stat(root).st_mode & 0o777 == 0o777 & ~umask, root
            for name in files:
                assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o666 & ~umask, name


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_write_back_is_byte_identical(ct_ckpt, tmp_path):
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    name, folder = ct_ckpt
    model = qjax.load_model(folder)
    out = save_pretrained(model, tmp_path / "again")

    def tensors(d):
        t = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                sf = SafetensorsFile(os.path.join(d, f))
                t.update({k: np.asarray(sf.get(k)).copy() for k in sf.keys()})
                sf.close()
        return t

    src, dst = tensors(folder), tensors(out)
    assert set(src) == set(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype and src[k].shape == dst[k].shape, k
        assert src[k].tobytes() == dst[k].tobytes(), k
    # the written config is a valid compressed-tensors config that qjax reads back to the same plan
    from compressed_tensors.quantization import QuantizationConfig as CTConfig
    CTConfig.model_validate(json.load(open(os.path.join(out, "config.json")))["quantization_config"])
    again = qjax.load_model(out)
    assert again.quant == model.quant
    ids = np.random.default_rng(3).integers(0, 512, (1, 12))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


# ---------------------------------------------------------------------------------------------------------------------
# exports through the real consumers (transformers 5 with compressed-tensors)
# ---------------------------------------------------------------------------------------------------------------------
# qjax RTN recipes on the tiny model (hidden 64, experts intermediate 32): every scheme family qjax writes
EXPORTS = {
    "w2_experts_w4_rest": "experts=int2:g32,rest=int4:g32",
    "w8a16_g32": "rest=int8:g32",
    "mixed_dense_schemes": "experts=int4:g32,attn=int8:channel,lm_head=int8:channel,rest=int4:g32",
}
# logits of transformers' decompressed model against the float32 oracle and qjax: the same fp32 math in another
# order (measured ≤ 8e-6 on these recipes; tests/test_model.py's 2e-4 bound for two fp32 implementations)
EXPORT_TOL = 2e-4


def _transformers(folder, caplog):
    """transformers' own ``from_pretrained`` of a compressed-tensors folder (float32), with compressed-tensors'
    warnings captured: an unmatched target means a consumer resolved the config differently from the writer."""
    import logging

    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.WARNING, logger="compressed_tensors"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    unmatched = [r.getMessage() for r in caplog.records if "Could not match" in r.getMessage()]
    assert not unmatched, unmatched[:3]
    return model


def _logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_export_loads_in_transformers(name, tiny_hf, tmp_path, caplog):
    """``from_pretrained`` of qjax's export resolves every module (no unmatched target) and computes the logits of
    compressed-tensors' decompressed float32 oracle and of qjax."""
    from oracles.ct import ct_reference_logits
    from qjax.convert.hf_writer import consumer_limits
    from qjax.convert.planner import recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    model = quantize_model(qjax.load_model(tiny_hf[1], dtype=jnp.float32), recipe_to_qconfig(EXPORTS[name]))
    assert consumer_limits(model) == []
    out = save_pretrained(model, tmp_path / name)
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert all(t.startswith("re:") or t == "lm_head" for g in qc["config_groups"].values() for t in g["targets"])
    ids = np.random.default_rng(5).integers(0, 512, (2, 33)).astype(np.int32)
    theirs = _logits(_transformers(out, caplog), ids)
    assert np.abs(theirs - ct_reference_logits(out, ids)).max() <= EXPORT_TOL
    assert np.abs(theirs - np.asarray(model(ids))).max() <= EXPORT_TOL


_ATTN = r"re:.*self_attn\.(q|k|v|o)_proj$"
# checkpoints compressed-tensors itself writes that transformers 5.24 cannot run right → the limit qjax names
LIMITED = {
    "asymmetric": ({"groups": [{"targets": ["Linear"], "format": "pack-quantized",
                                "weights": int_weights(4, group=32, symmetric=False)}],
                    "ignore": IGNORE, "kv_cache": None}, "asymmetric pack-quantized"),
    "mxfp8_experts": ({"groups": [{"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                   "format": "mxfp8-quantized", "weights": {"num_bits": 8, "type": "float",
                                   "symmetric": True, "strategy": "group", "group_size": 32}}],
                       "ignore": IGNORE, "kv_cache": None}, "MXFP8 experts"),
    "half_quantized_experts": ({"groups": [
        {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up)_proj$"], "format": "pack-quantized",
         "weights": int_weights(4, group=32)},
        {"targets": [_ATTN], "format": "pack-quantized", "weights": int_weights(8, group=32)}],
        "ignore": IGNORE, "kv_cache": None}, "one scheme"),
    "fp8_kv": ({"groups": [{"targets": [_ATTN], "format": "pack-quantized",
                            "weights": int_weights(4, group=32)}],
                "ignore": IGNORE, "kv_cache": {"strategy": "tensor"}}, "kv_cache_scheme"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LIMITED))
def test_transformers_limits_are_named_and_hit_the_real_tools_too(name, hf128, tmp_path, caplog):
    """Where transformers 5.24 cannot load (or computes other logits than vLLM's semantics) a scheme, qjax's export
    warns with the reason, and the same recipe written by compressed-tensors itself fails in transformers the same
    way: the limit is the consumer's. When transformers fixes one, this test fails and the limit goes."""
    import logging

    from oracles.ct import ct_reference_logits, write_ct_checkpoint
    from qjax.convert.hf_writer import consumer_limits

    recipe, phrase = LIMITED[name]
    calib = np.random.default_rng(0).integers(0, 512, (2, 24))
    theirs = write_ct_checkpoint(hf128, tmp_path / "ct", recipe, calib_ids=calib)
    model = qjax.load_model(theirs, dtype=jnp.float32)
    assert any(phrase in limit for limit in consumer_limits(model)), consumer_limits(model)
    with caplog.at_level(logging.WARNING, logger="qjax"):
        ours = save_pretrained(model, tmp_path / "qjax")
    assert any(phrase in r.getMessage() for r in caplog.records)
    ids = np.random.default_rng(6).integers(0, 512, (1, 24)).astype(np.int32)
    fp8_kv = recipe["kv_cache"] is not None
    # qjax itself runs it right: 1e-4 as tests/test_loading.py; with FP8 KV an fp32-order difference can flip one K/V
    # element by an FP8 ulp, which moves logits by up to ~1e-3 (test_loading.py's cached-decode bound: 2e-3)
    np.testing.assert_allclose(np.asarray(model(ids)), ct_reference_logits(theirs, ids, fp8_kv=fp8_kv),
                               atol=2e-3 if fp8_kv else 1e-4, rtol=0)
    for folder in (theirs, ours):
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        except Exception:  # noqa: BLE001 — any failure to load is the limit
            continue
        got = _logits(hf, ids)
        assert np.abs(got - ct_reference_logits(folder, ids, fp8_kv=fp8_kv)).max() > 1e-2, folder


def test_targets_resolve_every_module_to_its_scheme(tiny_hf):
    """compressed-tensors' own matching of the written config gives every module (per-expert names, as vLLM and a
    per-expert model name them) the scheme qjax quantized it with, and leaves dense ones dense — with a kind whose
    layers differ (per-layer patterns) and a dense kind."""
    from compressed_tensors.utils.match import match_name
    from qjax.convert.hf_writer import consumer_limits, quantization_config

    from qjax.autoround.rtn import quantize_model
    from qjax.model.linears import layer_linears
    from qjax.quant import schemes

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "ignore": ["lm_head", r"re:.*shared_expert_gate$", r"re:.*in_proj_[ab]$"],
          "config_groups": {"layer0_out": {"targets": ["model.layers.0.linear_attn.out_proj"],
                                           "weights": int_weights(8, group=32)},
                            "experts": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                        "weights": int_weights(2, group=32)},
                            "rest": {"targets": ["Linear"], "weights": int_weights(4, group=32)}}}
    model = quantize_model(qjax.load_model(tiny_hf[1], dtype=jnp.float32), qc)
    written = quantization_config(model)
    groups = [(g["targets"], (g["weights"]["num_bits"], g["weights"]["group_size"]))
              for g in written["config_groups"].values()]
    assert any(r"layers\.0\." in t for targets, _ in groups for t in targets)  # out_proj differs by layer
    assert any("in_proj_a" in t for t in written["ignore"])  # a dense kind

    def resolved(module):
        if any(match_name(module, t) for t in written["ignore"]):
            return None
        return next((scheme for targets, scheme in groups if any(match_name(module, t) for t in targets)), None)

    cfg = model.config
    checked = 0
    for i, kind in enumerate(cfg.layer_types):
        metas = model.quant.layer(i)
        names = {f"model.layers.{i}.{rel}": metas.get(rel) for rel in layer_linears(cfg, kind)}
        for e in range(cfg.num_experts):
            for proj, stacked in (("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"),
                                  ("down_proj", "down_proj")):
                names[f"model.layers.{i}.mlp.experts.{e}.{proj}"] = metas.get(f"mlp.experts.{stacked}")
        for module, meta in names.items():
            want = None if meta is None else (meta.bits, meta.group_size)
            assert resolved(module) == want, module
            checked += 1
    assert resolved("lm_head") is None
    # the parts kept unquantized are listed when the folder holds them (tests/test_rtn.py): this model has neither
    assert not any("mtp" in t or "visual" in t for t in written["ignore"])
    assert checked > 100
    assert {schemes.from_meta(m).num_bits for layer in model.quant.layers for _, m in layer} == {2, 4, 8}
    assert consumer_limits(model) == []
