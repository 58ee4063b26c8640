"""Test oracle: tiny random Qwen3.5/3.6-MoE models built with transformers (the reference implementation).

Everything here is generated at test time (no downloaded weights, nothing from ../shared): a text config, a seeded
`Qwen3_5MoeForCausalLM` with perturbed norms, its per-expert `save_pretrained` folder, a rewrite of that folder into
the official Qwen3.6 on-disk layout (composite config, fused experts, `model.visual.*`, `mtp.*`, sharded), and
helpers that run the transformers model on numpy inputs.

The float64 truth (`float64_truth`): the same transformers model in float64 *everywhere*. transformers' code pins
float32 in RoPE, the norms, the delta rule and both softmaxes, so a plain `.to(torch.float64)` is still 1e-6 to 1e-5 off
the float64 result; `qjax.evaluation.torch_reference.float64_everywhere` (a TorchFunctionMode, strict: it fails if any
op still returns a narrower float) promotes those requests, and the routed experts run transformers' eager loop.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeVisionConfig,
    Qwen3_5MoeVisionModel,
)

from qjax.evaluation.torch_reference import float64_everywhere

# Stddev of the seeded noise put on norm offsets and dt_bias: large enough that a (1 + w) vs w mistake, or a missing
# dt_bias, moves the logits by far more than the 1e-4 parity tolerance.
NORM_NOISE_STD = 0.3
# Stddev of the random tensors invented for `mtp.*` and `model.visual.*`.
RANDOM_STD = 0.1
# |qjax − transformers| logits in float32 where no truth is computed (the MTP head, composed by hand; a child process
# with other XLA flags; images): each side's error against the truth is ≤ 6e-5 (qjax) and ≤ 1.8e-4 (transformers) on
# these configs, so their difference is below 2.4e-4
FLOAT32_PARITY_TOL = 2.4e-4

LIN, FULL = "linear_attention", "full_attention"


# The tiny config alternates [GDN, full] (Qwen3.6's own pattern, [GDN, GDN, GDN, full], is the odd config's and the
# built-in model's): every compiled program traces one layer group, so a group of two layers halves what each of the
# suite's ~400 model programs traces and compiles (measured: prefill 2.1 → 0.9 s, model(ids) 1.5 → 0.7 s), while four
# layers still scan over two groups.
TINY_FULL_INTERVAL = 2


def _layer_pattern(num_layers: int, interval: int = TINY_FULL_INTERVAL) -> list[str]:
    """``interval - 1`` linear-attention layers then one full-attention layer, repeated (full attention last)."""
    return [FULL if (i + 1) % interval == 0 else LIN for i in range(num_layers)]


def _apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Replace keys; merge `rope_parameters`; keep `layer_types` in step with an overridden layer count."""
    overrides = dict(overrides)
    if "rope_parameters" in overrides:
        cfg["rope_parameters"] = {**cfg["rope_parameters"], **overrides.pop("rope_parameters")}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        cfg["layer_types"] = _layer_pattern(overrides["num_hidden_layers"])
    cfg.update(overrides)
    return cfg


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """config.json dict of the tiny `qwen3_5_moe_text` test model (docs/model.md §1.1)."""
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": _layer_pattern(4),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,  # head_dim 32 -> rotary dim 8 -> 4 frequencies = sum(mrope_section)
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    return _apply_overrides(cfg, overrides)


def odd_text_config(**overrides: Any) -> dict[str, Any]:
    """A second text config: q:kv 3:1, linear qk:v 1:2 with k_dim != v_dim, odd sizes, 8 layers (pattern ×2).

    Catches code that silently assumes the tiny config's square/power-of-two shapes (head_dim == linear dims,
    q:kv == 2, top-2, vocab a multiple of 64, ...).
    """
    cfg = tiny_text_config(
        vocab_size=389,
        hidden_size=72,
        num_hidden_layers=8,
        layer_types=_layer_pattern(8, interval=4),
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        linear_num_key_heads=3,
        linear_num_value_heads=6,
        linear_key_head_dim=12,
        linear_value_head_dim=20,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=24,
        # head_dim 24 * 0.25 -> rotary dim 6 -> 3 frequencies, one per (T, H, W) section
        rope_parameters={"mrope_section": [1, 1, 1]},
        # 8 layers at 0.1 put the random net in a chaotic regime where fp32 rounding alone moves logits by 2-4e-4
        # (full forward vs token-by-token decode in transformers itself); at 0.05 that is ~1.5e-5, well inside the
        # 1e-4 parity tolerance, while the perturbed norms still make (1 + w) mistakes obvious.
        initializer_range=0.05,
    )
    return _apply_overrides(cfg, overrides)


