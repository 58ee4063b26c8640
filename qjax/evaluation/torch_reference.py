"""The PyTorch reference of any checkpoint folder qjax loads, for ``qjax compare``.

transformers' ``Qwen3_5MoeForCausalLM`` in float32 with eager attention, whose weights are the folder's own tensors:
dense ones upcast, quantized ones decompressed by compressed-tensors' own compressors (``decompress`` of the scheme
compressed-tensors' matching picks for the module), routed experts fused into transformers 5's ``[E, …]`` stacks.
transformers' ``from_pretrained`` is not used: on quantized folders it can leave tensors at their random init or
decompress them with another group's scheme (docs/formats.md §10.2), and the diff would then blame qjax.

auto_round folders (GPTQ/AWQ packing) are read through qjax's bit-exact conversion to compressed-tensors' layout
(:mod:`qjax.checkpoint.auto_round`, checked against auto-round's own packing in the tests), then decompressed the
same way. With static FP8 KV scales, K (after k_norm + RoPE) and V go through E4M3 with the stored scales before
eager attention — what qjax's forward does — so the FP8 KV cache is emulated on both sides.

In float64 (the ground truth of ``qjax compare --dtype float64``) transformers' code is not float64 by itself: it pins
float32 in RoPE (``inv_freq``, the angles, the rotation), the RMSNorms, the GDN gated norm, the gated delta rule
(chunked and recurrent), the decay ``g``, the attention softmax and the router softmax — a ``.to(float64)`` model is
1e-6 to 1e-5 off the float64 truth through them. :func:`float64_everywhere` runs the same code with every such
float32 request promoted to float64 (a ``TorchFunctionMode``) and records any op that still returns a narrower float,
which :func:`build_reference` refuses; the routed experts run transformers' eager loop (``grouped_mm`` has no float64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import numpy as np

from qjax.checkpoint.loading import quantization_view
from qjax.checkpoint.view import Checkpoint
from qjax.model.config import read_config

OFFICIAL_PREFIX = "model.language_model."
SKIPPED = ("model.visual.", "mtp.")
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")
FP8_ATTENTION = "qjax_reference_fp8_kv"
E4M3_MAX = 448.0


class ReferenceError(ValueError):
    """The folder's reference cannot be built; the message says which tensor or config part, and why."""


REFERENCE_DTYPES = ("float64", "float32", "bfloat16")


@dataclasses.dataclass
class Reference:
    model: object  # transformers Qwen3_5MoeForCausalLM in ``dtype``, eval mode
    dtype: str  # what it runs in: "float32", "float64" (everywhere: see float64_everywhere) or "bfloat16"
    decompressed: int  # quantized modules decompressed by compressed-tensors
    fp8_kv: bool  # K/V fake-quantized to E4M3 with the stored scales (qjax does the same)
    versions: str  # "transformers 5.24.0, compressed-tensors 0.20.1"

    def running(self):
        """The context every forward of :attr:`model` runs in (float64: :func:`float64_everywhere`, checked on
        exit: an op that still computed in a narrower float raises ReferenceError)."""
        return float64_everywhere(strict=True) if self.dtype == "float64" else contextlib.nullcontext()


