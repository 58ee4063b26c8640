"""Loader and config: layouts, dtypes, compressed-tensors checkpoints, and clear errors for bad input (each names the
file and the tensor/field).

compressed-tensors checkpoints are written at test time by compressed-tensors + transformers (tests/oracles/ct.py):
qjax keeps them packed and dequantizes them bit for bit like compressed-tensors. Oracles: compressed-tensors' own
decompression (weights, 0 differing bits) and a float32 transformers model built from those decompressed weights
(logits, 1e-4: same fp32 math in another order, as for the dense model); with FP8 KV, that model's attention
fake-quantizes K (after k_norm + RoPE) and V with the stored scales.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from oracles.ct import RECIPES, ct_dequantized, ct_reference_logits, write_ct_checkpoint
from oracles.hf import tiny_text_config
from safetensors.numpy import load_file, save_file

import qjax
from qjax.checkpoint.loading import module_weight
from qjax.model.config import TextConfig

TOL = 1e-4  # logits of a compressed-tensors checkpoint against its decompressed float32 transformers model


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(folder: str, edit) -> None:
    """Load the single-file checkpoint, let ``edit(tensors)`` change it, save it back."""
    path = os.path.join(folder, "model.safetensors")
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path)


def test_official_layout_loads_vision_and_mtp_text_only_skips_vision_once(official_dir, caplog):
    model = qjax.load_model(official_dir)
    assert model.mtp is not None and model.visual is not None
    with caplog.at_level(logging.WARNING, logger="qjax"):
        text = qjax.load_model(official_dir, text_only=True)
    said = [r.getMessage() for r in caplog.records if "model.visual" in r.getMessage()]
    assert len(said) == 1 and "skipping" in said[0] and "text-only" in said[0]
    assert text.visual is None and text.vision_config == model.vision_config


def test_dtype_defaults_to_checkpoint_and_can_be_overridden(tiny_hf):
    model = qjax.load_model(tiny_hf[1])
    assert model.embed_tokens[...].dtype == jnp.float32
    bf = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    assert bf.embed_tokens[...].dtype == jnp.bfloat16
    layer0 = bf.groups.layers[0].linear_attn
    assert layer0.A_log[...].dtype == jnp.float32 and layer0.dt_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(bf.embed_tokens[...]),
                                  np.asarray(model.embed_tokens[...]).astype(jnp.bfloat16))


def test_truncated_file_names_file_and_tensor(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(qjax.SafetensorsError) as err:
        qjax.load_model(folder)
    msg = str(err.value)
    assert "model.safetensors" in msg and "truncated" in msg and "tensor" in msg


def test_wrong_shape_missing_and_unexpected_are_listed_together(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")

    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = np.zeros((7, 64), np.float32)
        del t["model.layers.2.linear_attn.A_log"]
        del t["model.layers.0.mlp.experts.5.up_proj.weight"]
        t["model.layers.0.mlp.bogus.weight"] = np.zeros((2,), np.float32)

    _rewrite(folder, edit)
    with pytest.raises(qjax.LoadError) as err:
        qjax.load_model(folder)
    msg = str(err.value)
    assert folder in msg
    assert "model.layers.3.self_attn.k_proj.weight [model.safetensors] is [7, 64], expected [64, 64]" in msg
    assert "missing (2)" in msg and "model.layers.2.linear_attn.A_log" in msg
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in msg
    assert "unexpected (1): model.layers.0.mlp.bogus.weight [model.safetensors]" in msg


def test_integer_tensor_without_quantization_config_is_refused(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")
    _rewrite(folder, lambda t: t.__setitem__("model.norm.weight", np.zeros((64,), np.int32)))
    with pytest.raises(qjax.LoadError, match=r"model.norm.weight \[model.safetensors\] is I32"):
        qjax.load_model(folder)


def test_sharded_index_naming_missing_shard(official_dir, tmp_path):
    folder = _copy(official_dir, tmp_path / "ckpt")
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
    with pytest.raises(qjax.SafetensorsError, match="model-00002-of-00002.safetensors"):
        qjax.load_model(folder)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_text_config(), "model_type": "llama"}))
    with pytest.raises(qjax.ConfigError) as err:
        qjax.load_model(tmp_path)
    assert "config.json" in str(err.value) and "'llama'" in str(err.value)


def test_missing_config_field_and_missing_config(tmp_path):
    cfg = tiny_text_config()
    del cfg["linear_num_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(qjax.ConfigError, match="linear_num_value_heads"):
        qjax.load_model(tmp_path)
    with pytest.raises(qjax.ConfigError, match="no config.json"):
        qjax.load_model(tmp_path / "nowhere")


def test_config_composite_interval_and_validation():
    text = tiny_text_config()
    del text["layer_types"]
    text["full_attention_interval"] = 2
    cfg = TextConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "eos_token_id": 7})
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.layer_period == ("linear_attention", "full_attention") and cfg.num_groups == 2
    assert cfg.eos_token_id == (7,)
    with pytest.raises(qjax.ConfigError, match="text_config"):
        TextConfig.from_dict({"model_type": "qwen3_5_moe"})
    with pytest.raises(qjax.ConfigError, match="mrope_section"):
        TextConfig.from_dict({**tiny_text_config(), "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor":
                                                                        0.25, "mrope_section": [3, 3, 3]}})
    with pytest.raises(qjax.ConfigError, match="num_key_value_heads"):
        TextConfig.from_dict(tiny_text_config(num_key_value_heads=3))
    # the dict qjax writes parses back to the same config
    again = TextConfig.from_dict(cfg.to_hf_dict())
    assert again == cfg


# ---------------------------------------------------------------------------------------------------------------------
# compressed-tensors checkpoints
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_weights_bit_exact_vs_compressed_tensors(ct_ckpt):
    name, folder = ct_ckpt
    model = qjax.load_model(folder)
    assert model.quant is not None
    want = ct_dequantized(folder)
    assert want, "the recipe quantized nothing"
    bad = {}
    for key, ref in want.items():
        got = module_weight(model, key[: -len(".weight")])
        n = int(np.sum(got.astype(np.float32).view(np.uint32) != ref.astype(np.float32).view(np.uint32)))
        if n:
            bad[key] = n
    assert not bad, f"{name}: differing elements per module: {bad}"


def test_weights_stay_packed_in_memory(ct_ckpt):
    """Quantized modules hold the stored words (int32 packs / float8 values) and no dense copy of the weight."""
    from qjax.model.variables import variable_shapes

    _, folder = ct_ckpt
    model = qjax.load_model(folder)
    leaves = variable_shapes(model)
    packed = {p: v for p, v in leaves.items() if p[-1] == "weight_packed"}
    assert packed and all(v.dtype in (jnp.int32, jnp.float8_e4m3fn) for v in packed.values())
    modules = {p[:-1] for p in packed}
    assert not any(p[:-1] in modules and p[-1] == "weight" for p in leaves)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_logits_match_decompressed_transformers(ct_ckpt, x64):
    """float32 logits to TOL; with an FP8 KV cache in float64 on both sides, to 1e-10 of the logits' scale (measured
    7e-15 absolute): FP8 rounding is a step function, and a float32 K 1e-7 away from transformers' on a rounding
    boundary flips that element by an FP8 ulp and moves every later position's logits by up to 2.4e-4 (seen with
    two FP8 layers: identical up to the flip, then 2e-5 to 2.4e-4), which says nothing about the checkpoint's
    reading."""
    name, folder = ct_ckpt
    fp8_kv = RECIPES[name]["kv_cache"] is not None
    model = qjax.load_model(folder, dtype="float64" if fp8_kv else jnp.float32)
    ids = np.random.default_rng(1).integers(0, 512, (2, 70)).astype(np.int32)
    want = ct_reference_logits(folder, ids, fp8_kv=fp8_kv, float64=fp8_kv)
    got = np.asarray(model(ids))
    assert got.dtype == want.dtype
    assert np.abs(got - want).max() <= (1e-10 * np.abs(want).max() if fp8_kv else TOL)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_cached_decode_equals_forward_with_fp8_kv(ct_ckpt):
    name, folder = ct_ckpt
    if RECIPES[name]["kv_cache"] is None:
        pytest.skip("no FP8 KV in this recipe")
    model = qjax.load_model(folder, dtype=jnp.float32)
    assert model.kv_fp8
    ids = np.random.default_rng(2).integers(0, 512, (1, 40)).astype(np.int32)
    full = np.asarray(model(ids))
    cache = model.init_cache(1, 40)
    assert cache.slots[-1].k.dtype == jnp.float8_e4m3fn  # K/V really are stored as FP8
    a, cache = qjax.extend(model, cache, ids[:, :30])
    steps = [np.asarray(a)]
    for t in range(30, 40):
        b, cache = qjax.extend(model, cache, ids[:, t:t + 1])
        steps.append(np.asarray(b))
    # FP8 rounding is a step function: the ~1e-6 fp32 differences between the cached and the full path occasionally
    # flip one K/V element by an FP8 ulp (6 % of that element), measured up to 4e-4 on logits; a wrong scale, a
    # missing dequantization or unquantized cache entries move logits by 1e-2 to 1.
    assert np.abs(np.concatenate(steps, 1) - full).max() <= 2e-3


def test_host_assembled_variables_equal_device_writes(hf128, tmp_path, monkeypatch):
    """The loader assembles variables on the host within ``HOST_STAGING_BYTES`` and writes the rest tensor by tensor
    into device buffers: all on the host, none, or a budget that splits them give the same variables bit for bit
    (a quantized checkpoint with per-expert tensors: each stacked variable is filled from many)."""
    from flax import nnx

    from qjax.checkpoint import loading

    folder = write_ct_checkpoint(hf128, tmp_path / "ckpt", RECIPES["w2_experts_w4_rest"])

    def leaves():
        return {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(qjax.load_model(folder)))}

    want = leaves()
    sizes = sorted(v.nbytes for v in want.values())
    for budget in (0, sum(sizes) // 2):
        monkeypatch.setattr(loading, "HOST_STAGING_BYTES", budget)
        got = leaves()
        assert got.keys() == want.keys()
        for p, v in want.items():
            assert got[p].dtype == v.dtype and np.array_equal(got[p].view(np.uint8), v.view(np.uint8)), (budget, p)


@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_official_layout_quantized(hf128, tmp_path):
    folder = write_ct_checkpoint(hf128, tmp_path / "official", RECIPES["w2_experts_w4_rest"], official_layout=True)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["model_type"] == "qwen3_5_moe"
    model = qjax.load_model(folder, dtype=jnp.float32)
    ids = np.random.default_rng(4).integers(0, 512, (2, 33)).astype(np.int32)
    assert np.abs(np.asarray(model(ids)) - ct_reference_logits(folder, ids)).max() <= TOL


# ---------------------------------------------------------------------------------------------------------------------
# compressed-tensors checkpoints: bad input
# ---------------------------------------------------------------------------------------------------------------------
def _clone(folder, dst):
    import shutil
    shutil.copytree(folder, dst)
    return str(dst)


def _edit_config(folder, fn):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    fn(cfg["quantization_config"])
    json.dump(cfg, open(path, "w"))


@pytest.fixture(scope="module")
def w4(hf128, tmp_path_factory):
    return write_ct_checkpoint(hf128, tmp_path_factory.mktemp("w4") / "ckpt", RECIPES["int4_sym_g128"])


def test_unsupported_3bit_is_refused(w4, tmp_path):
    folder = _clone(w4, tmp_path / "c")
    _edit_config(folder, lambda q: next(iter(q["config_groups"].values()))["weights"].update(num_bits=3))
    with pytest.raises(qjax.quant.QuantConfigError) as err:
        qjax.load_model(folder)
    assert "config.json" in str(err.value) and "num_bits" in str(err.value)


def test_activation_quantization_is_refused(w4, tmp_path):
    folder = _clone(w4, tmp_path / "c")
    _edit_config(folder, lambda q: next(iter(q["config_groups"].values())).update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}))
    with pytest.raises(qjax.quant.QuantConfigError, match="input_activations"):
        qjax.load_model(folder)


def test_group_size_mismatch_names_the_tensor(w4, tmp_path):
    folder = _clone(w4, tmp_path / "c")
    _edit_config(folder, lambda q: next(iter(q["config_groups"].values()))["weights"].update(group_size=32))
    with pytest.raises(qjax.LoadError) as err:
        qjax.load_model(folder)
    assert "weight_scale" in str(err.value) and "wrong shape" in str(err.value)


def test_packed_tensors_without_quantization_config(w4, tmp_path):
    folder = _clone(w4, tmp_path / "c")
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    del cfg["quantization_config"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ValueError, match="no quantization_config"):
        qjax.load_model(folder)


# ---------------------------------------------------------------------------------------------------------------------
# the MTP head next to a quantized body (issue 22): BF16 as the seeds keep it, or quantized by a recipe
# ---------------------------------------------------------------------------------------------------------------------
def _mtp_linears(tensors) -> list[str]:
    """The MTP head's linear modules among ``tensors`` (2-D ``.weight``; not the router, which is not a Linear)."""
    from qjax.checkpoint.layout import is_linear

    return sorted(k[: -len(".weight")] for k, v in tensors.items()
                  if k.startswith("mtp.") and k.endswith(".weight") and v.ndim == 2 and is_linear(k[: -len(".weight")]))


