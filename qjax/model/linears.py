"""Every linear projection of a decoder layer, declared once: its name (transformers' module path inside the layer),
its ``[out, in]`` shape as a function of the config, how tensor parallelism splits it, and whether it may be quantized.

Module construction (:func:`linear`), the quantization plan (:func:`layer_linears`, read by
:mod:`qjax.checkpoint.quant_plan`, the writers' ignore lists and AutoRound's units) and the sharding rules
(:func:`tensor_parallel_kind`, read by :mod:`qjax.model.sharding`) all read this table: adding a projection is one
line here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from qjax.model.config import FULL, LINEAR, TextConfig
from qjax.model.layers import Linear

MLP = "mlp"  # the projections every layer has (the shared expert and its gate), whatever its attention kind


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    name: str  # e.g. "self_attn.q_proj"
    shape: Callable[[TextConfig], tuple[int, int]]  # config → (out, in)
    tensor_parallel: str  # "col": output rows split; "col_kv": split when kv heads are; "row": input columns split;
    #                       "replicated"


def _attn(c: TextConfig) -> tuple[int, int, int]:
    return c.num_attention_heads, c.num_key_value_heads, c.head_dim


LINEARS: dict[str, tuple[LinearSpec, ...]] = {
    FULL: (
        # q_proj rows are head-major [h0 query | h0 gate | h1 query | h1 gate | …]
        LinearSpec("self_attn.q_proj", lambda c: (2 * _attn(c)[0] * c.head_dim, c.hidden_size), "col"),
        LinearSpec("self_attn.k_proj", lambda c: (_attn(c)[1] * c.head_dim, c.hidden_size), "col_kv"),
        LinearSpec("self_attn.v_proj", lambda c: (_attn(c)[1] * c.head_dim, c.hidden_size), "col_kv"),
        LinearSpec("self_attn.o_proj", lambda c: (c.hidden_size, _attn(c)[0] * c.head_dim), "row"),
    ),
    LINEAR: (
        LinearSpec("linear_attn.in_proj_qkv", lambda c: (c.conv_dim, c.hidden_size), "col"),
        LinearSpec("linear_attn.in_proj_z", lambda c: (c.linear_value_dim, c.hidden_size), "col"),
        LinearSpec("linear_attn.in_proj_b", lambda c: (c.linear_num_value_heads, c.hidden_size), "col"),
        LinearSpec("linear_attn.in_proj_a", lambda c: (c.linear_num_value_heads, c.hidden_size), "col"),
        LinearSpec("linear_attn.out_proj", lambda c: (c.hidden_size, c.linear_value_dim), "row"),
    ),
    MLP: (
        LinearSpec("mlp.shared_expert.gate_proj", lambda c: (c.shared_expert_intermediate_size, c.hidden_size), "col"),
        LinearSpec("mlp.shared_expert.up_proj", lambda c: (c.shared_expert_intermediate_size, c.hidden_size), "col"),
        LinearSpec("mlp.shared_expert.down_proj", lambda c: (c.hidden_size, c.shared_expert_intermediate_size), "row"),
        LinearSpec("mlp.shared_expert_gate", lambda c: (1, c.hidden_size), "replicated"),
    ),
}
SPECS: dict[str, LinearSpec] = {s.name: s for specs in LINEARS.values() for s in specs}


def layer_linears(cfg: TextConfig, kind: str) -> dict[str, tuple[int, int]]:
    """The quantizable linears of a decoder layer of ``kind``: relative name → (out, in) (the routed experts, one
    ``[E, …]`` stack per projection, are described by the quantization plan itself)."""
    return {s.name: s.shape(cfg) for s in (*LINEARS[kind], *LINEARS[MLP])}


def tensor_parallel_kind(name: str) -> str | None:
    """How tensor parallelism splits the linear at relative path ``name`` (None: not a layer linear of the table)."""
    for suffix, spec in SPECS.items():
        if name == suffix or name.endswith("." + suffix):
            return spec.tensor_parallel
    return None


def linear(cfg: TextConfig, name: str, quant: dict, *, dtype, rngs: nnx.Rngs | None) -> Linear:
    """The :class:`~qjax.model.layers.Linear` ``name`` of the table, packed when ``quant`` (relative name →
    QuantMeta) lists it."""
    out_features, in_features = SPECS[name].shape(cfg)
    try:
        return Linear(in_features, out_features, dtype=dtype, std=cfg.initializer_range, rngs=rngs,
                      meta=quant.get(name))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