def float64_everywhere(strict: bool = False):
    """A ``TorchFunctionMode`` under which torch code asking for float32 (``.float()``, ``.to(torch.float32)``,
    ``dtype=torch.float`` in softmax, arange, zeros, …) gets float64. ``strict``: leaving the block raises
    ReferenceError if any op inside returned a float32 / bfloat16 / float16 tensor (a pin it did not catch)."""
    import torch
    from torch.overrides import TorchFunctionMode

    narrow = (torch.float32, torch.bfloat16, torch.float16)

    def promote(x):
        if x is torch.float32:
            return torch.float64
        if isinstance(x, (list, tuple)):
            return type(x)(promote(v) for v in x)
        return x

    class Float64Everywhere(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.narrowed: dict[str, int] = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.float:
                func = torch.Tensor.double
            out = func(*promote(args), **{k: promote(v) for k, v in (kwargs or {}).items()})
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.dtype in narrow:
                    name = getattr(func, "__qualname__", None) or str(func)
                    self.narrowed[name] = self.narrowed.get(name, 0) + 1
            return out

        def __exit__(self, *exc):
            result = super().__exit__(*exc)
            if strict and self.narrowed and exc[0] is None:
                raise ReferenceError(f"transformers computed in a narrower float than float64 in "
                                     f"{sorted(self.narrowed)[:5]}: the float64 reference would not be the truth")
            return result

    return Float64Everywhere()


def build_reference(folder: str | os.PathLike, dtype: str = "float32") -> Reference:
    """The transformers model of ``folder``'s weights in ``dtype`` (one of :data:`REFERENCE_DTYPES`; see the module
    docstring). Quantized weights are compressed-tensors' decompression output in every dtype (exact in float64)."""
    if dtype not in REFERENCE_DTYPES:
        raise ReferenceError(f"the reference runs in one of {REFERENCE_DTYPES}, not {dtype!r}")
    try:
        import compressed_tensors
        import torch
        import transformers
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    except ImportError as e:
        raise ReferenceError(f"the reference runs in transformers with compressed-tensors, which are not installed "
                             f"({e}); install them (pip install -e '.[test]')") from None
    folder = os.fspath(folder)
    path, raw = read_config(folder)
    text = dict(raw.get("text_config") or raw)
    ckpt = Checkpoint(folder)
    try:
        qc, view = quantization_view(folder, ckpt)
        tensors = {k: _to_torch(np.array(view.get(k))) for k in view.keys() if not k.startswith(SKIPPED)}
    finally:
        ckpt.close()
    tensors = {("model." + k.removeprefix(OFFICIAL_PREFIX) if k.startswith(OFFICIAL_PREFIX) else k): v
               for k, v in tensors.items()}
    weights, decompressed = _decompressed(tensors, None if qc is None else qc.to_dict(), path)
    kv = {}
    for name in list(weights):
        m = KV_SCALE.match(name)
        if m:
            kv.setdefault(int(m[1]), {})[m[2]] = weights.pop(name).float()
    torch_dtype = getattr(torch, dtype)
    # float64: the decompressed (bf16 / fp32) values are exact; bfloat16: qjax's bf16 model rounds them the same way
    state = _fused({k: v.to(torch_dtype) for k, v in weights.items()})
    for key in ("quantization_config", "architectures", "transformers_version", "model_type", "dtype",
                "torch_dtype", "auto_map"):
        text.pop(key, None)
    try:
        cfg = Qwen3_5MoeTextConfig(**text)
    except (TypeError, ValueError) as e:
        raise ReferenceError(f"{path}: transformers refuses the text config: {e}") from None
    cfg._attn_implementation = "eager"
    if dtype == "float64":
        cfg._experts_implementation = "eager"  # grouped_mm has no float64
    with torch.random.fork_rng(devices=[]), (float64_everywhere() if dtype == "float64" else contextlib.nullcontext()):
        # under float64_everywhere the RoPE inverse frequencies are computed in float64, not rounded to float32
        model = Qwen3_5MoeForCausalLM(cfg).to(torch_dtype).eval()
    if "lm_head.weight" not in state and cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ReferenceError(f"{folder}: the tensors do not fill transformers' model (missing "
                             f"{sorted(result.missing_keys)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]})")
    if kv:
        _emulate_fp8_kv(model, kv, folder)
    return Reference(model=model, dtype=dtype, decompressed=len(decompressed), fp8_kv=bool(kv),
                     versions=f"transformers {transformers.__version__}, compressed-tensors "
                              f"{compressed_tensors.__version__}")


def _to_torch(arr: np.ndarray):
    """A torch tensor of the same bits (numpy has no bfloat16 / float8: those travel as same-width integers)."""
    import torch

    exotic = {"bfloat16": (np.uint16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn)}
    if arr.dtype.name in exotic:
        raw, dtype = exotic[arr.dtype.name]
        return torch.from_numpy(np.ascontiguousarray(arr).view(raw)).view(dtype)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _decompressed(tensors: dict, qc: dict | None, source: str) -> tuple[dict, list[str]]:
    """(``tensors`` with every quantized module's stored fields replaced by its decompressed ``.weight``, those
    modules)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    modules = sorted({k.rpartition(".")[0] for k, t in tensors.items()
                      if k.endswith(".weight_packed") or (k.endswith(".weight") and t.dtype == torch.float8_e4m3fn)})
    out = dict(tensors)
    if not modules:
        return out, modules
    if qc is None:
        raise ReferenceError(f"{source}: packed tensors ({modules[0]}, …) but no quantization_config")
    try:
        config = QuantizationConfig.model_validate(qc)
    except ValueError as e:
        raise ReferenceError(f"{source}: compressed-tensors refuses quantization_config: {str(e)[:300]}") from None
    with torch.no_grad():
        for module in modules:
            scheme, fmt = _scheme_for(module, config, source)
            compressor = BaseCompressor.get_value_from_registry(fmt)
            state = {p: tensors[f"{module}.{p}"] for p in compressor.compression_param_names(scheme)
                     if f"{module}.{p}" in tensors}
            for p in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
                out.pop(f"{module}.{p}", None)
            try:
                out[f"{module}.weight"] = _decompress(compressor, state, scheme, fmt)
            except (RuntimeError, ValueError, KeyError, AssertionError) as e:
                raise ReferenceError(f"{module}: compressed-tensors cannot decompress it ({type(e).__name__}: "
                                     f"{str(e)[:200]})") from None
    return out, modules


def _scheme_for(module: str, config, source: str):
    """The config group compressed-tensors' ``apply_quantization_config`` picks for ``module`` (exact name, then
    ``re:`` patterns, then the class ``Linear``), and its compression format."""
    import torch
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.utils.match import match_name, match_targets

    if any(match_name(module, ignored) for ignored in config.ignore or []):
        raise ReferenceError(f"{source}: {module} holds quantized tensors but quantization_config ignores it")
    target_to_scheme = {t: s for s in config.config_groups.values() for t in s.targets}
    probe = torch.nn.Linear(1, 1, bias=False, device="meta")  # every module holding packed weights is a Linear
    matched = match_targets(module, probe, list(target_to_scheme))
    if not matched:
        raise ReferenceError(f"{source}: {module} holds quantized tensors but no config group targets it")
    scheme = target_to_scheme[matched[0]]
    fmt = scheme.format
    if fmt is None and config.format not in (None, CompressionFormat.mixed_precision.value, "dense"):
        fmt = config.format
    return scheme, CompressionFormat(fmt or infer_module_format(torch.nn.Linear, scheme)).value


def _decompress(compressor, state: dict, scheme, fmt: str):
    """compressed-tensors' ``decompress`` of one module, around two of its 0.20.1 limits: a zero point is handed
    over column-major (its int4 unpacking of a transposed ``[1, G > 1]`` view fails with "view Int as Byte"), and a
    partial last group (a layer narrower than its group, which compressed-tensors writes) is decompressed from rows
    padded to whole groups, then cut."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    if "weight_zero_point" in state:
        zp = state["weight_zero_point"]
        state["weight_zero_point"] = torch.empty_strided(zp.shape, (1, zp.shape[0]), dtype=zp.dtype).copy_(zp)
    args = scheme.weights
    if fmt == "pack-quantized" and args.strategy == "group":
        rows, cols = (int(x) for x in state["weight_shape"])
        padded = math.ceil(cols / args.group_size) * args.group_size
        if padded != cols:
            q = unpack_from_int32(state["weight_packed"], args.num_bits, torch.Size([rows, cols]))
            state = dict(state, weight_packed=pack_to_int32(torch.nn.functional.pad(q, (0, padded - cols)),
                                                              args.num_bits),
                         weight_shape=torch.tensor([rows, padded]))
            return compressor.decompress(state, scheme)["weight"][:, :cols]
    return compressor.decompress(state, scheme)["weight"]