# recipe → how its config.json lists the BF16 head: the seeds' card words for it ("kept in BF16"), as a pattern
# (qjax's own, re:.*mtp.* as a user writes it), as explicit module names (llmcompressor's style for what it leaves
# dense), or not at all (docs/formats.md §7: keys outside the producer's module tree, covered by neither list)
MTP_HEAD_CASES = {"int4_sym_g128": "qjax", "w2_experts_w4_rest": "explicit", "int8_g32_f16_scales": "unlisted",
                  "mxfp8_experts_kv_tensor": "user"}


@pytest.fixture(scope="module")
def hf128_bf16(hf128):
    import copy

    import torch

    return copy.deepcopy(hf128).to(torch.bfloat16)


@pytest.mark.slow  # a speculative and a plain generate compile per recipe (~1 min each on 2 cores)
@pytest.mark.parametrize("recipe", sorted(MTP_HEAD_CASES))
def test_quantized_body_with_bf16_mtp_head_loads_and_speculates(recipe, hf128_bf16, tmp_path):
    """INT4, INT2/INT4, INT8 and MXFP8 (+ FP8 KV) bodies with the BF16 MTP head of the seeds: the head loads dense
    with the stored values, and MTP speculation gives plain greedy's tokens."""
    from qjax.quant.unquantized import KEPT_UNQUANTIZED

    from oracles.autoround import read_tensors

    folder = write_ct_checkpoint(hf128_bf16, tmp_path / recipe, RECIPES[recipe], official_layout=True)
    disk = read_tensors(folder)  # (safetensors.numpy has no float8)
    head = _mtp_linears(disk)
    assert head and all(str(disk[f"{m}.weight"].dtype) == "bfloat16" for m in head)
    style = MTP_HEAD_CASES[recipe]
    listed = {"qjax": [p.ignore_entry for p in KEPT_UNQUANTIZED], "user": [r"re:.*mtp.*"], "explicit": head,
              "unlisted": []}[style]
    _edit_config(folder, lambda q: q.update(ignore=q["ignore"] + listed))
    model = qjax.load_model(folder, dtype=jnp.float32)
    assert model.quant is not None and model.mtp is not None
    for m in head:  # dense, the stored BF16 values exactly
        np.testing.assert_array_equal(module_weight(model, m, text_prefix="model.language_model."),
                                      disk[f"{m}.weight"].astype(np.float32))
    ids = np.random.default_rng(7).integers(0, 512, (2, 12)).astype(np.int32)
    plain = qjax.generate(model, ids, max_new_tokens=16, do_sample=False, eos_token_id=[])
    spec, stats = qjax.generate(model, ids, max_new_tokens=16, do_sample=False, eos_token_id=[], speculative="mtp",
                                num_speculative_tokens=2, return_stats=True)
    np.testing.assert_array_equal(np.asarray(spec), np.asarray(plain))
    assert stats.rounds >= 1


