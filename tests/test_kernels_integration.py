"""The quantized checkpoints of the formats tests (and an unquantized one) give unchanged logits and tokens through
the Pallas entry points (interpret mode on CPU) — the model calls only ``qjax.kernels.qmatmul`` / ``moe_experts`` /
``matmul``.

Tolerance 1e-5 (fp32): same dequantized values, only the fp32 accumulation order differs inside the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.ct import write_ct_checkpoint
from oracles.hf import make_hf_model, tiny_text_config

import qjax

pytestmark = [pytest.mark.slow, pytest.mark.interpret, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]
RECIPES = {
    "w2_experts_w4_asym_rest": {"groups": [
        {"targets": [EXPERTS], "format": "pack-quantized",
         "weights": {"num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}},
        {"targets": ["Linear"], "format": "pack-quantized",
         "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}],
        "ignore": IGNORE, "kv_cache": None},
    "mxfp8_experts_int8_rest": {"groups": [
        {"targets": [EXPERTS], "format": "mxfp8-quantized",
         "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}},
        {"targets": ["Linear"], "format": "pack-quantized",
         "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}],
        "ignore": IGNORE, "kv_cache": None},
}


@pytest.mark.parametrize("name", sorted(RECIPES) + ["bf16_original"])
def test_logits_unchanged_through_pallas_entry_points(name, tmp_path, monkeypatch):
    hf = make_hf_model(tiny_text_config(initializer_range=0.05), seed=5)
    if name in RECIPES:
        folder = write_ct_checkpoint(hf, tmp_path / name, RECIPES[name])
    else:  # unquantized: the dense projections go through kernels.matmul, read inside the layer stack, and the
        # experts through the MoE kernels as fmt="dense"
        folder = str(tmp_path / name)
        hf.save_pretrained(folder)
        from qjax.kernels import moe_pallas, qmatmul_pallas

        in_stack, moe_metas = [], []
        real = qmatmul_pallas.matmul_pallas
        monkeypatch.setattr(qmatmul_pallas, "matmul_pallas",
                            lambda x, w, **kw: in_stack.append(w.shape) or real(x, w, **kw))
        real_moe = moe_pallas.moe_experts_pallas
        monkeypatch.setattr(moe_pallas, "moe_experts_pallas", lambda x, idx, w, gu, dn, **kw: moe_metas.append(
            (gu[3].fmt, dn[3].fmt)) or real_moe(x, idx, w, gu, dn, **kw))
    from qjax.kernels import attention_pallas, gdn_pallas

    gdn_steps = []  # decode steps of the GDN layers: the fused decode kernel (conv step, gating, recurrence), with
    # the window and the state inside their layer stacks
    real_gdn = gdn_pallas.gated_delta_decode_pallas
    monkeypatch.setattr(gdn_pallas, "gated_delta_decode_pallas",
                        lambda *a, **kw: gdn_steps.append(kw.get("layer") is not None) or real_gdn(*a, **kw))
    attn_steps = []  # decode steps of the full-attention layers: K/V read inside the cache stacks by the kernels
    real_attn = attention_pallas.decode_attention_pallas
    monkeypatch.setattr(attention_pallas, "decode_attention_pallas",
                        lambda q, k, v, *a, **kw: attn_steps.append(k.ndim) or real_attn(q, k, v, *a, **kw))
    ids = np.random.default_rng(0).integers(0, 512, (2, 21)).astype(np.int32)
    logits = {}
    for impl in ("reference", "interpret"):
        monkeypatch.setenv("QJAX_KERNELS", impl)
        jax.clear_caches()  # the implementation is chosen at trace time
        model = qjax.load_model(folder, dtype=jnp.float32)
        logits[impl] = np.asarray(model(ids))
        # decode steps (M = 2 rows, the GEMV path) through the same entry points
        out = qjax.generate(model, ids[:, :8], max_new_tokens=3)
        logits[impl + "_gen"] = out
    jax.clear_caches()
    if name not in RECIPES:  # every projection of the tiny model is read in place at decode (M = 2 rows)
        assert {shape[1:] for shape in in_stack} >= {(256, 64), (64, 128), (128, 64)}, in_stack
        assert moe_metas and set(moe_metas) == {("dense", "dense")}, moe_metas
    assert gdn_steps and all(gdn_steps), gdn_steps
    assert attn_steps and set(attn_steps) == {5}, attn_steps  # [G, B, Hkv, S, D]: the stacks themselves
    assert np.abs(logits["interpret"] - logits["reference"]).max() <= 1e-5
    np.testing.assert_array_equal(logits["interpret_gen"], logits["reference_gen"])
