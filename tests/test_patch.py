"""qjax.research.patch: a model's own captured values patched back in are an exact identity; every block swapped
float → quantized gives the quantized model's logits bit for bit; expert ablations knock out what they name; the
gradient with respect to a site is the gradient of the computation that follows it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax.research.capture import Probe, capture, run
from qjax.research.patch import ablate_experts, expert_means, layer_mask, patch, site_gradients, swap_blocks

IDS = np.random.default_rng(3).integers(0, 512, (2, 12))


@pytest.fixture(scope="module")
def models(tiny_hf):
    from qjax.autoround.rtn import quantize_model

    model = qjax.load_model(tiny_hf[1])
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    return model, quantize_model(model, qc)


def test_patching_own_captures_back_is_an_exact_identity(models):
    model, _ = models
    sites = ("attn_output", "mlp_output", "router_logits", "expert_indices")
    cap = capture(model, IDS, sites)
    out = patch(model, IDS, values=cap.sites, capture_sites=sites)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(cap.logits))
    for s in sites:
        np.testing.assert_array_equal(np.asarray(out.sites[s]), np.asarray(cap.sites[s]))
    np.testing.assert_array_equal(np.asarray(cap.logits), np.asarray(model(IDS)))  # and the plain forward's


def test_swapping_every_block_float_to_quantized_gives_the_quantized_logits(models):
    model, q = models
    n = model.config.num_hidden_layers
    want = np.asarray(q(IDS))
    assert np.abs(np.asarray(model(IDS)) - want).max() > 1e-3  # the two models differ
    np.testing.assert_array_equal(np.asarray(swap_blocks(model, q, IDS, range(n)).logits), want)
    # one block (the same program: the mask is an input) changes the output, less than all of them
    one = np.asarray(swap_blocks(model, q, IDS, [2]).logits)
    assert 0 < np.abs(one - np.asarray(model(IDS))).max() < np.abs(want - np.asarray(model(IDS))).max()
    assert layer_mask([2], n).tolist() == [False, False, True, False]


def test_expert_ablation(models):
    model, _ = models
    sites = ("expert_indices", "expert_weights")
    z = run(model, IDS, Probe(capture=sites, edit=ablate_experts({1: [0, 3]})))
    idx, w = (np.asarray(z.sites[s]) for s in sites)
    knocked = np.isin(idx[1], [0, 3])
    assert knocked.any() and (w[1][knocked] == 0).all() and (w[1][~knocked] > 0).all()
    assert (w[[0, 2, 3]] > 0).all()  # other layers untouched
    assert np.abs(np.asarray(z.logits) - np.asarray(model(IDS))).max() > 1e-4
    means = expert_means(model, IDS)
    assert means.shape == (4, model.config.num_experts, model.config.hidden_size)
    m = run(model, IDS, Probe(edit=ablate_experts({1: [0, 3]}, "mean", means)))
    assert np.isfinite(np.asarray(m.logits)).all()
    assert np.abs(np.asarray(m.logits) - np.asarray(z.logits)).max() > 1e-4


def test_site_gradient_is_the_gradient_of_what_follows(models):
    """d loss / d hidden_states[L-1] through site_gradients equals jax.grad of the final norm + lm_head + loss applied
    to the captured last hidden state; the loss is the plain forward's."""
    model, _ = models

    def loss_fn(logits):
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    loss, grads = site_gradients(model, IDS, ("hidden_states", "mlp_output"), loss_fn)
    last = capture(model, IDS, ("hidden_states",)).sites["hidden_states"][-1]
    direct = jax.grad(lambda h: loss_fn(model.logits_from_hidden(model.norm(h))))(last)
    assert grads["hidden_states"].shape == grads["mlp_output"].shape == (4, 2, 12, 64)
    np.testing.assert_allclose(np.asarray(grads["hidden_states"][-1]), np.asarray(direct), rtol=1e-5, atol=1e-7)
    # the last block's output reaches the loss only through the residual stream after it
    np.testing.assert_array_equal(np.asarray(grads["mlp_output"][-1]), np.asarray(grads["hidden_states"][-1]))
    assert float(loss) == pytest.approx(float(loss_fn(model(IDS))), rel=1e-6)