@pytest.fixture(scope="module")
def quantized_head(hf128_bf16, tmp_path_factory):
    """(folder, dense folder): an INT4 asymmetric g32 compressed-tensors checkpoint (official layout) whose recipe's
    ``Linear`` target also took the MTP head — its linears stored packed, encoded with compressed-tensors' RTN rule —
    and the same folder with those modules dense as compressed-tensors' own decompressor decodes them."""
    from qjax.autoround.rtn import quantized_entries
    from qjax.quant.config import QuantizationConfig

    tmp = tmp_path_factory.mktemp("quantized-head")
    folder = write_ct_checkpoint(hf128_bf16, tmp / "q", RECIPES["int4_asym_g32"], official_layout=True)
    qc = QuantizationConfig.from_config_json(folder)

    def quantize_head(t):
        for m in _mtp_linears(t):
            w = t.pop(f"{m}.weight")
            packed = quantized_entries(m, qc.scheme_for(m), w.shape, lambda w=w: w, w.dtype, "BF16")
            t.update({k: get() for k, (_, _, get) in packed.items()})
    _rewrite(folder, quantize_head)
    decoded = ct_dequantized(folder)
    dense = _copy(folder, tmp / "dense")

    def decode(t):
        for m in {k.rsplit(".", 1)[0] for k in t if k.startswith("mtp.") and k.endswith(".weight_packed")}:
            for f in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
                t.pop(f"{m}.{f}", None)
            t[f"{m}.weight"] = decoded[f"{m}.weight"]
    _rewrite(dense, decode)
    return folder, dense


