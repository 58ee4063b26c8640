"""qjax.quant.config: parsing real-world-shaped compressed-tensors configs, matching, refusals, round trips.

The config dicts below mirror the shapes of the tiny fixture checkpoints (llmcompressor 0.14 / compressed-tensors 0.19
and auto-round 0.15 exports, see docs/formats.md §1); they are embedded so the tests read nothing from disk.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig
from compressed_tensors.utils.match import match_named_modules, match_targets

from qjax.quant import KVCacheScheme, QuantConfigError, QuantizationConfig, WeightScheme

LM = "model.language_model.layers"
VISUAL_IGNORE = [
    "model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj", "model.visual.blocks.0.mlp.linear_fc1",
    "model.visual.blocks.0.mlp.linear_fc2", "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2",
]
ROUTER_IGNORE = [f"{LM}.{i}.mlp.{m}" for i in range(4) for m in ("gate", "shared_expert_gate")]


def args(num_bits: int, type_: str = "int", *, group_size: int | None = 128, strategy: str | None = "group",
         symmetric: bool = True, observer: str | None = "memoryless_minmax", scale_dtype: str | None = None,
         dynamic: bool = False) -> dict[str, Any]:
    """A QuantizationArgs dict with every key, as compressed-tensors 0.19 serialises it."""
    return {
        "actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group_size, "num_bits": num_bits,
        "observer": observer, "observer_kwargs": {}, "scale_dtype": scale_dtype, "strategy": strategy,
        "symmetric": symmetric, "type": type_, "zp_dtype": None if symmetric else "torch.int8",
    }


def group(targets: list[str], weights: dict[str, Any], fmt: str | None = "pack-quantized",
          input_activations: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"format": fmt, "input_activations": input_activations, "output_activations": None, "targets": targets,
            "weights": weights}


def llmc(groups: dict[str, Any], ignore: list[str], fmt: str = "pack-quantized",
         kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """llmcompressor's top level."""
    return {
        "config_groups": groups, "format": fmt, "global_compression_ratio": None, "ignore": ignore,
        "kv_cache_scheme": kv, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": "0.19.0",
    }


KV_TENSOR = args(8, "float", group_size=None, strategy="tensor", observer=None)
KV_HEAD = {**KV_TENSOR, "strategy": "attn_head"}
MX_WEIGHTS = args(8, "float", group_size=32, scale_dtype="torch.uint8")
MX_ACTIVATIONS = args(8, "float", group_size=32, scale_dtype="torch.uint8", observer=None, dynamic=True)

