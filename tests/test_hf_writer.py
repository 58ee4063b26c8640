"""HF folder writer: what qjax writes, transformers and qjax load back identically; writes are atomic."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from qjax.convert import save_pretrained

import qjax


def test_round_trip_through_transformers(official_dir, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    model = qjax.load_model(official_dir)
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=200_000)  # forces several shards + index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    ids = np.random.default_rng(0).integers(0, 512, (2, 40)).astype(np.int32)
    want = np.asarray(model(ids))
    again = qjax.load_model(out)
    np.testing.assert_array_equal(np.asarray(again(ids)), want)
    assert again.mtp is not None
    np.testing.assert_array_equal(np.asarray(again.mtp_logits(ids)), np.asarray(model.mtp_logits(ids)))
    hf = Qwen3_5MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs - want).max() <= 2e-4  # two fp32 implementations: see tests/test_model.py


def test_fused_bf16_layout(tiny_hf, tmp_path):
    model = qjax.load_model(tiny_hf[1])
    out = save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16, fused_experts=True)
    from qjax.checkpoint.safetensors_io import SafetensorsFile
    f = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert f.dtype("model.layers.0.mlp.experts.gate_up_proj") == "BF16"
    assert f.shape("model.layers.0.mlp.experts.gate_up_proj") == [8, 64, 64] or \
        tuple(f.shape("model.layers.0.mlp.experts.gate_up_proj")) == (8, 64, 64)
    f.close()
    back = qjax.load_model(out)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back.embed_tokens[...]),
                                  np.asarray(model.embed_tokens[...]).astype(jnp.bfloat16))


def test_existing_target_is_protected_and_failed_write_leaves_nothing(tiny_hf, tmp_path, monkeypatch):
    model = qjax.load_model(tiny_hf[1])
    target = tmp_path / "ckpt"
    save_pretrained(model, target)
    with pytest.raises(FileExistsError, match="already exists"):
        save_pretrained(model, target)

    from qjax.convert import hf_writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_writer, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "new")
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, target, overwrite=True)
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folders left behind
    qjax.load_model(target)  # the old checkpoint is intact