@pytest.mark.slow  # two loads and two MTP-head forwards (~10 s on 2 cores)
def test_quantized_mtp_head_loads_dense(quantized_head, caplog, tmp_path):
    """A recipe that quantized the MTP head: it loads (once said), the head dense with compressed-tensors' decoded
    weights, computing exactly what the head stored dense computes; written again, the head is the dense one qjax
    holds (a copy of the packed source head, which the written config would call unquantized, is refused)."""
    from qjax.convert import save_pretrained

    folder, dense = quantized_head
    assert any(k.startswith("mtp.") and k.endswith(".weight_packed")
               for k in load_file(os.path.join(folder, "model.safetensors")))
    with caplog.at_level(logging.WARNING, logger="qjax"):
        model = qjax.load_model(folder, dtype=jnp.float32)
    assert sum("MTP head is stored quantized" in r.getMessage() for r in caplog.records) == 1
    ref = qjax.load_model(dense, dtype=jnp.float32)
    ids = np.random.default_rng(8).integers(0, 512, (2, 12)).astype(np.int32)
    hidden = ref.forward(jnp.asarray(ids)).hidden
    np.testing.assert_array_equal(np.asarray(model.mtp_logits(ids, hidden)), np.asarray(ref.mtp_logits(ids, hidden)))
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))  # the body as before
    with pytest.raises(ValueError, match=r"stores the MTP head quantized \(mtp\."):
        save_pretrained(model, tmp_path / "copy", source=folder)
    written = load_file(os.path.join(save_pretrained(model, tmp_path / "own"), "model.safetensors"))
    dense_disk = load_file(os.path.join(dense, "model.safetensors"))
    head = _mtp_linears(dense_disk)
    assert head and all(np.array_equal(written[f"{m}.weight"], dense_disk[f"{m}.weight"]) for m in head)