def _fused(state: dict) -> dict:
    """Per-expert 2-D weights → transformers 5's ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``mlp.experts.down_proj [E, H, I]``; already fused stacks (the official layout) pass through."""
    import torch

    out, experts = {}, {}
    for name, t in state.items():
        m = PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for prefix, projs in experts.items():
        n = max(len(p) for p in projs.values())
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = sorted(set(range(n)) - set(projs.get(proj, {})))
            if missing:
                raise ReferenceError(f"{prefix}.{missing[0]}.{proj}.weight is missing")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def _emulate_fp8_kv(model, kv: dict, folder: str) -> None:
    """Every full-attention layer's K and V through E4M3 with its stored scales (per tensor ``[1]`` or per kv head)
    before eager attention: a custom entry in transformers' attention registry."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import eager_attention_forward

    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    if sorted(kv) != full or any(set(pair) != {"k", "v"} for pair in kv.values()):
        raise ReferenceError(f"{folder}: k_scale/v_scale for layers {sorted(kv)}, but the full-attention layers are "
                             f"{full}")
    for i, pair in kv.items():
        model.model.layers[i].self_attn._qjax_kv_scales = (pair["k"], pair["v"])
    ALL_ATTENTION_FUNCTIONS.register(FP8_ATTENTION, _fp8_kv_attention(eager_attention_forward))
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP8_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.config._attn_implementation = FP8_ATTENTION


def _fp8_kv_attention(eager):
    import torch

    def quantize(x, scale):
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # as qjax's accumulation dtype
        s = scale.to(wide).reshape(1, -1, 1, 1)
        return ((x.to(wide) / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(wide) * s).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = module._qjax_kv_scales
        return eager(module, query, quantize(key, k_scale), quantize(value, v_scale), attention_mask, **kwargs)

    return attention
