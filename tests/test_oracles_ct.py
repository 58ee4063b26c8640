"""Checks of the compressed-tensors checkpoint generator and float32 oracle (tests/oracles/ct.py) against docs/formats.md.

Each recipe is written once per session; the tests then check the on-disk layout per key family (§1, §3, §6, §7),
decode a few modules independently with numpy from the bit layout of §4 / §5, and sanity-check the dequantized
weights and the reference logits.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compressed_tensors import QuantizationConfig
from oracles.ct import (
    ct_dequantized,
    ct_reference_logits,
    ct_reference_model,
    fp8_kv_fake_quant,
    kv_scales,
    per_expert_weights,
    write_ct_checkpoint,
)
from oracles.hf import hf_logits, make_hf_model, odd_text_config, tiny_text_config
from safetensors import safe_open

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]
# Every nn.Linear of the text model, by on-disk name (the router `mlp.gate` is not a Linear).
LINEAR = re.compile(
    r"(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)"
    r"|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert_gate|lm_head)$"
)
IS_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
IGNORED = re.compile(r"(^lm_head|\.mlp\.gate|\.shared_expert_gate)$")


def _int(bits: int, strategy: str = "group", group: int | None = None, sym: bool = True) -> dict[str, Any]:
    args: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    if group is not None:
        args["group_size"] = group
    return args


MXFP8 = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "torch.uint8",
}

# name -> (text config, model dtype, recipe, official_layout, expected(module) -> weight args | None)
CASES: dict[str, tuple[dict[str, Any], torch.dtype, dict[str, Any], bool, Any]] = {
    "int4_sym_g128_kv_tensor": (
        tiny_text_config(),
        torch.bfloat16,
        {
            "groups": [{"targets": ["Linear"], "weights": _int(4, group=128)}],
            "ignore": IGNORE,
            "kv_cache": {"strategy": "tensor"},
        },
        False,
        lambda m: None if IGNORED.search(m) else _int(4, group=128),
    ),
    "int4_asym_g128": (
        tiny_text_config(),
        torch.bfloat16,
        {"groups": [{"targets": ["Linear"], "weights": _int(4, group=128, sym=False)}], "ignore": IGNORE},
        False,
        lambda m: None if IGNORED.search(m) else _int(4, group=128, sym=False),
    ),
    "int8_sym_g32": (
        tiny_text_config(),
        torch.bfloat16,
        {
            "groups": [{"targets": ["Linear"], "weights": _int(8, group=32)}],
            "ignore": IGNORE,
            "config_style": "ct-0.19",
        },
        False,
        lambda m: None if IGNORED.search(m) else _int(8, group=32),
    ),
    # hidden 128: int4 g128 exact on H columns, int2 g64 = 2 groups; official layout (visual tower, MTP, 2 shards)
    "w2_experts_w4_rest": (
        tiny_text_config(hidden_size=128),
        torch.bfloat16,
        {
            "groups": [
                {"targets": [EXPERTS], "weights": _int(2, group=64)},
                {"targets": ["Linear"], "weights": _int(4, group=128)},
            ],
            "ignore": IGNORE,
            "shards": 2,
        },
        True,
        lambda m: None if IGNORED.search(m) else (_int(2, group=64) if IS_EXPERT.search(m) else _int(4, group=128)),
    ),
    # float32 model (F32 dense tensors) with auto-round's F16 scales
    "int8_channel_f16": (
        tiny_text_config(),
        torch.float32,
        {
            "groups": [{"targets": ["Linear"], "weights": _int(8, "channel")}],
            "ignore": IGNORE,
            "scale_dtype": "float16",
        },
        False,
        lambda m: None if IGNORED.search(m) else _int(8, "channel"),
    ),
    "mxfp8_experts": (
        tiny_text_config(),
        torch.bfloat16,
        # preset MXFP8: + dynamic MX input activations (runtime only, no tensors)
        {
            "groups": [{"targets": [EXPERTS], "weights": MXFP8, "input_activations": {**MXFP8, "dynamic": True}}],
            "ignore": IGNORE,
        },
        True,
        lambda m: MXFP8 if IS_EXPERT.search(m) else None,
    ),
    "int4_kv_head_f16": (
        tiny_text_config(),
        torch.bfloat16,
        {
            "groups": [{"targets": ["Linear"], "weights": _int(4, group=32)}],
            "ignore": IGNORE,
            "kv_cache": {"strategy": "attn_head"},
            "scale_dtype": "float16",
        },
        True,
        lambda m: None if IGNORED.search(m) else _int(4, group=32),
    ),
    # odd sizes (hidden 72, intermediate 40, 6 experts): partial last groups, packed rows padded inside a word
    # (int2 x 72 columns = 4.5 words), int4 zero points of 40-row modules
    "odd_w2_w4asym_g32": (
        odd_text_config(num_hidden_layers=4),
        torch.bfloat16,
        {
            "groups": [
                {"targets": [EXPERTS], "weights": _int(2, group=32)},
                {"targets": ["Linear"], "weights": _int(4, group=32, sym=False)},
            ],
            "ignore": IGNORE,
        },
        False,
        lambda m: None
        if IGNORED.search(m)
        else (_int(2, group=32) if IS_EXPERT.search(m) else _int(4, group=32, sym=False)),
    ),
}
CALIB_IDS = np.random.default_rng(11).integers(0, 389, (2, 20))  # in range of every config's vocab
# Rough relative-error bounds of ||W_deq - W|| / ||W|| on random weights (docs/formats.md §4: int8 0.6 %, MXFP8 2.6 %,
# int4 10-11 %, int2 39-51 %); the per-module bound is looser since tiny modules scatter more.
REL_ERR = {2: 0.55, 4: 0.15, 8: 0.012, "mxfp8": 0.04}


class Written:
    def __init__(self, name: str, folder: str, model: torch.nn.Module, official: bool, expected: Any) -> None:
        self.name, self.folder, self.model, self.official, self.expected = name, folder, model, official, expected
        self.config = json.loads((Path(folder) / "config.json").read_text())
        self.tensors: dict[str, torch.Tensor] = {}
        index = Path(folder) / "model.safetensors.index.json"
        files = ["model.safetensors"]
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for f in files:
            with safe_open(Path(folder) / f, framework="pt") as h:
                self.tensors.update({k: h.get_tensor(k) for k in h.keys()})
        self.text = self.config.get("text_config", self.config)
        self.prefix = "model.language_model." if official else "model."

    @functools.cached_property
    def deq(self) -> dict[str, np.ndarray]:
        return ct_dequantized(self.folder)


@pytest.fixture(scope="module", params=list(CASES))
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Written:
    config, dtype, recipe, official, expected = CASES[request.param]
    model = make_hf_model(config, seed=3, dtype=dtype)
    folder = write_ct_checkpoint(
        model, tmp_path_factory.mktemp(request.param), recipe, official_layout=official, calib_ids=CALIB_IDS
    )
    return Written(request.param, folder, model, official, expected)


def _modules(w: Written) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {leaf: tensor} over the text weights (visual / mtp excluded)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in w.tensors.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        module, _, leaf = name.rpartition(".")
        out.setdefault(module, {})[leaf] = t
    return out


# --------------------------------------------------------------------------------------------------------------------
# On-disk layout
# --------------------------------------------------------------------------------------------------------------------


def test_tensor_families(written: Written) -> None:
    """docs/formats.md §3: suffix sets, dtypes and shapes per key family; dense tensors keep the model dtype."""
    w = written
    model_dtype = CASES[w.name][1]
    recipe = CASES[w.name][2]
    scale_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[recipe.get("scale_dtype", "bfloat16")]
    n_quant = 0
    linears = 0
    for module, leaves in _modules(w).items():
        is_linear = bool(LINEAR.search(module))
        linears += is_linear
        args = w.expected(module) if is_linear else None
        if args is None:
            kv = {k for k in leaves if k in ("k_scale", "v_scale")}
            assert set(leaves) - kv <= {"weight", "A_log", "dt_bias"}, (module, set(leaves))
            for leaf, t in leaves.items():
                if leaf not in kv:
                    assert t.dtype == model_dtype, (module, leaf, t.dtype)
            continue
        n_quant += 1
        if IS_EXPERT.search(module):
            rows, cols = _expert_shape(w, module)
        else:
            rows, cols = w.model.get_parameter(_hf_name(w, module)).shape
        if args["type"] == "float":  # MXFP8 (§5)
            assert set(leaves) == {"weight", "weight_scale"}, module
            assert leaves["weight"].dtype == torch.float8_e4m3fn and list(leaves["weight"].shape) == [rows, cols]
            assert leaves["weight_scale"].dtype == torch.uint8
            assert list(leaves["weight_scale"].shape) == [rows, cols // 32]
            continue
        bits, sym = args["num_bits"], args["symmetric"]
        expect = {"weight_packed", "weight_scale", "weight_shape"} | (set() if sym else {"weight_zero_point"})
        assert set(leaves) == expect, (module, set(leaves))
        assert leaves["weight_packed"].dtype == torch.int32
        assert list(leaves["weight_packed"].shape) == [rows, math.ceil(cols * bits / 32)], module
        assert leaves["weight_shape"].dtype == torch.int64 and leaves["weight_shape"].tolist() == [rows, cols]
        ngroups = {"group": math.ceil(cols / args.get("group_size", 1)), "channel": 1}[args["strategy"]]
        assert leaves["weight_scale"].dtype == scale_dtype
        assert list(leaves["weight_scale"].shape) == [rows, ngroups], module
        if not sym:
            zp = leaves["weight_zero_point"]
            assert zp.dtype == torch.int32 and list(zp.shape) == [math.ceil(rows * bits / 32), ngroups], module
    assert n_quant > 0 and linears > 0
    # experts are per-expert 2-D on disk (§7), never fused
    fused = ("experts.gate_up_proj", "experts.down_proj")
    assert not any(k.endswith(fused) and not k.startswith("mtp.") for k in w.tensors)
    assert f"{w.prefix}layers.0.mlp.experts.{w.text['num_experts'] - 1}.down_proj" in _modules(w)


def _hf_name(w: Written, module: str) -> str:
    return ("model." + module[len(w.prefix) :] if module.startswith(w.prefix) else module) + ".weight"


def _expert_shape(w: Written, module: str) -> tuple[int, int]:
    inter, hidden = w.text["moe_intermediate_size"], w.text["hidden_size"]
    return (hidden, inter) if module.endswith("down_proj") else (inter, hidden)


def test_kv_scales(written: Written) -> None:
    """§6: k_scale / v_scale only on full-attention layers; BF16 [1] (llmcompressor) or F32 [kv heads] (attn_head)."""
    w = written
    kv = CASES[w.name][2].get("kv_cache")
    names = sorted(k for k in w.tensors if k.endswith(("k_scale", "v_scale")))
    if kv is None:
        assert names == [] and w.config["quantization_config"].get("kv_cache_scheme") is None
        return
    full = [i for i, t in enumerate(w.text["layer_types"]) if t == "full_attention"]
    assert names == sorted(f"{w.prefix}layers.{i}.self_attn.{t}_scale" for i in full for t in "kv")
    per_head = kv["strategy"] == "attn_head"
    for n in names:
        t = w.tensors[n]
        assert t.dtype == (torch.float32 if per_head else torch.bfloat16)
        assert list(t.shape) == ([w.text["num_key_value_heads"]] if per_head else [1])
        assert (t.float() > 0).all() and (t.float() < 1).all()
    scheme = w.config["quantization_config"]["kv_cache_scheme"]
    assert scheme["num_bits"] == 8 and scheme["type"] == "float" and scheme["symmetric"] is True
    assert scheme["strategy"] == kv["strategy"] and scheme["dynamic"] is False
    # amax / 448 of K after k_norm + RoPE on the calibration forward: the scales are not clipping a fresh prompt much
    assert set(kv_scales(w.folder)) == set(full)


def test_kv_scales_are_amax_over_448(written: Written, monkeypatch: pytest.MonkeyPatch) -> None:
    """§6: scale = max|K| / 448 with K after k_norm + RoPE, V after v_proj, over the calibration forward of the
    dequantized model; observed here independently by wrapping transformers' `apply_rotary_pos_emb` / `v_proj`."""
    kv = CASES[written.name][2].get("kv_cache")
    if kv is None:
        pytest.skip("no KV cache scheme")
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as qm

    model = ct_reference_model(written.folder)
    seen: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
    rope = qm.apply_rotary_pos_emb

    def recording_rope(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        seen["k"].append(k.detach())  # [B, kv heads, T, head_dim]
        return q, k

    monkeypatch.setattr(qm, "apply_rotary_pos_emb", recording_rope)
    hd = written.text["head_dim"]
    full = [i for i, t in enumerate(written.text["layer_types"]) if t == "full_attention"]
    for i in full:
        model.model.layers[i].self_attn.v_proj.register_forward_hook(
            lambda mod, inp, out: seen["v"].append(out.detach().unflatten(-1, (-1, hd)).transpose(1, 2))
        )
    hf_logits(model, CALIB_IDS)
    assert len(seen["k"]) == len(seen["v"]) == len(full)  # one calibration forward: each layer once, in order
    per_head = kv["strategy"] == "attn_head"
    scales = kv_scales(written.folder)
    for j, i in enumerate(full):
        for tag, stored in zip("kv", scales[i]):
            x = seen[tag][j].abs()
            amax = x.amax(dim=(0, 2, 3)) if per_head else x.amax().reshape(1)
            expect = (amax / 448).to(written.tensors[f"{written.prefix}layers.{i}.self_attn.k_scale"].dtype).float()
            torch.testing.assert_close(stored, expect, rtol=1e-5, atol=0)


def test_quantization_config(written: Written) -> None:
    """§1: compressed-tensors config parses; groups in module order; explicit ignore names; formats."""
    w = written
    q = w.config["quantization_config"]
    parsed = QuantizationConfig.model_validate(q)
    assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
    recipe = CASES[w.name][2]
    assert sorted(q["config_groups"]) == [f"group_{i}" for i in range(len(recipe["groups"]))]
    fmts = {g["format"] for g in q["config_groups"].values()}
    assert fmts <= {"pack-quantized", "mxfp8-quantized"}
    assert q["format"] == (fmts.pop() if len(fmts) == 1 else "mixed-precision")
    # ignore = explicit on-disk names of every unquantized Linear-like module (router included), no regexes
    ignore = q["ignore"]
    assert all(not i.startswith("re:") for i in ignore)
    n_layers = w.text["num_hidden_layers"]
    for i in range(n_layers):
        assert f"{w.prefix}layers.{i}.mlp.gate" in ignore and f"{w.prefix}layers.{i}.mlp.shared_expert_gate" in ignore
    assert "lm_head" in ignore
    assert not any(n.startswith("mtp.") for n in ignore)
    if w.official:
        assert w.config["model_type"] == "qwen3_5_moe" and "text_config" in w.config
        assert any(n.startswith("model.visual.") for n in ignore)
        assert any(k.startswith("mtp.") for k in w.tensors) and any(k.startswith("model.visual.") for k in w.tensors)
    else:
        assert w.config["model_type"] == "qwen3_5_moe_text" and w.config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    # the first group is the scheme met first in module order: layer 0 is linear attention, so a "Linear" group
    # that covers in_proj_qkv comes before an experts-only group
    if w.name == "w2_experts_w4_rest":
        assert q["config_groups"]["group_0"]["targets"] == ["Linear"]
        assert q["config_groups"]["group_1"]["weights"]["num_bits"] == 2
    if w.name == "mxfp8_experts":
        weights = q["config_groups"]["group_0"]["weights"]
        assert weights["scale_dtype"] == "torch.uint8" and weights["group_size"] == 32
    if CASES[w.name][2].get("config_style") == "ct-0.19":
        weights = q["config_groups"]["group_0"]["weights"]
        assert {"actorder", "block_structure", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"} <= set(weights)
        assert weights["observer"] == "memoryless_minmax"
    if w.name == "int4_asym_g128":
        assert q["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert parsed.config_groups["group_0"].weights is not None
    assert (Path(w.folder) / "generation_config.json").exists()


# --------------------------------------------------------------------------------------------------------------------
# Independent decode (docs/formats.md §4 / §5) vs compressed-tensors' decompression
# --------------------------------------------------------------------------------------------------------------------


def _unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """§4: dense LSB-first bit stream per row, offset by 2^(b-1); cut to n values."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = np.arange(per) * bits
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)
    return q[..., :n] - (1 << (bits - 1))


def _np_decode(leaves: dict[str, torch.Tensor], args: dict[str, Any]) -> np.ndarray:
    if args["type"] == "float":
        w = leaves["weight"].float().numpy()
        s = np.exp2(leaves["weight_scale"].numpy().astype(np.float64) - 127)
        return (w * np.repeat(s, 32, axis=-1)).astype(np.float32)
    bits = args["num_bits"]
    rows, cols = leaves["weight_shape"].tolist()
    q = _unpack(leaves["weight_packed"].numpy(), bits, cols).astype(np.float64)
    scale = leaves["weight_scale"].float().numpy().astype(np.float64)
    group = cols if args["strategy"] == "channel" else args["group_size"]
    idx = np.arange(cols) // group
    zp = np.zeros_like(scale)
    if "weight_zero_point" in leaves:
        zp = _unpack(leaves["weight_zero_point"].numpy().T, bits, rows).T.astype(np.float64)
    w = (q - zp[:, idx]) * scale[:, idx]
    # the library returns the product rounded once to the scale dtype (exact in f64)
    return torch.from_numpy(w).to(leaves["weight_scale"].dtype).float().numpy()


def test_independent_decode_matches_library(written: Written) -> None:
    deq = written.deq
    mods = _modules(written)
    assert len(deq) == sum(1 for m in mods if LINEAR.search(m) and written.expected(m) is not None)
    for key, lib in deq.items():
        module = key[: -len(".weight")]
        ours = _np_decode(mods[module], written.expected(module))
        np.testing.assert_array_equal(ours, lib, err_msg=module)


def test_pack_worked_example() -> None:
    """§4 worked example: int2 word 0x90FA1BE4 decodes to the listed values."""
    word = np.array([[np.int64(0x90FA1BE4) - (1 << 32)]], dtype=np.int64).astype(np.int32)
    q = [-2, -1, 0, 1, 1, 0, -1, -2, 0, 0, 1, 1, -2, -2, -1, 0]
    assert _unpack(word, 2, 16)[0].tolist() == q


# --------------------------------------------------------------------------------------------------------------------
# Numerics of the oracle
# --------------------------------------------------------------------------------------------------------------------


def test_dequantized_close_to_float(written: Written) -> None:
    deq = written.deq
    ref = per_expert_weights(written.model, official_layout=written.official)
    errs: dict[Any, list[float]] = {}
    for key, w in deq.items():
        args = written.expected(key[: -len(".weight")])
        kind = "mxfp8" if args["type"] == "float" else args["num_bits"]
        e = float(np.linalg.norm(w - ref[key]) / np.linalg.norm(ref[key]))
        assert e < REL_ERR[kind], (key, e)
        errs.setdefault(kind, []).append(e)
    for kind, es in errs.items():  # and quantization really happened
        assert np.mean(es) > {2: 0.2, 4: 0.03, 8: 1e-3, "mxfp8": 5e-3}[kind], (kind, np.mean(es))


def test_reference_model_uses_dequantized_weights(written: Written) -> None:
    ref = ct_reference_model(written.folder)
    assert all(p.dtype == torch.float32 for p in ref.parameters())
    deq = written.deq
    sd = ref.state_dict()
    inter = written.text["moe_intermediate_size"]
    for key, w in deq.items():
        name = "model." + key[len(written.prefix) :] if key.startswith(written.prefix) else key
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            e = int(m[2])
            got = sd[f"{m[1]}.down_proj"][e] if m[3] == "down" else sd[f"{m[1]}.gate_up_proj"][e][
                slice(0, inter) if m[3] == "gate" else slice(inter, None)
            ]
        else:
            got = sd[name]
        np.testing.assert_array_equal(got.numpy(), w, err_msg=key)
    # dense tensors exactly as stored, upcast
    norm = f"{written.prefix}norm.weight"
    np.testing.assert_array_equal(sd["model.norm.weight"].numpy(), written.tensors[norm].float().numpy())


def test_reference_logits(written: Written) -> None:
    ids = np.random.default_rng(5).integers(0, written.text["vocab_size"], (1, 16))
    logits = ct_reference_logits(written.folder, ids)
    assert logits.shape == (1, 16, written.text["vocab_size"]) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    base = hf_logits(copy.deepcopy(written.model).float(), ids)
    diff = np.linalg.norm(logits - base) / np.linalg.norm(base)
    args = [written.expected(m) for m in _modules(written) if LINEAR.search(m)]
    kinds = {a["num_bits"] if a["type"] == "int" else 8 for a in args if a is not None}
    # The tiny random model is chaotic (0.4 % weight noise already moves logits by ~0.1 relative): sanity bounds only.
    assert diff < {2: 2.0, 4: 1.5, 8: 0.5}[min(kinds)], diff
    if CASES[written.name][2].get("kv_cache") is not None:
        fp8 = ct_reference_logits(written.folder, ids, fp8_kv=True)
        d = np.abs(fp8 - logits).max()
        assert 0 < d < 0.5 * np.abs(logits).max(), d
    else:
        with pytest.raises(ValueError):
            ct_reference_logits(written.folder, ids, fp8_kv=True)


def test_fp8_kv_fake_quant() -> None:
    x = torch.randn(2, 3, 5, 8)
    s = torch.tensor([0.01, 0.02, 0.004])
    y = fp8_kv_fake_quant(x, s)
    for h in range(3):
        ref = (x[:, h] / s[h]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s[h]
        torch.testing.assert_close(y[:, h], ref, rtol=0, atol=0)
    assert (fp8_kv_fake_quant(x, torch.tensor([0.5])) - x).abs().max() < 0.07 * x.abs().max()


def test_writer_leaves_model_untouched() -> None:
    model = make_hf_model(tiny_text_config(), seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_ct_checkpoint(model, tmp, {"groups": [{"targets": [EXPERTS], "weights": _int(8, group=32)}]})
        again = Path(tmp) / "again"
        write_ct_checkpoint(model, again, {"groups": [{"targets": [EXPERTS], "weights": _int(8, group=32)}]})
        with safe_open(Path(tmp) / "model.safetensors", "pt") as a, safe_open(again / "model.safetensors", "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k  # deterministic
    after = model.state_dict()
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3_5MoeExperts"
    assert all(torch.equal(before[k], after[k]) for k in before)
