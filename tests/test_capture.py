"""qjax.research.capture: captured sites equal transformers' ``output_hidden_states`` / ``output_router_logits``
(float32 within float32 noise, float64 to 1e-10), and a packed INT4 model captures the same sites.

transformers' ``hidden_states`` tuple is (embeddings, layer 0 … layer L-2 outputs, the final norm's output): its last
entry is post-norm, so qjax's last layer output is compared through the final norm (``Capture.hidden``).
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from oracles.hf import FLOAT32_PARITY_TOL

import qjax
from qjax.evaluation.torch_reference import float64_everywhere
from qjax.model.probe import SITES
from qjax.research.capture import capture


def _hf_states(hf, ids, wide=False):
    ctx = float64_everywhere(strict=True) if wide else torch.no_grad()
    with torch.no_grad(), ctx:
        out = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False, output_hidden_states=True,
                 output_router_logits=True)
    hs = [h.double().numpy() for h in out.hidden_states]
    return hs, [r.double().numpy() for r in out.router_logits]


def _check(cap, hs, router, tol):
    n = len(router)
    got_h = np.asarray(cap.sites["hidden_states"], np.float64)  # [L, B, T, H]
    for i in range(n - 1):
        assert np.abs(got_h[i] - hs[i + 1]).max() <= tol * max(1.0, np.abs(hs[i + 1]).max()), i
    assert np.abs(np.asarray(cap.hidden, np.float64) - hs[n]).max() <= tol * max(1.0, np.abs(hs[n]).max())
    got_r = np.asarray(cap.sites["router_logits"], np.float64)  # [L, B, T, E]
    for i in range(n):
        want = router[i].reshape(got_r[i].shape)  # transformers: [B·T, E]
        assert np.abs(got_r[i] - want).max() <= tol * max(1.0, np.abs(want).max()), i


def test_float32_captures_equal_transformers(tiny_hf):
    hf, folder = tiny_hf
    ids = np.random.default_rng(5).integers(0, 512, (2, 24))
    cap = capture(qjax.load_model(folder), ids, ("hidden_states", "router_logits"))
    hs, router = _hf_states(hf, ids)
    _check(cap, hs, router, FLOAT32_PARITY_TOL)


def test_float64_captures_equal_transformers_float64(tiny_hf, tiny_truth, x64):
    ids = np.random.default_rng(6).integers(0, 512, (2, 24))
    model = qjax.load_model(tiny_hf[1], dtype="float64")
    cap = capture(model, ids, ("hidden_states", "router_logits"))
    assert cap.sites["router_logits"].dtype == np.float64
    hs, router = _hf_states(tiny_truth, ids, wide=True)
    _check(cap, hs, router, 1e-10)


def test_packed_int4_model_captures_every_site(tiny_hf):
    """Every site of a packed model (experts and projections INT4 g32), stacked [L, B, T, …], from one jitted
    program; nothing patched, the logits are the plain forward's."""
    from qjax.autoround.rtn import quantize_model

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    q = quantize_model(qjax.load_model(tiny_hf[1]), qc)
    assert q.quant is not None
    ids = np.random.default_rng(7).integers(0, 512, (2, 10))
    # every site but expert_outputs (its weighted sum is formed outside the kernel: float32 rounding moves)
    sites = tuple(s for s in SITES if s != "expert_outputs")
    cap = capture(q, ids, sites)
    cfg = q.config
    lead = (cfg.num_hidden_layers, 2, 10)
    want = {"router_logits": (*lead, cfg.num_experts), "expert_indices": (*lead, cfg.num_experts_per_tok),
            "expert_weights": (*lead, cfg.num_experts_per_tok), "shared_expert_gate": (*lead, 1)}
    for s in sites:
        assert cap.sites[s].shape == want.get(s, (*lead, cfg.hidden_size)), s
        assert np.isfinite(np.asarray(cap.sites[s], np.float64)).all(), s
    # capturing a site can change how XLA fuses the ops around it (an FMA contracted or not): float32 rounding only
    # (the routing sites and the residual stream alone leave the logits bit for bit: tests/test_patch.py)
    np.testing.assert_allclose(np.asarray(cap.logits), np.asarray(q(ids)), rtol=0, atol=1e-5)
    w = np.asarray(cap.sites["expert_weights"], np.float64)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)  # renormalised top-k weights
    # the residual stream is the sum of the blocks' contributions
    h = np.asarray(cap.sites["hidden_states"])
    mid = h[:-1] + np.asarray(cap.sites["attn_output"])[1:]
    np.testing.assert_allclose(h[1:], mid + np.asarray(cap.sites["mlp_output"])[1:], rtol=0, atol=1e-5)


def test_mtp_head_states():
    """The MTP head's decoder layer captures the same sites, [L_mtp, B, T-1, …], beside its logits and output."""
    from flax import nnx
    from oracles.hf import tiny_text_config

    from qjax.model.config import TextConfig
    from qjax.research.capture import capture_mtp

    model = qjax.init_model(TextConfig.from_dict(tiny_text_config(), source="test"), with_mtp=True)
    ids = np.random.default_rng(8).integers(0, 512, (2, 9))
    cap = capture_mtp(model, ids, ("hidden_states", "router_logits"))
    assert cap.sites["hidden_states"].shape == (1, 2, 8, 64) and cap.sites["router_logits"].shape == (1, 2, 8, 8)
    graphdef, state = nnx.split(model)
    want = jax.jit(lambda s, x: nnx.merge(graphdef, s).mtp_logits(x))(state, ids)
    np.testing.assert_array_equal(np.asarray(cap.logits), np.asarray(want))
    assert cap.hidden.shape == (2, 8, 64)
