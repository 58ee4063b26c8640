"""compressed-tensors checkpoints written at test time by compressed-tensors + transformers (tests/ct_util.py):
qjax keeps them packed, dequantizes them bit for bit like compressed-tensors, runs them, writes them back.

Oracles: compressed-tensors' own decompression (weights, 0 differing bits) and a float32 transformers model built
from those decompressed weights (logits, 1e-4: same fp32 math in another order, as for the dense model); with FP8
KV, that model's attention fake-quantizes K (after k_norm + RoPE) and V with the stored scales.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from ct_util import ct_dequantized, ct_reference_logits, write_ct_checkpoint
from hf_util import make_hf_model, tiny_text_config
from qjax.convert import save_pretrained

import qjax
from qjax.checkpoint.loading import module_weight

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]


def _w(bits, strategy="group", group=None, symmetric=True):
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group}


def _int_recipe(weights, *, kv=None, scale_dtype="bfloat16"):
    return {"groups": [{"targets": ["Linear"], "format": "pack-quantized", "weights": weights}], "ignore": IGNORE,
            "kv_cache": kv, "scale_dtype": scale_dtype}


MXFP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}
RECIPES = {
    "int4_sym_g128": _int_recipe(_w(4, group=128)),
    "int4_asym_g32": _int_recipe(_w(4, group=32, symmetric=False)),
    "int8_g32_f16_scales": _int_recipe(_w(8, group=32), scale_dtype="float16"),
    "int8_channel": _int_recipe(_w(8, strategy="channel")),
    "int2_asym_channel": _int_recipe(_w(2, strategy="channel", symmetric=False)),
    "w2_experts_w4_rest": {"groups": [
        {"targets": [EXPERTS], "format": "pack-quantized", "weights": _w(2, group=64)},
        {"targets": ["Linear"], "format": "pack-quantized", "weights": _w(4, group=128)}],
        "ignore": IGNORE, "kv_cache": None},
    "mxfp8_experts_kv_tensor": {"groups": [{"targets": [EXPERTS], "format": "mxfp8-quantized", "weights": MXFP8}],
                                "ignore": IGNORE, "kv_cache": {"strategy": "tensor"}},
    "int4_asym_kv_head": _int_recipe(_w(4, group=32, symmetric=False), kv={"strategy": "attn_head"}),
}
TOL = 1e-4


@pytest.fixture(scope="module")
def hf128():
    """A tiny model with hidden 128 so group 128 is exact and group 64 makes two groups."""
    # initializer_range 0.05: at 0.1 this wider net is chaotic enough that fp32 summation order alone moves logits
    # by ~1.5e-4 (weights bit-identical); at 0.05 the norm noise still makes (1+w) mistakes obvious
    return make_hf_model(tiny_text_config(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                          num_experts=4, initializer_range=0.05), seed=3)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def ckpt(request, hf128, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    calib = np.random.default_rng(0).integers(0, 512, (2, 24))
    return request.param, write_ct_checkpoint(hf128, folder / "ckpt", RECIPES[request.param], calib_ids=calib)


def test_weights_bit_exact_vs_compressed_tensors(ckpt):
    name, folder = ckpt
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


def test_weights_stay_packed_in_memory(ckpt):
    """Quantized modules hold the stored words (int32 packs / float8 values) and no dense copy of the weight."""
    from qjax.model.variables import variable_shapes

    _, folder = ckpt
    model = qjax.load_model(folder)
    leaves = variable_shapes(model)
    packed = {p: v for p, v in leaves.items() if p[-1] == "weight_packed"}
    assert packed and all(v.dtype in (jnp.int32, jnp.float8_e4m3fn) for v in packed.values())
    modules = {p[:-1] for p in packed}
    assert not any(p[:-1] in modules and p[-1] == "weight" for p in leaves)


def test_logits_match_decompressed_transformers(ckpt):
    name, folder = ckpt
    model = qjax.load_model(folder, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, 512, (2, 70)).astype(np.int32)
    want = ct_reference_logits(folder, ids, fp8_kv=RECIPES[name]["kv_cache"] is not None)
    got = np.asarray(model(ids))
    assert np.abs(got - want).max() <= TOL


def test_cached_decode_equals_forward_with_fp8_kv(ckpt):
    name, folder = ckpt
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


def test_write_back_is_byte_identical(ckpt, tmp_path):
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    name, folder = ckpt
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


def test_official_layout_quantized(hf128, tmp_path):
    folder = write_ct_checkpoint(hf128, tmp_path / "official", RECIPES["w2_experts_w4_rest"], official_layout=True)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["model_type"] == "qwen3_5_moe"
    model = qjax.load_model(folder, dtype=jnp.float32)
    ids = np.random.default_rng(4).integers(0, 512, (2, 33)).astype(np.int32)
    assert np.abs(np.asarray(model(ids)) - ct_reference_logits(folder, ids)).max() <= TOL


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


def test_planner_predicts_what_loading_allocates(ckpt):
    from qjax.convert.planner import plan_folder

    _, folder = ckpt
    model = qjax.load_model(folder)
    import jax
    from flax import nnx
    held = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert plan_folder(folder).device_bytes == held


def test_planner_recipe_matches_a_real_rtn_checkpoint(tiny_hf, tmp_path):
    """`inspect --config --recipe` (shapes only) predicts the tensors an RTN checkpoint of that recipe really has."""
    from qjax.convert.planner import plan_folder, plan_recipe, recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    recipe = "experts=int2:g32,rest=int4:g32,lm_head=int8:channel"  # tiny dims: groups must divide 32-wide inputs
    model = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    real = save_pretrained(quantize_model(model, recipe_to_qconfig(recipe)), tmp_path / "w2w4")
    predicted = plan_recipe(os.path.join(tiny_hf[1], "config.json"), recipe)
    measured = plan_folder(real)
    assert predicted.headers == measured.headers
    assert predicted.device_bytes == measured.device_bytes


def test_rtn_names_the_module_when_groups_do_not_divide(tiny_hf):
    from qjax.convert.planner import recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    model = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    with pytest.raises(ValueError,
                       match=r"model\.layers\.\d+\..*\[.*\]: 64 columns are not divisible by group_size 128"):
        quantize_model(model, recipe_to_qconfig("w4a16"))


def test_inspect_cli(tmp_path):
    import subprocess
    import sys

    cfg = tiny_text_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "qjax.cli", "inspect", "--config", str(tmp_path / "config.json"),
                        "--recipe", "experts=int2:g64,rest=int4:g128,kv=fp8"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "int2 g64" in r.stdout and "int4 g128" in r.stdout and "KV cache" in r.stdout


# ---------------------------------------------------------------------------------------------------------------------
# bad input
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
