"""Which modules of a model are quantized, and how: the static plan the model is built from.

The loader derives it from ``quantization_config`` *and* the tensors present (docs/formats.md §2: the config decides
bits, groups and format; the tensors decide whether a module is quantized). Module names are relative to a decoder layer
(``self_attn.q_proj``, ``linear_attn.in_proj_qkv``, ``mlp.shared_expert.down_proj``, ``mlp.experts.gate_up_proj``…).
"""

from __future__ import annotations

import dataclasses

from qjax.kernels import QuantMeta

LayerQuant = tuple[tuple[str, QuantMeta], ...]  # sorted (relative module name, meta) pairs


@dataclasses.dataclass(frozen=True)
class ModelQuant:
    layers: tuple[LayerQuant, ...]  # one entry per decoder layer
    lm_head: QuantMeta | None = None
    kv_cache: str | None = None  # None (model-dtype KV) | "tensor" | "attn_head": FP8 E4M3 KV with static scales
    kv_scale_dtype: str = "float32"  # dtype of the stored k_scale / v_scale

    def layer(self, i: int) -> dict[str, QuantMeta]:
        return dict(self.layers[i]) if i < len(self.layers) else {}

    @property
    def is_empty(self) -> bool:
        return not any(self.layers) and self.lm_head is None and self.kv_cache is None
