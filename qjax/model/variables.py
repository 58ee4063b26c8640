"""A model's variables as flat tables by path: what the loader fills, the writers write, the sharding rules place
and the memory planner counts."""

from __future__ import annotations

import jax
from flax import nnx


def variable_shapes(model: nnx.Module) -> dict[tuple, jax.ShapeDtypeStruct]:
    """Every variable's value (an array, or a ShapeDtypeStruct for an abstract model) by its path."""
    return {tuple(p): v.get_value() if hasattr(v, "get_value") else v.value
            for p, v in nnx.to_flat_state(nnx.state(model))}


def packed_metas(model: nnx.Module) -> dict[tuple, object]:
    """The static QuantMeta of every packed weight module, by module path (the layer-stack axis dropped)."""
    metas = {}
    for path, node in nnx.iter_graph(model):
        meta = getattr(node, "meta", None)
        if meta is not None and hasattr(node, "weight_packed"):
            metas[tuple(path)] = meta
    return metas
