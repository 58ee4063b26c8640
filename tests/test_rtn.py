"""RTN (qjax.autoround.rtn.quantize_model): the same bits as compressed-tensors' own RTN, and clear refusals."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from oracles.ct import RECIPES, write_ct_checkpoint

import qjax


def test_rtn_in_qjax_equals_compressed_tensors_rtn(hf128, tmp_path):
    """qjax's own RTN (quantize_model) packs the same bits as compressed-tensors' calculate_qparams + compress."""
    import copy

    import torch

    from qjax.autoround.rtn import quantize_model

    # a bf16 model, as llmcompressor runs it: compressed-tensors computes in the weight dtype
    hf = copy.deepcopy(hf128).to(torch.bfloat16)
    recipe = RECIPES["int4_asym_g32"]
    folder = write_ct_checkpoint(hf, tmp_path / "ct", recipe)
    ct_model = qjax.load_model(folder)
    dense_dir = tmp_path / "dense"
    hf.save_pretrained(dense_dir)
    dense = qjax.load_model(dense_dir, dtype=ct_model.dtype)
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    ours = quantize_model(dense, qc)
    from qjax.checkpoint.layout import checkpoint_tensors
    a = {k: g() for k, _, g in checkpoint_tensors(ours)}
    b = {k: g() for k, _, g in checkpoint_tensors(ct_model)}
    assert set(a) == set(b)
    diff = [k for k in a if np.asarray(a[k]).tobytes() != np.asarray(b[k]).tobytes()]
    assert not diff, diff[:5]


def test_rtn_names_the_module_when_groups_do_not_divide(tiny_hf):
    from qjax.convert.planner import recipe_to_qconfig

    from qjax.autoround.rtn import quantize_model

    model = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    with pytest.raises(ValueError,
                       match=r"model\.layers\.\d+\..*\[.*\]: 64 columns are not divisible by group_size 128"):
        quantize_model(model, recipe_to_qconfig("w4a16"))