def make_hf_model(
    config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Qwen3_5MoeForCausalLM:
    """Seeded random `Qwen3_5MoeForCausalLM` in eval mode with every norm weight, `dt_bias` and `A_log` randomised.

    transformers initialises the zero-centred RMSNorms to 0 and dt_bias to 1; left like that, a (1 + w) vs w
    mistake or a dropped dt_bias would be invisible, so all of them get seeded noise.
    """
    hf_config = Qwen3_5MoeTextConfig(**config)
    # Eager attention: a plain matmul/softmax reference, free of sdpa backend choices (sdpa agrees within 1e-5).
    hf_config._attn_implementation = "eager"
    # fork_rng keeps the caller's global torch RNG untouched while still making construction deterministic.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForCausalLM(hf_config)
        gen = torch.Generator().manual_seed(seed + 7919)
        with torch.no_grad():
            for name, param in model.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                # Qwen3_5MoeRMSNorm weights (input/post_attention/final/q_norm/k_norm) are offsets around 0; the GDN
                # gated norm `linear_attn.norm.weight` is a plain weight around 1: noise both the same way.
                if name.endswith("norm.weight") or leaf == "dt_bias":
                    # standardised, so that even a 4-head dt_bias moves by NORM_NOISE_STD (four plain draws can
                    # all land within ±0.1 of 1)
                    noise = torch.randn(param.shape, generator=gen)
                    param.add_((noise - noise.mean()) / noise.std() * NORM_NOISE_STD)
                elif leaf == "A_log":
                    # Same range as transformers' init (A in [0.01, 16]), drawn here so it never depends on init.
                    param.copy_(torch.empty(param.shape).uniform_(0.01, 16, generator=gen).log())
    return model.to(dtype).eval()


def save_hf(model: torch.nn.Module, path: str | Path) -> str:
    """`save_pretrained` into `path` + a generation_config.json; returns `str(path)`.

    transformers writes per-expert keys `model.layers.L.mlp.experts.{e}.{gate,up,down}_proj.weight`.
    """
    path = Path(path)
    # transformers 5 always writes safetensors (the `safe_serialization` argument no longer exists).
    model.save_pretrained(path)
    gen_cfg = path / "generation_config.json"
    if not gen_cfg.exists():
        model.generation_config.to_json_file(gen_cfg)
    return str(path)


# --------------------------------------------------------------------------------------------------------------------
# Official Qwen3.6 on-disk layout
# --------------------------------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _load_dir(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors folder."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert 2-D weights -> `experts.gate_up_proj [E, 2I, H]` (gate rows first), `experts.down_proj [E, H, I]`."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for prefix, projs in groups.items():
        n = len(projs["gate_proj"])
        assert sorted(projs["gate_proj"]) == list(range(n)), f"missing experts under {prefix}"
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
    return out


def _split_experts(prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `_fuse_experts` for one expert block."""
    inter = gate_up.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
        out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
        out[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    return out


def tiny_vision_config(out_hidden_size: int) -> Qwen3_5MoeVisionConfig:
    """A 2-block vision tower small enough to be free: 32 wide, 4x4 patches, 4x4 learned position grid."""
    return Qwen3_5MoeVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,
    )


def _random_like(
    shapes: dict[str, tuple[int, ...]], gen: torch.Generator, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Random tensors for the given names: norms around their identity value, everything else N(0, RANDOM_STD)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        if re.search(r"norm[^.]*\.weight$", name):
            # Zero-centred (1 + w) RMSNorms (mtp.*) store offsets; LayerNorms (visual) store plain weights around 1.
            t = t * NORM_NOISE_STD + (1.0 if name.startswith("model.visual.") else 0.0)
        else:
            t = t * RANDOM_STD
        out[name] = t.to(dtype).contiguous()
    return out


def _mtp_shapes(text: dict[str, Any], fused: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the 1-layer MTP head (docs/model.md §6.3): fc + 3 norms + a full-attention MoE decoder
    layer."""
    h, hd = text["hidden_size"], text["head_dim"]
    nq, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    n_exp, inter, shared = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    layer = "mtp.layers.0"
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        f"{layer}.input_layernorm.weight": (h,),
        f"{layer}.post_attention_layernorm.weight": (h,),
        f"{layer}.self_attn.q_proj.weight": (2 * nq * hd, h),  # query and output gate interleaved per head
        f"{layer}.self_attn.k_proj.weight": (nkv * hd, h),
        f"{layer}.self_attn.v_proj.weight": (nkv * hd, h),
        f"{layer}.self_attn.o_proj.weight": (h, nq * hd),
        f"{layer}.self_attn.q_norm.weight": (hd,),
        f"{layer}.self_attn.k_norm.weight": (hd,),
        f"{layer}.mlp.gate.weight": (n_exp, h),
        f"{layer}.mlp.shared_expert.gate_proj.weight": (shared, h),
        f"{layer}.mlp.shared_expert.up_proj.weight": (shared, h),
        f"{layer}.mlp.shared_expert.down_proj.weight": (h, shared),
        f"{layer}.mlp.shared_expert_gate.weight": (1, h),
    }
    if fused:
        shapes[f"{layer}.mlp.experts.gate_up_proj"] = (n_exp, 2 * inter, h)
        shapes[f"{layer}.mlp.experts.down_proj"] = (n_exp, h, inter)
    else:
        for e in range(n_exp):
            shapes[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = (inter, h)
            shapes[f"{layer}.mlp.experts.{e}.up_proj.weight"] = (inter, h)
            shapes[f"{layer}.mlp.experts.{e}.down_proj.weight"] = (h, inter)
    return shapes


def _write_shards(tensors: dict[str, torch.Tensor], dst: Path, shards: int) -> None:
    """Write `model.safetensors` (shards == 1) or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.

    Tensors are cut by cumulative size in key order, so one layer's tensors can straddle two files (as in real
    releases) and a loader has to go through the index.
    """
    names = sorted(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    if shards <= 1:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    if shards > len(names):
        raise ValueError(f"cannot cut {len(names)} tensors into {shards} shards")
    # Greedy cut at multiples of total / shards, forcing at least one tensor per shard.
    bounds, acc, start = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left_shards = shards - 1 - len(bounds)
        if left_shards and (acc >= total * (len(bounds) + 1) / shards or len(names) - (i + 1) == left_shards):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(names)))
    assert len(bounds) == shards
    weight_map: dict[str, str] = {}
    for k, (lo, hi) in enumerate(bounds):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[lo:hi]}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names[lo:hi]})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_official_layout(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    seed: int = 1,
    with_visual: bool = True,
    with_mtp: bool = True,
    mtp_fused: bool = True,
    shards: int = 2,
) -> str:
    """Rewrite a `save_hf` folder into the official Qwen3.6-35B-A3B layout (docs/model.md §6.1, §6.3).

    Composite `qwen3_5_moe` config; text weights under `model.language_model.*` with fused experts
    (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, no `.weight`); `lm_head.weight` at top level; random
    `model.visual.*` (a 2-block tower) and `mtp.*` (fused or per-expert experts); `shards` safetensors files + index.
    The text weights are copied bit for bit, so transformers gives the same logits as from `src_dir`.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    text = json.loads((src / "config.json").read_text())
    if "text_config" in text:  # already composite
        text = text["text_config"]
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "qwen3_5_moe_text"
    # Fields the official text_config carries that transformers does not use (docs/model.md §1.1); a loader may read
    # them.
    text.update(
        mtp_num_hidden_layers=1 if with_mtp else 0,
        mtp_use_dedicated_embeddings=False,
        mamba_ssm_dtype="float32",
        attn_output_gate=True,
    )

    source = _load_dir(src)
    dtype = source["lm_head.weight"].dtype
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _fuse_experts(source).items():
        if name.startswith("model.language_model.") or not name.startswith("model."):
            tensors[name] = t  # already prefixed, or lm_head
        else:
            tensors["model.language_model." + name[len("model.") :]] = t

    gen = torch.Generator().manual_seed(seed)
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        # In-vocab ids for the tiny models (official: 248056/248057/248053/248054); text-only forwards ignore them.
        "image_token_id": text["vocab_size"] - 12,
        "video_token_id": text["vocab_size"] - 11,
        "vision_start_token_id": text["vocab_size"] - 10,
        "vision_end_token_id": text["vocab_size"] - 9,
        "tie_word_embeddings": False,
    }
    # transformers' ForConditionalGeneration always builds a vision tower, so the config has one even without weights.
    vision_cfg = tiny_vision_config(out_hidden_size=text["hidden_size"])
    config["vision_config"] = vision_cfg.to_dict()
    if with_visual:
        # Names/shapes come from transformers' own vision module so they match whatever ForConditionalGeneration builds.
        with torch.device("meta"):
            vision = Qwen3_5MoeVisionModel(vision_cfg)
        shapes = {f"model.visual.{n}": tuple(p.shape) for n, p in vision.state_dict().items()}
        tensors.update(_random_like(shapes, gen, dtype))
    if with_mtp:
        tensors.update(_random_like(_mtp_shapes(text, fused=mtp_fused), gen, dtype))

    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_shards(tensors, dst, shards)
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copyfile(src / extra, dst / extra)
    return str(dst)


# --------------------------------------------------------------------------------------------------------------------
# Running the oracle
# --------------------------------------------------------------------------------------------------------------------


INPUT_KINDS = ("two_chunks", "left_padded", "mrope_3d")


def input_case(kind: str, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(ids, attention_mask, position_ids) of one input kind: T = 90 over two GDN chunks, a left-padded batch (explicit
    positions, as transformers' plain forward does not count them from the mask), or 3-row M-RoPE positions (T, H, W
    rows that differ, as for an image grid: catches chunked-vs-interleaved sections)."""
    rng = np.random.default_rng(seed)
    if kind == "two_chunks":
        return rng.integers(0, vocab, (2, 90)).astype(np.int32), None, None
    if kind == "left_padded":
        ids = rng.integers(0, vocab, (3, 70)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[0, :9] = 0
        mask[2, :40] = 0
        return ids, mask, np.broadcast_to(np.arange(70), ids.shape).astype(np.int32).copy()
    if kind != "mrope_3d":
        raise ValueError(f"unknown input kind {kind!r}")
    ids = rng.integers(0, vocab, (2, 77)).astype(np.int32)
    pos = np.stack([np.sort(rng.integers(0, 120, (2, 77)), axis=1) for _ in range(3)]).astype(np.int32)
    return ids, None, pos


def _as_long(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.long)


def hf_logits(model: torch.nn.Module, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
              position_ids: np.ndarray | None = None) -> np.ndarray:
    """Full-sequence logits `[B, T, V]` (no cache, no grad) as numpy in the model's dtype: float32, or float64 for a
    `float64_truth` model (run under `float64_everywhere`, strict)."""
    mask = None if attention_mask is None else _as_long(attention_mask)
    pos = None if position_ids is None else _as_long(position_ids)
    wide = next(model.parameters()).dtype == torch.float64
    with torch.no_grad(), (float64_everywhere(strict=True) if wide else contextlib.nullcontext()):
        out = model(input_ids=_as_long(input_ids), attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits.double().numpy() if wide else out.logits.float().numpy()


def float64_truth(model: torch.nn.Module) -> torch.nn.Module:
    """A float64-everywhere copy of `model` (module docstring): built under `float64_everywhere` so its RoPE inverse
    frequencies are computed in float64, eager experts, the same weights exactly (float32 → float64)."""
    config = copy.deepcopy(model.config)
    config._experts_implementation = "eager"  # torch's grouped_mm has no float64
    with torch.random.fork_rng(devices=[]), float64_everywhere():
        truth = Qwen3_5MoeForCausalLM(config).to(torch.float64)
    truth.load_state_dict({k: v.to(torch.float64) for k, v in model.state_dict().items()})
    return truth.eval()


def hf_generate_greedy(
    model: torch.nn.Module,
    input_ids: np.ndarray,
    max_new_tokens: int,
    attention_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Greedy `generate`: the full sequences `[B, T + max_new_tokens]` (prompt included) as int64 numpy.

    Stops early only if the model's generation_config has an eos id (the tiny configs have none).
    """
    ids = _as_long(input_ids)
    mask = torch.ones_like(ids) if attention_mask is None else _as_long(attention_mask)
    gen_cfg = model.generation_config
    eos = gen_cfg.eos_token_id
    pad = gen_cfg.pad_token_id
    if pad is None:  # set explicitly so generate neither warns nor guesses; only used after a row hits eos
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    with torch.no_grad():
        seqs = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return seqs.numpy()


# --------------------------------------------------------------------------------------------------------------------
# A tiny vision-language checkpoint with a tokenizer (image prompts end to end)
# --------------------------------------------------------------------------------------------------------------------

# preprocessor_config.json of the tiny VL checkpoint: the tiny tower's 4-pixel patches, and pixel bounds that keep an
# image at 4..64 merged tokens (16×16 .. 64×64 pixels) so that image prompts fit the 512-position tiny text model
VL_PREPROCESSOR = {"size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}, "patch_size": 4,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"}
# the tiny VL tokenizer: words w0..w487 plus the chat and vision special tokens at the ids write_official_layout
# gives the vision tokens (vocab − 12 … vocab − 9)
VL_SPECIALS = {"<|image_pad|>": 500, "<|video_pad|>": 501, "<|vision_start|>": 502, "<|vision_end|>": 503,
               "<|im_start|>": 504, "<|im_end|>": 505, "<|endoftext|>": 506}
VL_WORDS = [f"w{i}" for i in range(488)] + ["user", "assistant", "system", "Describe", "this", "image.", "[UNK]"]


def write_vl_tokenizer(folder: str | Path) -> None:
    """A word-level tokenizer (whitespace split) over `VL_WORDS` with `VL_SPECIALS`: ids 0..506 of the 512 vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(VL_WORDS)}
    vocab.update(VL_SPECIALS)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]",
                            additional_special_tokens=list(VL_SPECIALS)).save_pretrained(str(folder))


