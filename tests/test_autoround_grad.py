"""The tuner's gradient through a whole decoder layer against PyTorch.

The same tiny checkpoint runs as a transformers ``Qwen3_5MoeDecoderLayer`` (torch autograd, auto-round 0.16.1's own
``quant_tensor_sym`` building every quantized weight from leaf tensors v, α, β) and as the layer qjax's tuner
differentiates (:func:`qjax.autoround.driver.block_loss`, ``jax.grad``). Both compute auto-round's token-masked MSE
against the same target, with random non-zero v and α/β in [0.5, 1] so rounding and clamping are exercised, for a
linear-attention layer and a full-attention one; every unit is tuned (attention projections, shared expert, all
routed experts).

Tolerance: the quantized weights are bit-identical (test_autoround_qdq.py); what differs is the fp32 summation
order of two frameworks' forward and backward passes (matmuls, the chunked delta rule, softmax). Per unit, relative
to the largest gradient entry: v measured ≤ 4e-6, asserted 2e-5; α/β are mostly exact, but their chain passes
through auto-round's fp16 rounding of the scale, so an upstream difference in the last fp32 bit can move one entry
by an fp16 ulp (2⁻¹¹ ≈ 4.9e-4 relative): measured ≤ 3.9e-4, asserted 1e-3. Every entry above 1e-3 · max |g| must
also have the same sign (sign-SGD uses only the sign).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from oracles.hf import make_hf_model, save_hf, tiny_text_config

import qjax
from qjax.autoround import blocks, qdq
from qjax.autoround.driver import block_loss
from qjax.autoround.schemes import Scheme

pytestmark = pytest.mark.slow

ar_int = pytest.importorskip("auto_round.data_type.int")

BITS, GROUP, B, T = 2, 32, 2, 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = make_hf_model(tiny_text_config(), seed=3)
    folder = save_hf(hf, tmp_path_factory.mktemp("grad") / "m")
    return hf, qjax.load_model(folder, dtype=jnp.float32)


def _torch_weight(name: str, w: np.ndarray, p: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """auto-round's fake-quantized ``w`` (as ``WrapperLinear._qdq_weight`` calls it) and its leaf (v, α, β)."""
    wt = torch.from_numpy(np.array(w, np.float32))
    wr = wt.reshape(-1, GROUP)
    tmin, tmax = torch.clamp(wr.min(1)[0], max=0), torch.clamp(wr.max(1)[0], min=0)
    leaves = [torch.from_numpy(np.asarray(p[k]).reshape(shape).copy()).requires_grad_()
              for k, shape in (("v", (-1, GROUP)), ("alpha", (-1,)), ("beta", (-1,)))]
    v, alpha, beta = leaves
    wdq = ar_int.quant_tensor_sym(wt, bits=BITS, group_size=GROUP, v=v, min_scale=beta, max_scale=alpha,
                                  tensor_min=tmin, tensor_max=tmax)[0]
    return wdq.reshape(w.shape), leaves


def _hf_param(unit: blocks.Unit) -> str:
    return {"mlp.experts.gate_proj": "mlp.experts.gate_up_proj", "mlp.experts.up_proj": "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj": "mlp.experts.down_proj"}.get(unit.name, unit.name + ".weight")


@pytest.mark.parametrize("layer_index", [0, 3])  # linear_attention, full_attention
def test_gradient_through_a_layer_matches_torch(models, layer_index):
    hf, model = models
    cfg = model.config
    kind = cfg.layer_types[layer_index]
    layer = blocks.decoder_layers(model)[layer_index]
    units = [u for u in blocks.layer_units(cfg, kind) if u.shape[0] % 32 == 0 and u.shape[1] % GROUP == 0]
    assert {"mlp.experts.gate_proj", "mlp.experts.down_proj", "mlp.shared_expert.up_proj"} <= {u.name for u in units}
    rng = np.random.default_rng(layer_index)
    weights = blocks.weights_of(layer)
    fixed = {u.name: blocks.unit_weight(weights, u) for u in units}
    params, consts = {}, {}
    for u in units:
        w = fixed[u.name]
        g, size = qdq.group_shape(w.shape, GROUP)
        params[u.name] = {"v": jnp.asarray(rng.uniform(-0.5, 0.5, (*w.shape[:-1], g, size)), jnp.float32),
                          "alpha": jnp.asarray(rng.uniform(0.5, 1.0, (*w.shape[:-1], g)), jnp.float32),
                          "beta": jnp.asarray(rng.uniform(0.5, 1.0, (*w.shape[:-1], g)), jnp.float32)}
        wmin, wmax = qdq.weight_minmax(w, GROUP)
        consts[u.name] = {"wmin": wmin, "wmax": wmax}
    x = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
    ref = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32) * 0.5 + x
    mask = np.ones((B, T, 1), np.float32)
    mask[:, -1] = 0.0  # auto-round masks each sample's last position

    scheme = Scheme(bits=BITS, group_size=GROUP, sym=True)
    graphdef, state = nnx.split(layer)
    loss_fn = block_loss(graphdef, {u.name: scheme for u in units}, tuple((u, scheme) for u in units),
                         filter_top=False, scale_dtype="float16")
    ctx, _ = model.step_context(jnp.zeros((B, T), jnp.int32), None, None, None)
    # jitted: op by op, the GDN layer's gradient compiled ~1,300 small programs (31 -> 7 s; the errors below the same)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, state, weights, consts, fixed, jnp.asarray(x),
                                                       jnp.asarray(ref), ctx, jnp.asarray(mask))

    # torch: the same layer with every unit's weight replaced by auto-round's qdq of it
    hf_layer = hf.model.layers[layer_index]
    new, leaves = {}, {}
    for u in units:
        wdq, leaves[u.name] = _torch_weight(u.name, np.asarray(fixed[u.name]), params[u.name])
        new.setdefault(_hf_param(u), []).append((u, wdq))
    tparams = {}
    for pname, parts in new.items():
        parts = sorted(parts, key=lambda t: (t[0].rows or (0, 0))[0])
        tparams[pname] = torch.cat([w for _, w in parts], dim=1) if len(parts) > 1 else parts[0][1]
    xt = torch.from_numpy(x)
    pos = torch.arange(T).view(1, 1, -1).expand(3, B, -1)
    rope = hf.model.rotary_emb(xt, pos)
    attn_mask = None
    if kind == "full_attention":
        attn_mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1).expand(B, 1, T, T)
    out = torch.func.functional_call(hf_layer, tparams, (xt,), {"position_embeddings": rope,
                                                                 "attention_mask": attn_mask})
    mt = torch.from_numpy(mask)
    tloss = ((out * mt - torch.from_numpy(ref) * mt) ** 2).mean()
    tloss.backward()

    np.testing.assert_allclose(float(loss), float(tloss.detach()), rtol=1e-5)
    for u in units:
        for k, leaf in zip(("v", "alpha", "beta"), leaves[u.name]):
            got = np.asarray(grads[u.name][k]).reshape(-1)
            want = leaf.grad.numpy().reshape(-1)
            scale = np.abs(want).max()
            assert scale > 0, f"{u.name}.{k}: zero torch gradient"
            err = np.abs(got - want).max()
            tol = 2e-5 if k == "v" else 1e-3
            assert err <= tol * scale, f"{u.name}.{k}: max |Δ| {err:.3g} vs max |g| {scale:.3g}"
            big = np.abs(want) > 1e-3 * scale
            assert np.array_equal(np.sign(got[big]), np.sign(want[big])), f"{u.name}.{k}: sign differs"
