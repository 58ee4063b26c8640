"""Random-weight models built on the device from a config and a quantization recipe: no checkpoint file, no host copy.

A weight-only quantized model runs at the same speed whatever its weight values, so speed and memory at the real
size (Qwen3.6-35B-A3B) can be measured without downloading weights. The model has exactly the structure, dtypes and
packed layouts the loader builds for an RTN checkpoint of that recipe (``qjax inspect --recipe`` predicts the same
bytes), and it can be saved with :func:`qjax.convert.save_pretrained` like any other.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.checkpoint.quant_plan import plan_quantization
from qjax.convert.planner import recipe_headers
from qjax.model.config import TextConfig
from qjax.model.qwen3_5_moe import Qwen3_5MoeForCausalLM, abstract_model
from qjax.model.sharding import plan_mesh, set_plan, state_shardings
from qjax.model.variables import packed_metas


def random_model(cfg: TextConfig, recipe: str = "bf16", *, dtype=jnp.bfloat16, seed: int = 0,
                 mesh=None) -> Qwen3_5MoeForCausalLM:
    """A model of ``cfg`` quantized as ``recipe`` would quantize it, with random weights made on the device(s).

    Args:
      recipe: a ``qjax inspect`` / ``qjax quantize`` recipe: a preset (``bf16``, ``w2w4``, ``w4a16``, ``w8a16-g32``,
        ``mxfp8-experts``) or ``SELECTOR=SCHEME,...`` (``kv=fp8`` adds static FP8 KV scales).
      dtype: the float dtype of dense weights and activations.
      mesh: as :func:`qjax.load_model`'s; each device creates only its own shards.
    Float weights follow the model's own initialisation; packed words are uniformly random bits, scales are sized so
    activations keep unit scale (``1 / (√K · 2^(bits-1))``), zero points random, FP8 KV scales 1/64.
    """

    dtype = jnp.dtype(dtype)
    model = abstract_recipe_model(cfg, recipe, dtype=dtype)
    quant = model.quant
    plan = shardings = None
    if mesh is not None:

        plan = plan_mesh(mesh, cfg)
        set_plan(model, plan)
        shardings = state_shardings(model, plan)
    metas = packed_metas(model)
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    paths = [tuple(p) for p, _ in flat]

    def build():
        real = Qwen3_5MoeForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), quant=quant)
        values = {tuple(p): v.get_value() if hasattr(v, "get_value") else v.value
                  for p, v in nnx.to_flat_state(nnx.state(real))}
        base = jax.random.key(seed + 1)
        return [_randomize(p, values[p], metas.get(p[:-1]), jax.random.fold_in(base, i)) for i, p in enumerate(paths)]

    out_shardings = None if shardings is None else [shardings[p] for p in paths]
    arrays = jax.jit(build, out_shardings=out_shardings)()
    for (_, v), a in zip(flat, arrays):
        v.set_value(a) if hasattr(v, "set_value") else setattr(v, "value", a)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def abstract_recipe_model(cfg: TextConfig, recipe: str = "bf16", *, dtype=jnp.bfloat16) -> Qwen3_5MoeForCausalLM:
    """The model ``recipe`` makes of ``cfg``, with abstract (shape-only) variables: sizes and bytes, no memory."""

    headers, qc = recipe_headers(cfg, recipe, dtype=jnp.dtype(dtype).name)
    quant = plan_quantization(cfg, qc, set(headers), lambda k: headers[k][1], text_prefix="model.",
                              source=f"recipe {recipe!r}")
    return abstract_model(cfg, dtype=jnp.dtype(dtype), quant=quant)


def _randomize(path: tuple, value: jax.Array, meta, key: jax.Array) -> jax.Array:
    """Random contents for a packed field or KV scale; every other variable keeps the model's initial value."""
    leaf = path[-1]
    if leaf in ("k_scale", "v_scale"):
        return jnp.full(value.shape, 1 / 64, value.dtype)
    if meta is None or leaf not in ("weight_packed", "weight_scale", "weight_zero_point"):
        return value
    k = meta.in_features
    if leaf == "weight_packed":
        if value.dtype == jnp.int32:
            return jax.lax.bitcast_convert_type(jax.random.bits(key, value.shape, jnp.uint32), jnp.int32)
        return jax.random.normal(key, value.shape, jnp.float32).astype(value.dtype)  # E4M3 values around ±1
    if leaf == "weight_scale":
        if value.dtype == jnp.uint8:  # E8M0: 2^(s-127) ≈ 1/√K
            centre = 127 - round(math.log2(math.sqrt(k)))
            return jax.random.randint(key, value.shape, centre - 1, centre + 2).astype(jnp.uint8)
        base = 1.0 / (math.sqrt(k) * 2 ** (meta.bits - 1))
        return (base * jax.random.uniform(key, value.shape, jnp.float32, 0.5, 1.5)).astype(value.dtype)
    half = 2 ** (meta.bits - 1)
    return jax.random.randint(key, value.shape, -half, half).astype(value.dtype)
