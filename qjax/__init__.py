"""qjax: quantize and run Qwen3.5/3.6-MoE (Gated DeltaNet + gated attention + MoE) in JAX.

Public API::

    model = qjax.load_model("path/to/checkpoint")          # BF16/FP32 HF folder
    logits = model(input_ids)                               # [B, T] int32 -> [B, T, V]
    tokens = qjax.generate(model, input_ids, max_new_tokens=32)
"""

from . import xla_env

xla_env.apply()  # before the CPU backend starts: a YNNPACK fusion miscomputes fp32 quantized matmuls (xla_env.py)

from .config import ConfigError, TextConfig  # noqa: E402
from .cache import Cache
from .generate import GenerationConfig, extend, generate, stream
from .loading import LoadError, load_model
from .model import Qwen3_5MoeForCausalLM, init_model
from .safetensors_io import SafetensorsError
from .sharding import MeshError

__all__ = ["Cache", "ConfigError", "GenerationConfig", "extend", "generate", "stream", "LoadError", "MeshError", "SafetensorsError", "TextConfig", "Qwen3_5MoeForCausalLM", "init_model",
           "load_model"]
