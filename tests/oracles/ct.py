"""Test-time compressed-tensors checkpoints of tiny Qwen3.5/3.6-MoE models, and the float32 oracle that reads them.

Everything is produced at test time with the real libraries (no llmcompressor / auto-round, nothing from ../shared):

* `write_ct_checkpoint` quantizes a transformers `Qwen3_5MoeForCausalLM` the way llmcompressor's RTN path does
  (docs/formats.md §1, §3, §7): the fused experts are linearized into per-expert `nn.Linear`s (like llmcompressor's
  `linearize_moe` / auto-round's `SequentialQwen3_5MoeExperts`), compressed-tensors' `apply_quantization_config`
  attaches the schemes, each weight's qparams come from compressed-tensors' `calculate_qparams` on per-group min/max
  (the memoryless min-max observer; MX E8M0 scales through the same function), `ModelCompressor.compress_model`
  packs, and `ModelCompressor.update_config` writes `quantization_config` into config.json.
  FP8 KV scales (`self_attn.k_scale` / `v_scale`) are `amax / 448` of K (after k_norm + RoPE) and V, observed through a
  custom attention function on a calibration forward of the dequantized model.
* `ct_dequantized` dequantizes every quantized module with compressed-tensors' own decompressor
  (`BaseCompressor.get_value_from_registry(format).decompress`).
* `ct_reference_model` / `ct_reference_logits` are the float32 oracle: a plain transformers model loaded with those
  dequantized weights (docs/formats.md §8: transformers' own compressed-tensors loading is not a float32 oracle),
  optionally emulating the FP8 KV cache.

Library limitation worked around here: compressed-tensors (0.19 and 0.20) refuses to quantize or dequantize a group
whose columns are not a multiple of `group_size` (e.g. g128 on 64 input features), although the on-disk format
describes it (scale `[out, ceil(K/G)]`, rows packed and cut to `weight_shape`). For those modules the weight is zero
padded to whole groups, run through the same library compressor / decompressor, and cut back (`_compress_padded`,
`_decompress_padded`); with K a multiple of G the library is called unchanged.
A second one: compressed-tensors 0.20.1's int4 unpacking of zero points fails ("view Int as Byte") on a packed zero
point of one row and several groups (int4 asymmetric, <= 8 output rows, K > G); `_dequantize_tensors` hands it the same
values stored column-major. And 0.20.1 no longer recognises transformers 5.24's attention (`past_key_values` renamed
`cache`) as a KV-cache module, so the KV scales are observed here and `kv_cache_scheme` is set on the config directly.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from compressed_tensors.quantization.utils.mxfp_utils import should_generate_mx_scales
from compressed_tensors.utils import get_direct_state_dict, replace_direct_state_dict
from compressed_tensors.utils.match import match_name, match_targets
from loguru import logger
from torch import nn
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5MoeVisionModel
from transformers.activations import ACT2FN
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import eager_attention_forward

from oracles.hf import (
    _fuse_experts,
    _load_dir,
    _write_shards,
    float64_truth,
    hf_logits,
    save_hf,
    tiny_vision_config,
    write_official_layout,
)

FP8_MAX = 448.0  # float8_e4m3fn
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_KV_SCALE_LEAVES = ("k_scale", "v_scale")
_LINEAR_PROBE = nn.Linear(1, 1, bias=False, device="meta")  # class-target probe for model-free matching
_OFFICIAL_PREFIX = "model.language_model."
# Keys of QuantizationArgs that compressed-tensors 0.19 (the fixtures' producer) always serialised; 0.20 omits the
# None/empty ones. Used by recipe["config_style"] == "ct-0.19".
_ARGS_KEYS_019 = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "observer": None,
    "observer_kwargs": {},
    "scale_dtype": None,
    "zp_dtype": None,
}


# --------------------------------------------------------------------------------------------------------------------
# Linearized experts (what llmcompressor's `linearize_moe` / auto-round's SequentialExperts do before quantizing)
# --------------------------------------------------------------------------------------------------------------------


class Qwen3_5MoeExpertMLP(nn.Module):
    """One routed expert as three `nn.Linear`s: `gate_proj [I, H]`, `up_proj [I, H]`, `down_proj [H, I]`."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> None:
        super().__init__()
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w.detach().clone().contiguous(), requires_grad=False)
            setattr(self, name, lin)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SequentialQwen3_5MoeExperts(nn.ModuleList):
    """Drop-in for `Qwen3_5MoeExperts` whose children are `{e}.gate_proj/up_proj/down_proj` (the on-disk names)."""

    def __init__(self, experts: nn.Module, act: str) -> None:
        inter = experts.gate_up_proj.shape[1] // 2
        gate_up, down = experts.gate_up_proj, experts.down_proj
        super().__init__(
            Qwen3_5MoeExpertMLP(gate_up[e, :inter], gate_up[e, inter:], down[e], act) for e in range(gate_up.shape[0])
        )
        self.num_experts = len(self)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            y = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _linearize_experts(model: Qwen3_5MoeForCausalLM) -> None:
    """Replace every layer's fused `mlp.experts` by `SequentialQwen3_5MoeExperts` (in place)."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            layer.mlp.experts = SequentialQwen3_5MoeExperts(experts, model.config.hidden_act)


def per_expert_weights(model: Qwen3_5MoeForCausalLM, *, official_layout: bool = False) -> dict[str, np.ndarray]:
    """The float32 weights of `model` under the on-disk names `write_ct_checkpoint` uses (per-expert 2-D experts)."""
    out: dict[str, np.ndarray] = {}
    prefix = "model.language_model." if official_layout else "model."
    for name, t in model.state_dict().items():
        name = prefix + name[len("model.") :] if name.startswith("model.") else name
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = t.float().numpy()
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight"] = t[e].float().numpy()
            else:
                inter = t.shape[1] // 2
                out[f"{m[1]}.{e}.gate_proj.weight"] = t[e, :inter].float().numpy()
                out[f"{m[1]}.{e}.up_proj.weight"] = t[e, inter:].float().numpy()
    return out


# --------------------------------------------------------------------------------------------------------------------
# Attention hooks (K after k_norm + RoPE, V after v_proj: what a KV cache stores)
# --------------------------------------------------------------------------------------------------------------------

_OBSERVE_ATTN = "qjax_ct_kv_observe"
_FP8_KV_ATTN = "qjax_ct_fp8_kv"


def _observe_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """Record running max|K| / max|V| (per kv head: `[num_kv_heads]`) on the module, then plain eager attention."""
    stats = module.__dict__.setdefault("_qjax_kv_amax", {})
    for tag, x in (("k", key), ("v", value)):
        amax = x.detach().abs().float().amax(dim=(0, 2, 3))  # x: [B, num_kv_heads, T, head_dim]
        stats[tag] = amax if tag not in stats else torch.maximum(stats[tag], amax)
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def fp8_kv_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(x / s).clamp(±448) -> float8_e4m3fn -> float32 * s` (float64 throughout for a float64 `x`, as qjax's float64
    mode quantizes); `scale` is `[1]` (per tensor) or `[num_kv_heads]`."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = scale.to(acc).reshape(1, -1, 1, 1)
    return (x.to(acc) / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(acc) * s


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """Eager attention on K / V fake-quantized to FP8 E4M3 with the module's stored `k_scale` / `v_scale`."""
    k_scale, v_scale = module._qjax_kv_scales
    key = fp8_kv_fake_quant(key, k_scale).to(key.dtype)
    value = fp8_kv_fake_quant(value, v_scale).to(value.dtype)
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _use_attention(model: nn.Module, name: str, fn) -> None:
    """Register `fn` in transformers' attention registries (eager masks) and switch `model` to it."""
    ALL_ATTENTION_FUNCTIONS.register(name, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.config._attn_implementation = name


def _full_attention_layers(cfg: Qwen3_5MoeTextConfig) -> list[int]:
    return [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]


# --------------------------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------------------------


def _recipe_qconfig(recipe: dict[str, Any], scale_dtype: torch.dtype, extra_ignore: list[str]) -> QuantizationConfig:
    """compressed-tensors `QuantizationConfig` for `apply_quantization_config` (group names are redone on save)."""
    groups: dict[str, QuantizationScheme] = {}
    for i, group in enumerate(recipe["groups"]):
        weights = dict(group["weights"])
        if scale_dtype == torch.bfloat16:  # llmcompressor's RTN records its observer (auto-round writes none)
            weights.setdefault("observer", "memoryless_minmax")
        acts = group.get("input_activations")
        groups[f"group_{i}"] = QuantizationScheme(
            targets=list(group["targets"]),
            weights=QuantizationArgs(**weights),
            input_activations=QuantizationArgs(**acts) if acts else None,
            format=group.get("format"),
        )
    return QuantizationConfig(config_groups=groups, ignore=list(recipe.get("ignore", [])) + extra_ignore)


def _group_minmax(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Memoryless min-max observation of a 2-D weight for the args' strategy (a last partial group is allowed)."""
    if args.strategy == QuantizationStrategy.TENSOR:
        return w.amin(), w.amax()
    if args.strategy == QuantizationStrategy.CHANNEL:
        return w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    if args.strategy == QuantizationStrategy.GROUP:
        g = args.group_size
        chunks = [w[:, i : i + g] for i in range(0, w.shape[-1], g)]
        return torch.stack([c.amin(dim=-1) for c in chunks], -1), torch.stack([c.amax(dim=-1) for c in chunks], -1)
    raise NotImplementedError(f"weight strategy {args.strategy}")


def _replace_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if hasattr(module, name):
        delattr(module, name)
    module.register_parameter(name, nn.Parameter(value.contiguous(), requires_grad=False))


@torch.no_grad()
def _calibrate_weight(module: nn.Module, scale_dtype: torch.dtype) -> None:
    """RTN qparams of one module through compressed-tensors' `calculate_qparams` (as llmcompressor's observer)."""
    args: QuantizationArgs = module.quantization_scheme.weights
    mx = should_generate_mx_scales(args)
    w = module.weight.detach()
    # INT scales are computed in the scale dtype (llmcompressor: the bf16 model dtype); MX scales are exact powers of 2.
    observed = w.float() if mx else w.to(scale_dtype)
    lo, hi = _group_minmax(observed, args)
    scale, zp = calculate_qparams(lo, hi, args)
    _replace_param(module, "weight_scale", scale.to(torch.float32 if mx else scale_dtype))
    if hasattr(module, "weight_zero_point"):
        _replace_param(module, "weight_zero_point", zp.to(module.weight_zero_point.dtype).reshape(scale.shape))
    module.quantization_status = QuantizationStatus.FROZEN


def _is_partial_group(args: QuantizationArgs, in_features: int) -> bool:
    return args.strategy == QuantizationStrategy.GROUP and in_features % args.group_size != 0


@torch.no_grad()
def _compress_padded(module: nn.Module) -> None:
    """Compress a pack-quantized module whose in_features is not a multiple of group_size (see module docstring)."""
    scheme: QuantizationScheme = module.quantization_scheme
    if CompressionFormat(scheme.format) != CompressionFormat.pack_quantized:
        raise NotImplementedError(f"partial groups for format {scheme.format}")
    bits, group = scheme.weights.num_bits, scheme.weights.group_size
    state = get_direct_state_dict(module)
    rows, cols = state["weight"].shape
    padded = math.ceil(cols / group) * group
    state["weight"] = nn.functional.pad(state["weight"], (0, padded - cols))
    out = BaseCompressor.get_value_from_registry(scheme.format).compress(state, scheme)
    q = unpack_from_int32(out["weight_packed"], bits, torch.Size([rows, padded]))[:, :cols].contiguous()
    out["weight_packed"] = pack_to_int32(q, bits)
    out["weight_shape"] = torch.tensor([rows, cols])
    replace_direct_state_dict(module, out)
    module.quantization_status = QuantizationStatus.COMPRESSED


def _legacy_args(d: dict[str, Any] | None) -> dict[str, Any] | None:
    if d is None:
        return None
    full = {**_ARGS_KEYS_019, **d}
    if not full["symmetric"] and full["type"] == "int" and full["zp_dtype"] is None:
        full["zp_dtype"] = "torch.int8"  # 0.19 serialised the inferred zero-point dtype of asymmetric args
    return full


def _restyle_config_019(config_path: Path) -> None:
    """Rewrite the quantization_config with every QuantizationArgs key present, as compressed-tensors 0.19 did."""
    cfg = json.loads(config_path.read_text())
    q = cfg["quantization_config"]
    for group in q["config_groups"].values():
        for key in ("weights", "input_activations", "output_activations"):
            group[key] = _legacy_args(group.get(key))
    q["kv_cache_scheme"] = _legacy_args(q.get("kv_cache_scheme"))
    q.pop("moe_sparsity_config", None)
    q["version"] = "0.19.0"
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def write_ct_checkpoint(
    model: Qwen3_5MoeForCausalLM,
    out_dir: str | Path,
    recipe: dict[str, Any],
    *,
    official_layout: bool = False,
    calib_ids: np.ndarray | None = None,
) -> str:
    """Quantize `model` (not modified) with compressed-tensors and write a compressed-tensors checkpoint folder.

    recipe keys:
      groups: list of {"targets": [...], "weights": QuantizationArgs fields, optional "format",
              optional "input_activations"}; compressed-tensors' precedence (exact name, then "re:", then class
              "Linear"); the written config renames them group_0.. in module order.
      ignore: names / "re:" patterns (on-disk names) left unquantized.
      kv_cache: None | {"strategy": "tensor" | "attn_head", optional "dtype": "bfloat16" | "float32"} -> FP8 KV
              scales (per tensor: [1], default dtype bf16 with bf16 weight scales (llmcompressor) else f32
              (auto-round); attn_head: [num_kv_heads] f32 (auto-round)).
      scale_dtype: "bfloat16" (llmcompressor, default) | "float16" (auto-round) for INT weight scales.
      config_style: "ct" (default: compressed-tensors' own serialisation) | "ct-0.19" (every args key, zp_dtype of
              asymmetric args, no moe_sparsity_config, version "0.19.0": as the fixtures' compressed-tensors 0.19).
      official_layout only: visual (default True), mtp (default True), mtp_fused (default False), shards (default 1).
    Unquantized tensors keep the model dtype. `calib_ids` ([B, T] ints) feed the KV calibration forward; random
    (seeded) ids when None. Returns `str(out_dir)`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scale_dtype = _DTYPES[recipe.get("scale_dtype", "bfloat16")]
    kv = recipe.get("kv_cache")
    text_cfg = copy.deepcopy(model.config)

    work = copy.deepcopy(model).eval()
    _linearize_experts(work)
    root = nn.Module()
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_ignore: list[str] = []
    if official_layout:
        with tempfile.TemporaryDirectory() as tmp:
            src = save_hf(model, Path(tmp) / "src")
            dst = write_official_layout(
                src,
                Path(tmp) / "dst",
                with_visual=recipe.get("visual", True),
                with_mtp=recipe.get("mtp", True),
                mtp_fused=recipe.get("mtp_fused", False),
                shards=1,
            )
            config = json.loads((Path(dst) / "config.json").read_text())
            config["dtype"] = config["text_config"].get("dtype")  # top-level keys of a transformers save
            config["transformers_version"] = transformers.__version__
            aux = {k: v for k, v in _load_dir(Path(dst)).items() if k.startswith(("model.visual.", "mtp."))}
        root.model = nn.Module()
        if recipe.get("visual", True):
            # A real vision tower in the module tree, so its Linears land in `ignore` as llmcompressor writes them.
            visual = Qwen3_5MoeVisionModel(tiny_vision_config(out_hidden_size=text_cfg.hidden_size))
            vis = "model.visual."
            visual.load_state_dict({k.removeprefix(vis): v for k, v in aux.items() if k.startswith(vis)})
            root.model.visual = visual.to(next(model.parameters()).dtype).eval()
            extra_ignore.append(r"re:^model\.visual\.")
        root.model.language_model = work.model
        extra_tensors = {k: v for k, v in aux.items() if k.startswith("mtp.")}  # outside the producer's module tree
    else:
        root.model = work.model
        config = json.loads(text_cfg.to_json_string())  # what `save_pretrained` writes
        config["architectures"] = ["Qwen3_5MoeForCausalLM"]
    root.lm_head = work.lm_head
    text_prefix = _OFFICIAL_PREFIX if official_layout else "model."

    # 1. schemes onto the modules (compressed-tensors matching of targets / ignore)
    logger.disable("compressed_tensors")  # per-module warnings about the partial groups handled below
    try:
        apply_quantization_config(root, _recipe_qconfig(recipe, scale_dtype, extra_ignore), show_progress=False)
    finally:
        logger.enable("compressed_tensors")
    quantized = [m for _, m in root.named_modules() if is_module_quantized(m)]
    if not quantized:
        raise ValueError("recipe quantizes no module")
    # 2. RTN qparams (memoryless min-max -> calculate_qparams)
    for module in quantized:
        _calibrate_weight(module, scale_dtype)
    # 3. config from the model (group_0.. in module order, explicit ignore names), formats, then compression
    compressor = ModelCompressor.from_pretrained_model(root)
    for module in quantized:
        if _is_partial_group(module.quantization_scheme.weights, module.weight.shape[-1]):
            _compress_padded(module)
    compressor.compress_model(root, skip_compressed=True)
    tensors = {k: v.detach().contiguous() for k, v in root.state_dict().items()}
    if getattr(text_cfg, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    qconfig = compressor.quantization_config

    # 4. FP8 KV scales observed on the dequantized model
    if kv is not None:
        strategy = kv.get("strategy", "tensor")
        kv_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False)
        qconfig.kv_cache_scheme = kv_args
        if strategy == "attn_head":
            kv_dtype = torch.float32
        else:
            kv_dtype = _DTYPES[kv.get("dtype", "bfloat16" if scale_dtype == torch.bfloat16 else "float32")]
        ref = _reference_from_tensors(text_cfg, tensors, qconfig)
        if calib_ids is None:
            calib_ids = np.random.default_rng(1234).integers(0, text_cfg.vocab_size, (2, 32))
        _use_attention(ref, _OBSERVE_ATTN, _observe_kv_attention)
        hf_logits(ref, calib_ids)
        for i in _full_attention_layers(text_cfg):
            stats = ref.model.layers[i].self_attn._qjax_kv_amax
            for tag in ("k", "v"):
                amax = stats[tag] if strategy == "attn_head" else stats[tag].amax()
                scale, _ = calculate_qparams(-amax, amax, kv_args)  # FP8 symmetric: amax / 448
                tensors[f"{text_prefix}layers.{i}.self_attn.{tag}_scale"] = scale.reshape(-1).to(kv_dtype)

    # 5. files: safetensors (+ index), config.json (+ quantization_config by compressed-tensors), generation_config
    tensors.update(extra_tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    compressor.update_config(str(out))
    if recipe.get("config_style", "ct") == "ct-0.19":
        _restyle_config_019(out / "config.json")
    _write_shards(tensors, out, recipe.get("shards", 1) if official_layout else 1)
    model.generation_config.to_json_file(out / "generation_config.json")
    return str(out)


# --------------------------------------------------------------------------------------------------------------------
# Reader / oracle
# --------------------------------------------------------------------------------------------------------------------


def _read_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    folder = Path(folder)
    return json.loads((folder / "config.json").read_text()), _load_dir(folder)


def _quantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Modules the tensors say are quantized: `.weight_packed`, or an F8 `.weight` with a `.weight_scale`."""
    mods = set()
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            mods.add(module)
        elif leaf == "weight" and t.dtype == torch.float8_e4m3fn and f"{module}.weight_scale" in tensors:
            mods.add(module)
    return sorted(mods)


def _scheme_for(module: str, qconfig: QuantizationConfig) -> tuple[QuantizationScheme, str]:
    """The config group compressed-tensors' `apply_quantization_config` would pick for `module`, and its format.

    Same precedence as the library (`match_targets`): exact name, then `re:` patterns, then the class `Linear`
    (every module holding quantized tensors is a Linear); a target repeated in a later group belongs to that group.
    """
    if any(match_name(module, ign) for ign in qconfig.ignore or []):
        raise ValueError(f"{module} holds quantized tensors but is listed in ignore")
    target_to_scheme = {t: s for s in qconfig.config_groups.values() for t in s.targets}
    matched = match_targets(module, _LINEAR_PROBE, list(target_to_scheme))
    if not matched:
        raise ValueError(f"{module} holds quantized tensors but no config group targets it")
    scheme = target_to_scheme[matched[0]]
    fmt = scheme.format
    if fmt is None and qconfig.format not in (None, CompressionFormat.mixed_precision.value, "dense"):
        fmt = qconfig.format
    if fmt is None:
        fmt = infer_module_format(nn.Linear, scheme)
    return scheme, CompressionFormat(fmt).value


@torch.no_grad()
def _decompress_padded(compressor, state: dict[str, torch.Tensor], scheme: QuantizationScheme) -> torch.Tensor:
    """Library decompression of a partial last group: re-pack the rows padded to whole groups, decompress, cut."""
    bits, group = scheme.weights.num_bits, scheme.weights.group_size
    rows, cols = (int(x) for x in state["weight_shape"])
    padded = math.ceil(cols / group) * group
    q = unpack_from_int32(state["weight_packed"], bits, torch.Size([rows, cols]))
    state = dict(state)
    state["weight_packed"] = pack_to_int32(nn.functional.pad(q, (0, padded - cols)), bits)
    state["weight_shape"] = torch.tensor([rows, padded])
    return compressor.decompress(state, scheme)["weight"][:, :cols]


@torch.no_grad()
def _dequantize_tensors(tensors: dict[str, torch.Tensor], qconfig: QuantizationConfig) -> dict[str, torch.Tensor]:
    """module name -> weight dequantized by compressed-tensors, in the library's output dtype (bf16 / fp16)."""
    out: dict[str, torch.Tensor] = {}
    for module in _quantized_modules(tensors):
        scheme, fmt = _scheme_for(module, qconfig)
        compressor = BaseCompressor.get_value_from_registry(fmt)
        state = {p: tensors[f"{module}.{p}"] for p in compressor.compression_param_names(scheme)}
        if "weight_zero_point" in state:
            # Same values, stored column-major: compressed-tensors 0.20.1 unpacks zero points (packed_dim=0) by
            # transposing, and its int4 fast path then fails on a [1, G>1] zero point (`.contiguous()` keeps the
            # transposed [G, 1] view whose stride(-1) is G; "view Int as Byte" error), e.g. a 6-row in_proj_a.
            zp = state["weight_zero_point"]
            state["weight_zero_point"] = torch.empty_strided(zp.shape, (1, zp.shape[0]), dtype=zp.dtype).copy_(zp)
        cols = int(state["weight_shape"][-1]) if "weight_shape" in state else state["weight"].shape[-1]
        if fmt == CompressionFormat.pack_quantized.value and _is_partial_group(scheme.weights, cols):
            out[module] = _decompress_padded(compressor, state, scheme)
        else:
            out[module] = compressor.decompress(state, scheme)["weight"]
    return out


def ct_dequantized(folder: str | Path) -> dict[str, np.ndarray]:
    """`{module + ".weight": float32 array}` for every quantized module, via compressed-tensors' decompressors."""
    config, tensors = _read_folder(folder)
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    return {f"{m}.weight": w.float().numpy() for m, w in _dequantize_tensors(tensors, qconfig).items()}


def _text_config(config: dict[str, Any]) -> Qwen3_5MoeTextConfig:
    text = dict(config.get("text_config", config))
    for key in ("quantization_config", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype"):
        text.pop(key, None)
    cfg = Qwen3_5MoeTextConfig(**text)
    cfg._attn_implementation = "eager"
    return cfg


def _reference_from_tensors(
    cfg: Qwen3_5MoeTextConfig, tensors: dict[str, torch.Tensor], qconfig: QuantizationConfig
) -> Qwen3_5MoeForCausalLM:
    """Plain float32 transformers model: dequantized weights (experts re-fused), every other text tensor upcast."""
    deq = _dequantize_tensors(tensors, qconfig)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if name.startswith(("model.visual.", "mtp.")) or leaf in _KV_SCALE_LEAVES or module in deq:
            continue
        state[name] = t.float()
    state.update({f"{m}.weight": w.float() for m, w in deq.items()})
    state = {
        ("model." + k.removeprefix(_OFFICIAL_PREFIX) if k.startswith(_OFFICIAL_PREFIX) else k): v
        for k, v in state.items()
    }
    state = _fuse_experts(state)
    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    if "lm_head.weight" not in state and cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def ct_reference_model(folder: str | Path) -> Qwen3_5MoeForCausalLM:
    """float32 `Qwen3_5MoeForCausalLM` (eager attention) with the checkpoint's weights dequantized by
    compressed-tensors (experts re-fused), every other text tensor as stored, upcast."""
    config, tensors = _read_folder(folder)
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    return _reference_from_tensors(_text_config(config), tensors, qconfig)


def kv_scales(folder: str | Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`{layer: (k_scale, v_scale)}` (float32, `[1]` or `[num_kv_heads]`) of a checkpoint's FP8 KV cache."""
    _, tensors = _read_folder(folder)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = re.match(r"^(?:model\.language_model\.|model\.)layers\.(\d+)\.self_attn\.(k|v)_scale$", name)
        if m:
            out.setdefault(int(m[1]), {})[m[2]] = t.float()
    return {i: (d["k"], d["v"]) for i, d in sorted(out.items())}


def ct_reference_logits(folder: str | Path, ids: np.ndarray, *, fp8_kv: bool = False,
                        float64: bool = False) -> np.ndarray:
    """Full-sequence float32 logits `[B, T, V]` of `ct_reference_model(folder)` (with `float64`: float64 logits of its
    `float64_truth` copy).

    With `fp8_kv`, K (after k_norm + RoPE) and V of every full-attention layer go through `fp8_kv_fake_quant` with the
    stored per-tensor / per-kv-head scales before eager attention (custom function in ALL_ATTENTION_FUNCTIONS).
    """
    model = ct_reference_model(folder)
    if float64:
        model = float64_truth(model)
    if fp8_kv:
        scales = kv_scales(folder)
        layers = _full_attention_layers(model.config)
        if sorted(scales) != layers:
            raise ValueError(f"KV scales for layers {sorted(scales)}, full-attention layers are {layers}")
        for i, pair in scales.items():
            model.model.layers[i].self_attn._qjax_kv_scales = pair
        _use_attention(model, _FP8_KV_ATTN, _fp8_kv_attention)
    return hf_logits(model, ids)


# ---------------------------------------------------------------------------------------------------------------------
# the recipes the tests write (llmcompressor-style config groups; conftest's ``ct_ckpt`` writes one folder each)
# ---------------------------------------------------------------------------------------------------------------------
EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]


def int_weights(bits, strategy="group", group=None, symmetric=True):
    """The ``weights`` entry of an INT config group."""
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group}


def _int_recipe(weights, *, kv=None, scale_dtype="bfloat16"):
    return {"groups": [{"targets": ["Linear"], "format": "pack-quantized", "weights": weights}], "ignore": IGNORE,
            "kv_cache": kv, "scale_dtype": scale_dtype}


MXFP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}
RECIPES = {
    "int4_sym_g128": _int_recipe(int_weights(4, group=128)),
    "int4_asym_g32": _int_recipe(int_weights(4, group=32, symmetric=False)),
    "int8_g32_f16_scales": _int_recipe(int_weights(8, group=32), scale_dtype="float16"),
    "int8_channel": _int_recipe(int_weights(8, strategy="channel")),
    "int2_asym_channel": _int_recipe(int_weights(2, strategy="channel", symmetric=False)),
    "w2_experts_w4_rest": {"groups": [
        {"targets": [EXPERTS], "format": "pack-quantized", "weights": int_weights(2, group=64)},
        {"targets": ["Linear"], "format": "pack-quantized", "weights": int_weights(4, group=128)}],
        "ignore": IGNORE, "kv_cache": None},
    "mxfp8_experts_kv_tensor": {"groups": [{"targets": [EXPERTS], "format": "mxfp8-quantized", "weights": MXFP8}],
                                "ignore": IGNORE, "kv_cache": {"strategy": "tensor"}},
    "int4_asym_kv_head": _int_recipe(int_weights(4, group=32, symmetric=False), kv={"strategy": "attn_head"}),
}


def ct_vl_reference_logits(folder: str | Path, input_ids: np.ndarray, pixel_values: torch.Tensor,
                           image_grid_thw: torch.Tensor) -> np.ndarray:
    """float32 logits `[B, T, V]` of a compressed-tensors VL checkpoint with images, built from independent parts:
    `ct_reference_model`'s text model (compressed-tensors' decompression), transformers' `Qwen3_5MoeVisionModel` with
    the folder's `model.visual.*` tensors (upcast), the features scattered at the image tokens and transformers'
    `get_rope_index` positions — what `Qwen3_5MoeForConditionalGeneration` does, without its quantized loading
    (transformers 5.24 mis-loads pack-quantized experts of this layout)."""
    import types

    from transformers import Qwen3_5MoeModel, Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel

    config, tensors = _read_folder(folder)
    text = ct_reference_model(folder)
    vcfg = Qwen3_5MoeVisionConfig(**{k: v for k, v in config["vision_config"].items() if k != "model_type"})
    vcfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        tower = Qwen3_5MoeVisionModel(vcfg).float().eval()
    tower.load_state_dict({k.removeprefix("model.visual."): t.float() for k, t in tensors.items()
                           if k.startswith("model.visual.")}, strict=True)
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    image = ids == config["image_token_id"]
    owner = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vcfg),
                                  get_vision_position_ids=lambda *a, **k: Qwen3_5MoeModel.get_vision_position_ids(
                                      None, *a, **k))
    with torch.no_grad():
        features = tower(pixel_values.float(), grid_thw=image_grid_thw).pooler_output
        embeds = text.model.embed_tokens(ids)
        embeds[image] = features.to(embeds.dtype)
        positions, _ = Qwen3_5MoeModel.get_rope_index(owner, ids, image.int(), image_grid_thw)
        return text(inputs_embeds=embeds, position_ids=positions, use_cache=False).logits.float().numpy()