W4A16_SYM = llmc({"group_0": group(["Linear"], args(4))}, VISUAL_IGNORE + ROUTER_IGNORE + ["lm_head"])
W4A16_ASYM = llmc({"group_0": group(["Linear"], args(4, symmetric=False))}, VISUAL_IGNORE + ROUTER_IGNORE + ["lm_head"])
W8A16_G32 = llmc({"group_0": group(["Linear"], args(8, group_size=32))}, VISUAL_IGNORE + ROUTER_IGNORE + ["lm_head"])
W2A16_MIXED = llmc(
    {
        "group_0": group([
            "re:.*self_attn\\.(q|k|v|o)_proj$",
            "re:.*linear_attn\\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)$",
            "re:.*mlp\\.shared_expert\\.(gate|up|down)_proj$",
        ], args(4)),
        "group_1": group(["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"], args(2, group_size=64)),
    },
    VISUAL_IGNORE + ROUTER_IGNORE + ["lm_head"],
)
MXFP8A16_KVFP8 = llmc(
    {"group_0": group(["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"], MX_WEIGHTS, fmt="mxfp8-quantized")},
    VISUAL_IGNORE + [f"{LM}.0.linear_attn.out_proj", f"{LM}.0.mlp.gate", f"{LM}.1.self_attn.q_proj", "lm_head"],
    fmt="mxfp8-quantized",
    kv=KV_TENSOR,
)
# auto-round, format="llm_compressor", INT mixed: explicit full-name targets, observer null, no version/sparsity keys.
AR_W2W4 = {
    "config_groups": {
        "group_0": group([f"{LM}.{i}.{m}" for i in range(4) for m in (
            "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.shared_expert.down_proj")],
            args(4, observer=None)),
        "group_1": group([f"{LM}.{i}.mlp.experts.{e}.{p}_proj" for i in range(4) for e in range(4)
                          for p in ("down", "gate", "up")], args(2, group_size=64, observer=None)),
    },
    "format": "pack-quantized", "global_compression_ratio": None,
    "ignore": VISUAL_IGNORE + [f"{LM}.0.linear_attn.in_proj_b", f"{LM}.0.linear_attn.in_proj_a"] + ROUTER_IGNORE
    + ["lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# auto-round MXFP8 + static FP8 KV on a text-only model: group format null, targets ["Linear"], regex ignore entries.
AR_MXFP8_TEXT = {
    "config_groups": {"group_0": group(["Linear"], {**MX_WEIGHTS, "observer": None}, fmt=None,
                                       input_activations=MX_ACTIVATIONS)},
    "format": "mxfp8-quantized", "global_compression_ratio": None,
    "ignore": [f"re:.*model\\.layers\\.{i}\\.mlp\\.gate.*" for i in range(4)]
    + [f"model.layers.{i}.{m}" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")] + ["lm_head"],
    "kv_cache_scheme": KV_TENSOR, "provider": "auto-round", "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
AR_MXFP8_HEAD = {**AR_MXFP8_TEXT, "kv_cache_scheme": KV_HEAD}

CONFIGS = {
    "w4a16_sym": W4A16_SYM, "w4a16_asym": W4A16_ASYM, "w8a16_g32": W8A16_G32, "w2a16_mixed": W2A16_MIXED,
    "mxfp8a16_kvfp8": MXFP8A16_KVFP8, "ar_w2w4_rtn": AR_W2W4, "ar_mxfp8_kvfp8_text": AR_MXFP8_TEXT,
    "ar_mxfp8_kv_head": AR_MXFP8_HEAD,
}

INT4 = WeightScheme("pack-quantized", 4, "int", True, "group", 128, None)
INT2_G64 = WeightScheme("pack-quantized", 2, "int", True, "group", 64, None)
MXFP8 = WeightScheme("mxfp8-quantized", 8, "float", True, "group", 32, "uint8")


# ---------------------------------------------------------------------------------------------------------------------
# parsing real-world shapes
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fixture_shapes_are_valid_compressed_tensors(name: str) -> None:
    """Sanity: the embedded dicts are configs compressed-tensors itself accepts."""
    CTQuantizationConfig.model_validate(copy.deepcopy(CONFIGS[name]))


def test_w4a16_sym() -> None:
    cfg = QuantizationConfig.from_dict(W4A16_SYM)
    assert cfg.groups == (("group_0", ("Linear",), INT4),)
    assert cfg.format == "pack-quantized" and cfg.kv_cache is None
    assert cfg.scheme_for(f"{LM}.0.self_attn.q_proj") == INT4
    assert cfg.scheme_for(f"{LM}.2.mlp.experts.3.down_proj") == INT4
    assert cfg.scheme_for(f"{LM}.0.mlp.gate") is None  # explicit-name ignore
    assert cfg.scheme_for(f"{LM}.3.mlp.shared_expert_gate") is None
    assert cfg.scheme_for("lm_head") is None and cfg.scheme_for("model.visual.merger.linear_fc2") is None
    # "Linear" is a class target: a module the caller says is not linear is never covered.
    assert cfg.scheme_for(f"{LM}.0.input_layernorm", is_linear=False) is None
    assert cfg.match(f"{LM}.1.linear_attn.out_proj") == ("group_0", INT4)


def test_w4a16_asym_and_w8() -> None:
    asym = QuantizationConfig.from_dict(W4A16_ASYM).scheme_for(f"{LM}.0.self_attn.k_proj")
    assert asym == dataclasses.replace(INT4, symmetric=False)
    w8 = QuantizationConfig.from_dict(W8A16_G32).scheme_for(f"{LM}.0.mlp.experts.0.up_proj")
    assert w8 == WeightScheme("pack-quantized", 8, "int", True, "group", 32, None)


def test_w2a16_mixed_regex_targets() -> None:
    cfg = QuantizationConfig.from_dict(W2A16_MIXED)
    assert [g[0] for g in cfg.groups] == ["group_0", "group_1"]
    assert cfg.scheme_for(f"{LM}.1.self_attn.o_proj") == INT4
    assert cfg.scheme_for(f"{LM}.0.linear_attn.in_proj_a") == INT4
    assert cfg.scheme_for(f"{LM}.0.mlp.shared_expert.down_proj") == INT4
    assert cfg.scheme_for(f"{LM}.3.mlp.experts.3.gate_proj") == INT2_G64
    assert cfg.scheme_for("model.layers.3.mlp.experts.0.up_proj") == INT2_G64  # text-only prefix works too
    assert cfg.scheme_for(f"{LM}.0.mlp.shared_expert_gate") is None
    assert cfg.scheme_for(f"{LM}.0.self_attn.q_proj.extra") is None  # patterns carry their own `$`
    assert cfg.scheme_for("lm_head") is None


def test_mxfp8_llmcompressor() -> None:
    cfg = QuantizationConfig.from_dict(MXFP8A16_KVFP8)
    assert cfg.format == "mxfp8-quantized" and cfg.kv_cache == KVCacheScheme(8, "float", "tensor")
    assert cfg.scheme_for(f"{LM}.0.mlp.experts.1.down_proj") == MXFP8
    assert cfg.scheme_for(f"{LM}.0.self_attn.q_proj") is None  # not targeted
    assert cfg.scheme_for(f"{LM}.0.mlp.gate") is None


def test_autoround_explicit_names() -> None:
    cfg = QuantizationConfig.from_dict(AR_W2W4, source="ar/config.json")
    assert len(cfg.groups[1][1]) == 48
    assert cfg.scheme_for(f"{LM}.2.mlp.experts.1.up_proj") == INT2_G64
    assert cfg.scheme_for(f"{LM}.3.self_attn.v_proj") == INT4
    assert cfg.scheme_for(f"{LM}.0.linear_attn.in_proj_a") is None  # ignored (auto-round's x32 rule)
    assert cfg.scheme_for(f"{LM}.0.mlp.shared_expert.up_proj") is None  # explicit targets: not listed -> None
    assert cfg.scheme_for("model.layers.2.mlp.experts.1.up_proj") is None  # exact names only


@pytest.mark.parametrize(("name", "kv_strategy"),
                         [("ar_mxfp8_kvfp8_text", "tensor"), ("ar_mxfp8_kv_head", "attn_head")])
def test_autoround_mxfp8(name: str, kv_strategy: str) -> None:
    cfg = QuantizationConfig.from_dict(CONFIGS[name])
    # Null group format -> the top-level one; the MX dynamic input activations are accepted and not recorded.
    assert cfg.groups == (("group_0", ("Linear",), MXFP8),)
    assert cfg.kv_cache == KVCacheScheme(8, "float", kv_strategy)
    assert cfg.scheme_for("model.layers.1.mlp.experts.2.gate_proj") == MXFP8
    assert cfg.scheme_for("model.layers.1.mlp.gate") is None  # regex ignore
    assert cfg.scheme_for("model.layers.3.mlp.shared_expert_gate") is None  # explicit ignore
    assert cfg.scheme_for("model.layers.3.self_attn.o_proj") is None
    assert cfg.scheme_for("lm_head") is None
    # "re:" patterns are anchored at the start only: ".*model\.layers\.0\.mlp\.gate.*" also covers prefixed names.
    assert cfg.scheme_for("model.language_model.layers.0.mlp.gate") is None


def test_format_resolution() -> None:
    mixed = llmc({
        "group_0": group(["re:.*experts.*"], MX_WEIGHTS, fmt="mxfp8-quantized"),
        "group_1": group(["re:.*self_attn.*"], args(4), fmt=None),  # null + "mixed-precision" -> inferred
    }, [], fmt="mixed-precision")
    cfg = QuantizationConfig.from_dict(mixed)
    assert cfg.format == "mixed-precision"
    assert cfg.scheme_for("m.experts.0.up_proj") == MXFP8 and cfg.scheme_for("m.self_attn.q_proj") == INT4
    # No top-level format at all: inferred per group, and the config's format is what the groups imply.
    bare = {"quant_method": "compressed-tensors", "config_groups": {
        "a": group(["re:.*experts.*"], MX_WEIGHTS, fmt=None), "b": group(["Linear"], args(8, group_size=32), fmt=None)}}
    cfg = QuantizationConfig.from_dict(bare)
    assert cfg.format == "mixed-precision"
    assert cfg.scheme_for("x.experts.1.up_proj") == MXFP8 and cfg.scheme_for("x.q_proj").num_bits == 8
    # Strategy inferred from group_size like compressed-tensors: -1 -> channel, None -> tensor.
    chan = llmc({"g": group(["Linear"], args(4, group_size=-1, strategy=None))}, [])
    assert QuantizationConfig.from_dict(chan).scheme_for("q").strategy == "channel"
    tens = llmc({"g": group(["Linear"], args(8, group_size=None, strategy=None, symmetric=False))}, [])
    assert QuantizationConfig.from_dict(tens).scheme_for("q") == WeightScheme("pack-quantized", 8, "int", False,
                                                                              "tensor", None, None)
    # A kv-only config (no weight groups) is fine.
    kv_only = {**llmc({}, [], fmt="dense", kv=KV_TENSOR)}
    cfg = QuantizationConfig.from_dict(kv_only)
    assert cfg.groups == () and cfg.kv_cache is not None and cfg.scheme_for("q") is None


def test_accepts_empty_extras() -> None:
    d = {**W4A16_SYM, "sparsity_config": {"format": "dense", "global_sparsity": 0.0}, "transform_config": {
        "config_groups": {}}, "moe_sparsity_config": None}
    assert QuantizationConfig.from_dict(d).groups[0][2] == INT4


# ---------------------------------------------------------------------------------------------------------------------
# matching precedence vs compressed-tensors itself
# ---------------------------------------------------------------------------------------------------------------------
class Qwen3_5MoeTopKRouter(torch.nn.Module):  # a non-Linear module with a weight, like the real router
    pass


def tiny_tree(names: dict[str, bool]) -> torch.nn.Module:
    """An nn.Module tree with the given dotted names (True: nn.Linear, False: a non-linear module)."""
    root = torch.nn.Module()
    for name, is_linear in names.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(2, 2) if is_linear else Qwen3_5MoeTopKRouter())
    return root


def ct_groups(model: torch.nn.Module, d: dict[str, Any]) -> dict[str, str]:
    """module name -> group name, exactly as compressed-tensors' apply_quantization_config resolves it."""
    target_to_group: OrderedDict[str, str] = OrderedDict()
    for gname, g in d["config_groups"].items():
        for t in g["targets"]:
            target_to_group[t] = gname
    out = {}
    for name, module in match_named_modules(model, target_to_group, d["ignore"]):
        out[name] = target_to_group[match_targets(name, module, target_to_group)[0]]
    return out


def test_precedence_matches_compressed_tensors() -> None:
    names = {f"model.layers.{i}.{m}": True for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.experts.0.up_proj", "mlp.experts.1.down_proj",
        "mlp.shared_expert.up_proj", "linear_attn.out_proj")}
    names.update({"model.layers.0.mlp.gate": False, "model.layers.1.mlp.gate": False, "lm_head": True})
    d = llmc({
        "g_all": group(["Linear"], args(8, group_size=32)),  # class target: lowest precedence
        "g_z": group(["re:.*self_attn.*", "model.layers.1.mlp.experts.0.up_proj"], args(4)),
        "g_a": group(["re:.*experts.*", "re:.*_proj$"], args(2, group_size=64)),  # alphabetically first regexes
        "g_dup": group(["re:.*linear_attn.*"], args(4, group_size=64)),
        "g_dup2": group(["re:.*linear_attn.*"], args(4, group_size=32)),  # same string later: this group wins
    }, ["re:.*shared_expert.*", "lm_head"])
    model = tiny_tree(names)
    expected = ct_groups(model, d)
    cfg = QuantizationConfig.from_dict(d)
    for name, is_linear in names.items():
        found = cfg.match(name, is_linear=is_linear)
        assert (found[0] if found else None) == expected.get(name), name
    assert expected["model.layers.1.mlp.experts.0.up_proj"] == "g_z"  # exact name beats regex
    assert expected["model.layers.0.self_attn.q_proj"] == "g_a"  # "re:.*_proj$" sorts before "re:.*self_attn.*"
    assert expected["model.layers.0.linear_attn.out_proj"] == "g_a"
    assert "model.layers.0.mlp.gate" not in expected  # not Linear


def test_duplicate_target_later_group_wins() -> None:
    d = llmc({"a": group(["re:.*linear_attn.*"], args(4)), "b": group(["re:.*linear_attn.*"], args(8, group_size=32))},
             [])
    assert QuantizationConfig.from_dict(d).match("x.linear_attn.out_proj")[0] == "b"
    model = tiny_tree({"x.linear_attn.out_proj": True})
    assert ct_groups(model, d)["x.linear_attn.out_proj"] == "b"  # (the regex also covers the container module)


def test_regex_anchored_at_start_only() -> None:
    d = llmc({"g": group(["re:mlp\\.experts", "re:.*q_proj"], args(4))}, ["re:.*lm_head"])
    cfg = QuantizationConfig.from_dict(d)
    assert cfg.scheme_for("model.layers.0.mlp.experts.0.up_proj") is None  # re.match, not re.search
    assert cfg.scheme_for("mlp.experts.0.up_proj") == INT4  # prefix match, no `$`
    assert cfg.scheme_for("model.q_proj_extra") == INT4
    assert cfg.scheme_for("model.lm_head") is None  # regex ignore


# ---------------------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_dict_round_trip(name: str) -> None:
    cfg = QuantizationConfig.from_dict(CONFIGS[name])
    d = cfg.to_dict()
    json.dumps(d)  # plain JSON
    ct = CTQuantizationConfig.model_validate(copy.deepcopy(d))
    assert ct.quant_method == "compressed-tensors" and ct.quantization_status == "compressed"
    assert list(ct.config_groups) == [g[0] for g in cfg.groups]
    for gname, targets, scheme in cfg.groups:
        w = ct.config_groups[gname].weights
        assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size) == (
            scheme.num_bits, scheme.type, scheme.symmetric, scheme.strategy, scheme.group_size)
        assert ct.config_groups[gname].targets == list(targets)
        assert ct.config_groups[gname].format == scheme.format
    assert QuantizationConfig.from_dict(d) == cfg
    # compressed-tensors' own serialisation parses back to the same config too.
    assert QuantizationConfig.from_dict(ct.model_dump(mode="json")) == cfg


def test_to_dict_fields() -> None:
    d = QuantizationConfig.from_dict(W4A16_ASYM).to_dict()
    w = d["config_groups"]["group_0"]["weights"]
    assert w["zp_dtype"] == "torch.int8" and w["observer"] == "memoryless_minmax" and w["actorder"] is None
    assert w["dynamic"] is False and d["format"] == "pack-quantized"
    mx = QuantizationConfig.from_dict(AR_MXFP8_HEAD).to_dict()
    assert mx["config_groups"]["group_0"]["format"] == "mxfp8-quantized"
    assert mx["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.uint8"
    assert mx["kv_cache_scheme"]["strategy"] == "attn_head"


def test_frozen_and_hashable() -> None:
    cfg = QuantizationConfig.from_dict(W2A16_MIXED)
    again = QuantizationConfig.from_dict(copy.deepcopy(W2A16_MIXED))
    assert cfg == again and hash(cfg) == hash(again)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ignore = ()  # type: ignore[misc]
    assert len({INT4, dataclasses.replace(INT4)}) == 1


def test_bits_per_weight() -> None:
    assert INT4.bits_per_weight() == 4 + 16 / 128
    assert INT4.bits_per_weight(scale_itemsize=4) == 4 + 32 / 128
    assert dataclasses.replace(INT4, symmetric=False).bits_per_weight() == 4 + (16 + 4) / 128
    assert INT2_G64.bits_per_weight() == 2.25
    assert MXFP8.bits_per_weight() == 8.25
    chan = WeightScheme("pack-quantized", 8, "int", True, "channel", None, None)
    assert chan.bits_per_weight() == 8 and chan.bits_per_weight(in_features=2048) == 8 + 16 / 2048


# ---------------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------------
def test_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "quantization_config": AR_W2W4}))
    assert QuantizationConfig.from_config_json(tmp_path / "config.json") == QuantizationConfig.from_dict(AR_W2W4)
    assert QuantizationConfig.from_config_json(tmp_path) == QuantizationConfig.from_dict(AR_W2W4)  # folder
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    assert QuantizationConfig.from_config_json(plain / "config.json") is None
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = copy.deepcopy(W4A16_SYM)
    broken["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    (bad / "config.json").write_text(json.dumps({"quantization_config": broken}))
    with pytest.raises(QuantConfigError, match=rf"{bad / 'config.json'}.*config_groups\.group_0\.weights\.num_bits"):
        QuantizationConfig.from_config_json(bad)


# ---------------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------------
def weights_with(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(W4A16_SYM)
    d["config_groups"]["group_0"]["weights"].update(changes)
    return d


def group_with(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(W4A16_SYM)
    d["config_groups"]["group_0"].update(changes)
    return d


def top_with(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(W4A16_SYM), **changes}


def mx_with(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(MXFP8A16_KVFP8)
    d["config_groups"]["group_0"]["weights"].update(changes)
    return d


W8A8_INPUTS = args(8, group_size=None, strategy="token", observer=None, dynamic=True)
REFUSALS = {
    "gptq": (top_with(quant_method="gptq"), "quant_method", "'gptq'"),
    "no_method": ({k: v for k, v in W4A16_SYM.items() if k != "quant_method"}, "quant_method", "compressed-tensors"),
    "int3": (weights_with(num_bits=3), "group_0.weights.num_bits", "3-bit int"),
    "int16": (weights_with(num_bits=16), "group_0.weights.num_bits", "16-bit int"),
    "nvfp4": (mx_with(num_bits=4, group_size=16, scale_dtype=None), "group_0.weights.num_bits", "NVFP4"),
    "fp8_channel": (mx_with(strategy="channel", group_size=None), "group_0.weights.strategy",
                    "FP8 weights with strategy 'channel'"),
    "fp8_g128": (mx_with(group_size=128), "group_0.weights.group_size", "group_size 128 is not MXFP8"),
    "fp8_bf16_scale": (mx_with(scale_dtype="torch.bfloat16"), "group_0.weights.scale_dtype", "E8M0"),
    "actorder_group": (weights_with(actorder="group"), "group_0.weights.actorder", "'group'"),
    "actorder_weight": (weights_with(actorder="weight"), "group_0.weights.actorder", "'weight'"),
    "actorder_static": (weights_with(actorder="static"), "group_0.weights.actorder", "'static'"),
    "actorder_true": (weights_with(actorder=True), "group_0.weights.actorder", "True"),
    "w8a8": (group_with(input_activations=W8A8_INPUTS, weights=args(8, group_size=None, strategy="channel")),
             "group_0.input_activations", "int 8-bit token activation"),
    "mx_acts_on_int": (group_with(input_activations=MX_ACTIVATIONS), "group_0.input_activations",
                       "float 8-bit group"),
    "static_fp8_acts": (mx_with() | {"config_groups": {"group_0": group(
        ["Linear"], MX_WEIGHTS, "mxfp8-quantized", input_activations={**MX_ACTIVATIONS, "dynamic": False})}},
        "group_0.input_activations", "dynamic=False"),
    "output_acts": (group_with(output_activations=W8A8_INPUTS), "group_0.output_activations", "output activation"),
    "block": (weights_with(strategy="block", group_size=None, block_structure=[128, 128]),
              "group_0.weights.block_structure", "block"),
    "token": (weights_with(strategy="token", group_size=None), "group_0.weights", "'token'"),
    "tensor_group": (weights_with(strategy="tensor_group", group_size=16), "group_0.weights.strategy",
                     "'tensor_group'"),
    "group_no_size": (weights_with(group_size=None), "group_0.weights.group_size", "positive group_size"),
    "size_on_channel": (weights_with(strategy="channel"), "group_0.weights.group_size", "needs strategy 'group'"),
    "int_quantized": (group_with(format="int-quantized", weights=args(8, group_size=None, strategy="channel")),
                      "group_0.format", "'int-quantized'"),
    "float_quantized": (group_with(format="float-quantized"), "group_0.format", "'float-quantized'"),
    "nvfp4_format": (group_with(format="nvfp4-pack-quantized"), "group_0.format", "NVFP4"),
    "marlin": (group_with(format="marlin-24"), "group_0.format", "'marlin-24'"),
    "top_int_quantized": (top_with(format="int-quantized"), "quantization_config.format", "'int-quantized'"),
    "format_type_mismatch": (group_with(format="mxfp8-quantized"), "group_0.format", "does not fit int"),
    "dynamic_weights": (weights_with(dynamic=True), "group_0.weights.dynamic", "dynamic=True"),
    "local_weights": (weights_with(dynamic="local"), "group_0.weights.dynamic", "'local'"),
    "sparse": (top_with(sparsity_config={"format": "sparse-24-bitmask", "global_sparsity": 0.5,
                                         "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": []}),
               "sparsity_config.format", "'sparse-24-bitmask'"),
    "transform": (top_with(transform_config={"config_groups": {"u": {"type": "hadamard", "apply": [{}]}}}),
                  "transform_config", "not supported"),
    "moe_sparsity": (top_with(moe_sparsity_config={"method": "prune", "num_experts": [3, 3, 3, 3]}),
                     "moe_sparsity_config", "expert sparsity"),
    "kv_int8": (top_with(kv_cache_scheme=args(8, group_size=None, strategy="tensor")), "kv_cache_scheme",
                "int 8-bit KV"),
    "kv_channel": (top_with(kv_cache_scheme={**KV_TENSOR, "strategy": "channel"}), "kv_cache_scheme.strategy",
                   "'channel'"),
    "kv_asym": (top_with(kv_cache_scheme={**KV_TENSOR, "symmetric": False}), "kv_cache_scheme.symmetric",
                "asymmetric"),
    "class_target": (group_with(targets=["Embedding"]), "group_0.targets", "'Embedding'"),
    "preset_group": (top_with(config_groups={"W4A16": ["Linear"]}), "config_groups.W4A16", "preset"),
    "bad_regex": (group_with(targets=["re:(unclosed"]), "group_0.targets", "invalid regex"),
    "bad_ignore_regex": (top_with(ignore=["re:[x"]), "quantization_config.ignore", "invalid regex"),
    "status": (top_with(quantization_status="frozen"), "quantization_status", "'frozen'"),
    "no_weights": (group_with(weights=None), "group_0.weights", "without weight quantization"),
    "unknown_arg": (weights_with(rounding="stochastic"), "group_0.weights", "unknown keys ['rounding']"),
    "zp_dtype": (weights_with(symmetric=False, zp_dtype="torch.int32"), "group_0.weights.zp_dtype", "int32"),
    "int_uint8_scale": (weights_with(scale_dtype="torch.uint8"), "group_0.weights.scale_dtype", "'uint8'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case: str) -> None:
    d, field, words = REFUSALS[case]
    with pytest.raises(QuantConfigError) as info:
        QuantizationConfig.from_dict(d, source="ckpt/config.json")
    msg = str(info.value)
    assert msg.startswith("ckpt/config.json: "), msg
    assert field in msg and words in msg, msg


# ---------------------------------------------------------------------------------------------------------------------
# the parts kept unquantized (qjax.quant.unquantized): their entries, as every consumer matches them
# ---------------------------------------------------------------------------------------------------------------------
# module names of each part as checkpoints and consumers spell them (vLLM loads model.visual.* as visual.*, and
# builds its MTP drafter under mtp.*), and body modules none of them may match
KEPT_NAMES = {"mtp.": ["mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.mlp.experts.3.down_proj",
                       "mtp.layers.0.mlp.experts", "mtp.layers.0.mlp.shared_expert.gate_proj"],
              "model.visual.": ["model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc2",
                                "visual.blocks.0.mlp.linear_fc1"]}
BODY_NAMES = ["model.layers.0.self_attn.q_proj", "model.language_model.layers.3.mlp.experts.7.up_proj",
              "model.language_model.layers.0.linear_attn.in_proj_qkv", "lm_head", "model.embed_tokens"]


def test_kept_parts_entries_match_their_modules_in_every_consumer() -> None:
    from compressed_tensors.utils.match import match_name

    from qjax.checkpoint.auto_round import standard_regex
    from qjax.quant.unquantized import KEPT_UNQUANTIZED, kept_part, parts_held

    assert [p.prefix for p in KEPT_UNQUANTIZED] == list(KEPT_NAMES)
    qc = QuantizationConfig(groups=(("all", ("Linear",), WeightScheme("pack-quantized", 4, "int", True, "group",
                                                                       32)),),
                            ignore=tuple(p.ignore_entry for p in KEPT_UNQUANTIZED))
    for part in KEPT_UNQUANTIZED:
        assert part.regex == standard_regex(part.word + ".")  # an auto-round extra_config key as auto-round makes it
        for name in KEPT_NAMES[part.prefix]:
            assert match_name(name, part.ignore_entry), name  # compressed-tensors (and vLLM: the same re.match)
            assert qc.scheme_for(name) is None, name
            assert re.search(part.regex, name), name  # auto-round's and qjax's extra_config lookup
    for name in BODY_NAMES:
        assert not any(match_name(name, p.ignore_entry) for p in KEPT_UNQUANTIZED), name
        assert qc.scheme_for(name) is not None and kept_part(name) is None
    assert kept_part("mtp.layers.0.self_attn.q_proj").what == "the MTP head"
    assert parts_held(["model.layers.0.mlp.gate.weight", "mtp.fc.weight"]) == KEPT_UNQUANTIZED[:1]


@pytest.mark.parametrize("pattern,bits,refused", [(".*mtp.*", 4, True), ("mtp.fc", 2, True),
                                                  ("re:.*visual.*", 8, True), (".*mtp.*", 16, False),
                                                  (".*experts.*", 2, False)])
def test_a_recipe_that_names_a_kept_part_is_refused(pattern: str, bits: int, refused: bool) -> None:
    """AutoRound's layer_config (checked before anything is loaded) and RTN's config groups: a pattern that would
    quantize the MTP head or the vision tower by name is refused, naming it; keeping them at 16 bits is not."""
    from qjax.autoround.rtn import quantize_model
    from qjax.autoround.schemes import Scheme, check_layer_config

    def check():
        check_layer_config(Scheme(bits=4, group_size=32), {pattern: {"bits": bits}})
    if not refused:
        check()
        return
    with pytest.raises(ValueError, match=r"names (mtp|model\.visual)\.\* \(the (MTP head|vision tower)\)"):
        check()
    scheme = WeightScheme("pack-quantized", 4, "int", True, "group", 32)
    with pytest.raises(ValueError, match=f"{re.escape(repr(pattern))} names"):  # before the model is looked at
        quantize_model(None, QuantizationConfig(groups=(("g", (pattern,), scheme),)))