def write_vl_checkpoint(dst: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                        workdir: str | Path | None = None, with_mtp: bool = False) -> str:
    """A tiny `Qwen3_5MoeForConditionalGeneration` folder: the tiny text model (seeded) in the official composite
    layout with a random 2-block vision tower (`tiny_vision_config`), its `VL_PREPROCESSOR`, a tokenizer
    (`write_vl_tokenizer`) and a generation_config stopping at `<|im_end|>`. `dtype`: the stored dtype of every
    tensor (the tower included); `with_mtp`: also a random MTP head (fused experts), as the releases have."""
    dst = Path(dst)
    work = Path(workdir) if workdir is not None else dst.parent / (dst.name + "-text")
    save_hf(make_hf_model(tiny_text_config(), seed=seed).to(dtype), work)
    write_official_layout(work, dst, seed=seed + 1, with_mtp=with_mtp, shards=1)
    (dst / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR, indent=2) + "\n")
    write_vl_tokenizer(dst)
    (dst / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [VL_SPECIALS["<|im_end|>"]], "pad_token_id": VL_SPECIALS["<|endoftext|>"],
         "do_sample": False}) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return str(dst)


def random_image(height: int, width: int, seed: int = 0, mode: str = "RGB"):
    """A seeded random Pillow image (smooth enough that resizing is not pure noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 4), max(1, width // 4), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    return img.convert(mode)


def hf_vl_model(folder: str | Path) -> torch.nn.Module:
    """transformers' `Qwen3_5MoeForConditionalGeneration` of a VL folder, float32, eval (the reference)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