def _damage(folder, key, fn):
    _rewrite(folder, lambda t: t.update({key: fn(t[key])}))


# edit of the quantized head → what the one error line names
BAD_HEAD = {
    "zero_scale": (lambda f: _damage(f, "mtp.fc.weight_scale", lambda a: np.zeros_like(a)),
                   r"mtp\.fc\.weight_scale \[model\.safetensors\]: \d+ scales are zero"),
    "wrong_shape": (lambda f: _damage(f, "mtp.layers.0.self_attn.q_proj.weight_packed", lambda a: a[:, :-1]),
                    r"wrong shape: mtp\.layers\.0\.self_attn\.q_proj\.weight_packed \[model\.safetensors\]"),
    "weight_shape": (lambda f: _damage(f, "mtp.layers.0.mlp.experts.1.down_proj.weight_shape",
                                       lambda a: a[::-1].copy()),
                     r"mtp\.layers\.0\.mlp\.experts\.1\.down_proj\.weight_shape \[model\.safetensors\] says"),
    "missing_zero_point": (lambda f: _rewrite(f, lambda t: t.pop("mtp.fc.weight_zero_point")),
                           r"missing: mtp\.fc\.weight_zero_point"),
    "ignored_yet_packed": (lambda f: _edit_config(f, lambda q: q.update(ignore=q["ignore"] + [r"re:.*mtp\..*"])),
                           r"mtp\.\S+: stored quantized \(int\) but no config_group"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEAD))
def test_bad_quantized_mtp_tensor_is_named(case, quantized_head, tmp_path):
    edit, message = BAD_HEAD[case]
    folder = _clone(quantized_head[0], tmp_path / "c")
    edit(folder)
    with pytest.raises(ValueError, match=message):
        qjax.load_model(folder, dtype=jnp.float32)


def _nan_at_0(a):
    a = a.copy()
    a.reshape(-1)[0] = np.nan
    return a


# the same for the head stored dense, as the seeds store it
BAD_DENSE_HEAD = {
    "nan": (lambda f: _damage(f, "mtp.norm.weight", _nan_at_0),
            r"mtp\.norm\.weight \[model\.safetensors\]: 1 NaN or infinite values"),
    "wrong_shape": (lambda f: _damage(f, "mtp.fc.weight", lambda a: a[:, :-1].copy()),
                    r"wrong shape: mtp\.fc\.weight \[model\.safetensors\] is \[128, 255\], expected \[128, 256\]"),
    "missing": (lambda f: _rewrite(f, lambda t: t.pop("mtp.layers.0.mlp.experts.2.up_proj.weight")),
                r"missing \(1\): mtp\.layers\.0\.mlp\.experts\.2\.up_proj\.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_DENSE_HEAD))
def test_bad_dense_mtp_tensor_is_named(case, quantized_head, tmp_path):
    edit, message = BAD_DENSE_HEAD[case]
    folder = _clone(quantized_head[1], tmp_path / "c")
    edit(folder)
    with pytest.raises(ValueError, match=message):
        qjax.load_model(folder, dtype=jnp.float32)
