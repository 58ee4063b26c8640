"""qjax: quantize and run Qwen3.5/3.6-MoE (Gated DeltaNet + gated attention + MoE) in JAX.

Public API::

    model = qjax.load_model("path/to/checkpoint")          # BF16/FP32 or compressed-tensors HF folder
    logits = model(input_ids)                               # [B, T] int32 -> [B, T, V]
    tokens = qjax.generate(model, input_ids, max_new_tokens=32)
    tokens = qjax.generate(model, ids_with_image_pad, images=["photo.png"], max_new_tokens=32)

The names below are imported on first use (PEP 562), so that ``import qjax.kernels`` — the kernel package, which
depends on nothing above it — does not import flax and the model.
"""

import importlib

from . import xla_env

xla_env.apply()  # before the CPU backend starts: a YNNPACK fusion miscomputes fp32 quantized matmuls (xla_env.py)

# public name → the module that defines it
_EXPORTS = {
    "Cache": "model.cache", "ConfigError": "model.config", "DtypeError": "model.dtypes", "TextConfig": "model.config",
    "GenerationConfig": "model.config", "VisionConfig": "model.config",
    "ImageError": "multimodal.images", "ImageProcessorConfig": "multimodal.images", "PromptError": "multimodal.positions",
    "prepare_images": "multimodal.prompt",
    "Qwen3_5MoeForCausalLM": "model.qwen3_5_moe", "init_model": "model.qwen3_5_moe", "MeshError": "model.sharding",
    "LoadError": "checkpoint.loading", "load_model": "checkpoint.loading",
    "SafetensorsError": "checkpoint.safetensors_io",
    "extend": "runtime.generate", "generate": "runtime.generate",
    "stream": "runtime.generate", "SpeculativeStats": "runtime.speculative",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
