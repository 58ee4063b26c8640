"""Random-weight models made on the device from a config + recipe (for speed runs without weights): they must be
real models of that recipe — the structure and bytes the planner predicts, savable as a checkpoint that loads back
to the same logits — with non-degenerate random packed data."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.hf import tiny_text_config
from qjax.convert import save_pretrained
from qjax.convert.planner import plan_recipe

import qjax
from qjax.model.config import TextConfig
from qjax.runtime.random_model import random_model

RECIPES = ["bf16", "experts=int2:g32,attn=int4:g32:asym,rest=int8:g32", "experts=mxfp8,lm_head=int8:g32,kv=fp8"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_random_model_is_a_real_model_of_the_recipe(recipe, tmp_path):
    raw = tiny_text_config()
    cfg = TextConfig.from_dict(raw)
    model = random_model(cfg, recipe, dtype=jnp.float32, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    assert sum(x.size * x.dtype.itemsize for x in leaves) == plan_recipe(
        str(tmp_path / "config.json"), recipe, dtype="float32").device_bytes
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    logits = np.asarray(model(ids))
    assert np.isfinite(logits).all() and logits.std() > 0.1
    back = qjax.load_model(save_pretrained(model, tmp_path / "ckpt"), dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(back(ids)), logits)


def test_random_packed_words_use_every_bit():
    cfg = TextConfig.from_dict(tiny_text_config())
    model = random_model(cfg, "experts=int2:g32,rest=int4:g32", dtype=jnp.float32)
    words = np.asarray(model.groups.layers[0].mlp.experts.gate_up_proj.weight_packed[...]).view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8))
    assert 0.45 < bits.mean() < 0.55
