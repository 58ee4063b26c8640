"""Loader and config: layouts, dtypes, and clear errors for bad input (each names the file and the tensor/field)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_util import tiny_text_config
from safetensors.numpy import load_file, save_file

import qjax
from qjax.model.config import TextConfig


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(folder: str, edit) -> None:
    """Load the single-file checkpoint, let ``edit(tensors)`` change it, save it back."""
    path = os.path.join(folder, "model.safetensors")
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path)


def test_official_layout_skips_vision_once_and_loads_mtp(official_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="qjax"):
        model = qjax.load_model(official_dir)
    said = [r.getMessage() for r in caplog.records if "model.visual" in r.getMessage()]
    assert len(said) == 1 and "skipping" in said[0]
    assert model.mtp is not None


def test_dtype_defaults_to_checkpoint_and_can_be_overridden(tiny_hf):
    model = qjax.load_model(tiny_hf[1])
    assert model.embed_tokens[...].dtype == jnp.float32
    bf = qjax.load_model(tiny_hf[1], dtype=jnp.bfloat16)
    assert bf.embed_tokens[...].dtype == jnp.bfloat16
    layer0 = bf.groups.layers[0].linear_attn
    assert layer0.A_log[...].dtype == jnp.float32 and layer0.dt_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(bf.embed_tokens[...]),
                                  np.asarray(model.embed_tokens[...]).astype(jnp.bfloat16))


def test_truncated_file_names_file_and_tensor(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(qjax.SafetensorsError) as err:
        qjax.load_model(folder)
    msg = str(err.value)
    assert "model.safetensors" in msg and "truncated" in msg and "tensor" in msg


def test_wrong_shape_missing_and_unexpected_are_listed_together(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")

    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = np.zeros((7, 64), np.float32)
        del t["model.layers.1.linear_attn.A_log"]
        del t["model.layers.0.mlp.experts.5.up_proj.weight"]
        t["model.layers.0.mlp.bogus.weight"] = np.zeros((2,), np.float32)

    _rewrite(folder, edit)
    with pytest.raises(qjax.LoadError) as err:
        qjax.load_model(folder)
    msg = str(err.value)
    assert folder in msg
    assert "model.layers.3.self_attn.k_proj.weight [model.safetensors] is [7, 64], expected [64, 64]" in msg
    assert "missing (2)" in msg and "model.layers.1.linear_attn.A_log" in msg
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in msg
    assert "unexpected (1): model.layers.0.mlp.bogus.weight [model.safetensors]" in msg


def test_integer_tensor_without_quantization_config_is_refused(tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1], tmp_path / "ckpt")
    _rewrite(folder, lambda t: t.__setitem__("model.norm.weight", np.zeros((64,), np.int32)))
    with pytest.raises(qjax.LoadError, match=r"model.norm.weight \[model.safetensors\] is I32"):
        qjax.load_model(folder)


def test_sharded_index_naming_missing_shard(official_dir, tmp_path):
    folder = _copy(official_dir, tmp_path / "ckpt")
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
    with pytest.raises(qjax.SafetensorsError, match="model-00002-of-00002.safetensors"):
        qjax.load_model(folder)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_text_config(), "model_type": "llama"}))
    with pytest.raises(qjax.ConfigError) as err:
        qjax.load_model(tmp_path)
    assert "config.json" in str(err.value) and "'llama'" in str(err.value)


def test_missing_config_field_and_missing_config(tmp_path):
    cfg = tiny_text_config()
    del cfg["linear_num_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(qjax.ConfigError, match="linear_num_value_heads"):
        qjax.load_model(tmp_path)
    with pytest.raises(qjax.ConfigError, match="no config.json"):
        qjax.load_model(tmp_path / "nowhere")


def test_config_composite_interval_and_validation():
    text = tiny_text_config()
    del text["layer_types"]
    text["full_attention_interval"] = 2
    cfg = TextConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "eos_token_id": 7})
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.layer_period == ("linear_attention", "full_attention") and cfg.num_groups == 2
    assert cfg.eos_token_id == (7,)
    with pytest.raises(qjax.ConfigError, match="text_config"):
        TextConfig.from_dict({"model_type": "qwen3_5_moe"})
    with pytest.raises(qjax.ConfigError, match="mrope_section"):
        TextConfig.from_dict({**tiny_text_config(), "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor":
                                                                        0.25, "mrope_section": [3, 3, 3]}})
    with pytest.raises(qjax.ConfigError, match="num_key_value_heads"):
        TextConfig.from_dict(tiny_text_config(num_key_value_heads=3))
    # the dict qjax writes parses back to the same config
    again = TextConfig.from_dict(cfg.to_hf_dict())
    assert again == cfg