def hf_vl_inputs(folder: str | Path, images, input_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """transformers' model inputs for expanded `input_ids [B, T]` and `images`: pixel values and grids from its own
    image processor (the folder's preprocessor_config.json), `mm_token_type_ids` marking the image tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((Path(folder) / "config.json").read_text())
    pp = {k: v for k, v in VL_PREPROCESSOR.items() if k != "image_processor_type"}
    processed = Qwen2VLImageProcessorPil(**pp)(list(images), return_tensors="pt")
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    return {"input_ids": ids, "pixel_values": processed["pixel_values"],
            "image_grid_thw": processed["image_grid_thw"],
            "mm_token_type_ids": (ids == cfg["image_token_id"]).int()}


def qjax_tower_from_torch(tower: torch.nn.Module, dtype) -> Any:
    """qjax's vision tower (`qjax.model.vision`) holding transformers' `tower`'s weights (read in float64, cast to
    `dtype`); its `[depth, …]` block stacks are transformers' `blocks.{i}.…` tensors stacked."""
    import jax.numpy as jnp
    from flax import nnx

    from qjax.model.config import VisionConfig
    from qjax.model.vision import Qwen3_5MoeVisionModel as JaxVision

    vc = VisionConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": {},
                                 "vision_config": tower.config.to_dict()})
    model = JaxVision(vc, dtype=dtype)
    sd = {k: v.detach().double().numpy() for k, v in tower.state_dict().items()}
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        path = tuple(map(str, path))
        if path[0] == "blocks":
            value = np.stack([sd[f"blocks.{i}." + ".".join(path[1:])] for i in range(vc.depth)])
        else:
            value = sd[".".join(path)]
        assert tuple(value.shape) == tuple(var.get_value().shape), (path, value.shape)
        var.set_value(jnp.asarray(value, dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
