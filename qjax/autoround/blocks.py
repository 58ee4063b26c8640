"""A decoder layer seen as a function of its weights: what the per-block tuner differentiates.

The model stores layers stacked per group position (``lax.scan`` over groups); here each layer is sliced out as its
own module, its quantizable weights are enumerated as :class:`Unit` s (fused gate/up experts split back into the gate
and up projections auto-round tunes), and :func:`layer_apply` runs it with some weights replaced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.model.config import LINEAR
from qjax.model.linears import layer_linears
from qjax.model.rope import apply_rope

# auto-round never quantizes these (special_model_handler: routers and the shared-expert gate)
_IGNORED = ("mlp.gate", "mlp.shared_expert_gate")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One quantizable projection of a layer.

    ``name``: relative transformers name (``linear_attn.in_proj_qkv``; experts ``mlp.experts.gate_proj`` stand for
    every expert's projection). ``path``: the weight's path in the layer's nnx state. ``rows``: row slice of that
    weight (gate and up share the fused ``gate_up_proj``). ``experts``: the weight has a leading ``[E]`` axis.
    """

    name: str
    path: tuple
    rows: tuple[int, int] | None
    experts: bool
    shape: tuple[int, int]  # (out, in) of one projection


def decoder_layers(model) -> list:
    """Each decoder layer as its own nnx module (a copy sliced out of the stacked groups), in model order."""
    graphdef, state = nnx.split(model.groups)
    # one program cuts every group out of the stacked variables (op by op it was a slice and a squeeze program per
    # variable shape, ~1.4 s of compiles before a cold `qjax quantize` on the built-in model could start tuning)
    groups = jax.jit(lambda st: [jax.tree.map(lambda a: a[g], st) for g in range(model.num_groups)])(state)
    layers = []
    for group in groups:
        layers.extend(nnx.merge(graphdef, group).layers)
    return layers


def layer_units(cfg, kind: str) -> list[Unit]:
    """Quantizable projections of one layer (routers and the shared-expert gate excluded, as auto-round does)."""
    units = []
    for rel, shape in layer_linears(cfg, kind).items():
        if rel in _IGNORED:
            continue
        units.append(Unit(rel, tuple(rel.split(".")) + ("weight",), None, False, shape))
    inter, h = cfg.moe_intermediate_size, cfg.hidden_size
    units.append(Unit("mlp.experts.gate_proj", ("mlp", "experts", "gate_up_proj"), (0, inter), True, (inter, h)))
    units.append(Unit("mlp.experts.up_proj", ("mlp", "experts", "gate_up_proj"), (inter, 2 * inter), True, (inter, h)))
    units.append(Unit("mlp.experts.down_proj", ("mlp", "experts", "down_proj"), None, True, (h, inter)))
    return units


def unit_names(unit: Unit, layer_index: int, num_experts: int) -> list[str]:
    """transformers module names a unit covers (one per expert for expert units)."""
    stem = f"model.layers.{layer_index}."
    if not unit.experts:
        return [stem + unit.name]
    proj = unit.name.rsplit(".", 1)[1]
    return [f"{stem}mlp.experts.{e}.{proj}" for e in range(num_experts)]


def unit_weight(state_weights: dict, unit: Unit) -> jnp.ndarray:
    """The unit's ``[*lead, out, in]`` weight from ``{path: array}``."""
    w = state_weights[unit.path]
    return w if unit.rows is None else w[..., unit.rows[0]:unit.rows[1], :]


def weights_of(layer) -> dict[tuple, jnp.ndarray]:
    """``{path: array}`` of every variable of a layer."""
    return state_weights(nnx.state(layer))


def state_weights(state) -> dict[tuple, jnp.ndarray]:
    """``{path: array}`` of every variable of a layer's nnx state (the state's own buffers, not copies)."""
    return {tuple(p): v[...] for p, v in nnx.to_flat_state(state)}


def replace_units(weights: dict, units: list[Unit], new: dict[str, jnp.ndarray]) -> dict:
    """``weights`` with each unit in ``new`` (name → ``[*lead, out, in]``) written back (gate/up re-fused)."""
    out = dict(weights)
    by_path: dict[tuple, list[Unit]] = {}
    for u in units:
        if u.name in new:
            by_path.setdefault(u.path, []).append(u)
    for path, us in by_path.items():
        w = out[path]
        for u in us:
            v = new[u.name].astype(w.dtype)
            w = v if u.rows is None else w.at[..., u.rows[0]:u.rows[1], :].set(v)
        out[path] = w
    return out


def layer_apply(graphdef, state, weights: dict, h: jnp.ndarray, ctx) -> jnp.ndarray:
    """Run a layer (``graphdef``/``state`` from ``nnx.split``) with its variables taken from ``weights``."""
    flat = [(p, v.replace(weights[tuple(p)])) for p, v in nnx.to_flat_state(state)]
    out, _ = nnx.merge(graphdef, nnx.from_flat_state(flat))(h, ctx, None)
    return out


def attention_kv(layer, h: jnp.ndarray, ctx) -> tuple[jnp.ndarray, jnp.ndarray]:
    """K (after k_norm + RoPE) and V of a full-attention layer for input ``h [B, T, H]``: what an FP8 KV cache
    stores, so what static KV scales are calibrated on."""

    if layer.layer_type == LINEAR:
        raise ValueError("attention_kv: a linear-attention layer has no KV")
    att = layer.self_attn
    x = layer.input_layernorm(h)
    b, t, _ = x.shape
    k = apply_rope(att.k_norm(att.k_proj(x).reshape(b, t, att.num_kv_heads, att.head_dim)), ctx.cos, ctx.sin)
    v = att.v_proj(x).reshape(b, t, att.num_kv_heads, att.head_dim)
    return k, v
