"""qjax.model.layers, .moe (routing) and .rope, one module at a time against transformers' own modules
(Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated, Qwen3_5MoeTopKRouter, Qwen3_5MoeTextRotaryEmbedding +
apply_rotary_pos_emb) on random inputs of odd shapes; and the one Linear, dense and packed.

Tolerances: float64 is the truth. The norms' reductions run in a different order than torch's (measured: qjax and
transformers each 0.7–5 float32 ulps from float64, qjax at most 0.3 ulp further than transformers), so qjax may be at
most one ulp (of the output dtype) further from the truth than transformers is. Elementwise paths (the rotation with
the same tables, the router's selection) are compared exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from oracles.hf import odd_text_config, tiny_text_config
from qjax.kernels import QuantMeta, dequantize
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from qjax.model.config import TextConfig
from qjax.model.layers import GatedRMSNorm, Linear, RMSNorm
from qjax.kernels import route
from qjax.model.rope import apply_rope, rope_cos_sin
from qjax.quant.packing import pack_int32

SHAPES = [(1, 1, 8), (3, 7, 64), (2, 33, 96)]
DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}


def _pair(rng, shape, dtypes, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    t = torch.from_numpy(x).to(dtypes[1])
    return jnp.asarray(t.float().numpy()).astype(dtypes[0]), t


def _ulps(got: np.ndarray, want: np.ndarray, dtype) -> float:
    """Largest difference in units of the output dtype's spacing at the reference value."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    if dtype == jnp.bfloat16:
        spacing = spacing * 2.0 ** 16  # bf16 keeps 7 of float32's 23 mantissa bits
    return float(np.max(np.abs(got - want) / np.maximum(spacing, np.finfo(np.float32).tiny)))


def _no_worse_than_transformers(got, hf_out, truth, dtype) -> None:
    ours, theirs = _ulps(got, truth, dtype), _ulps(hf_out, truth, dtype)
    assert ours <= theirs + 1.0, f"qjax {ours:.2f} ulp from float64, transformers {theirs:.2f}"


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_matches_transformers(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x, xt = _pair(rng, shape, DTYPES[dtype], 3.0)
    w = (rng.standard_normal(shape[-1]) * 0.1).astype(np.float32)
    ref = hf.Qwen3_5MoeRMSNorm(shape[-1], eps=1e-6)
    ref.weight.data = torch.from_numpy(w).to(DTYPES[dtype][1])
    norm = RMSNorm(shape[-1], 1e-6, dtype=DTYPES[dtype][0])
    norm.weight[...] = jnp.asarray(ref.weight.data.float().numpy()).astype(DTYPES[dtype][0])
    got = np.asarray(jax.jit(lambda x: norm(x))(x).astype(jnp.float32))
    x64, w64 = _f64(xt), _f64(ref.weight)
    truth = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w64)
    _no_worse_than_transformers(got, ref(xt).float().detach().numpy(), truth, DTYPES[dtype][0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rmsnorm_matches_transformers(shape, dtype):
    rng = np.random.default_rng(7 + sum(shape))
    x, xt = _pair(rng, shape, DTYPES[dtype], 2.0)
    z, zt = _pair(rng, shape, DTYPES[dtype], 2.0)
    w = (1 + rng.standard_normal(shape[-1]) * 0.1).astype(np.float32)
    ref = hf.Qwen3_5MoeRMSNormGated(shape[-1], eps=1e-6).to(DTYPES[dtype][1])
    ref.weight.data = torch.from_numpy(w).to(DTYPES[dtype][1])
    norm = GatedRMSNorm(shape[-1], 1e-6, dtype=DTYPES[dtype][0])
    norm.weight[...] = jnp.asarray(ref.weight.data.float().numpy()).astype(DTYPES[dtype][0])
    got = np.asarray(jax.jit(lambda x, z: norm(x, z))(x, z).astype(jnp.float32))
    x64, z64, w64 = _f64(xt), _f64(zt), _f64(ref.weight)
    truth = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w64 * (z64 / (1 + np.exp(-z64)))
    _no_worse_than_transformers(got, ref(xt, zt).float().detach().numpy(), truth, DTYPES[dtype][0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,tokens", [(8, 2, 5), (6, 3, 17), (256, 8, 9)])
def test_route_matches_the_transformers_router(experts, top_k, tokens, dtype):
    """Same experts in the same order, and the renormalised weights. bf16 logits over 256 experts do tie: where
    routing probabilities are equal either expert is a correct choice (torch's topk does not fix the order of
    ties; qjax takes the lower index), so rows with a tie inside the top k + 1 compare the chosen probabilities."""
    rng = np.random.default_rng(experts + tokens)
    hidden = 32
    x, xt = _pair(rng, (tokens, hidden), DTYPES[dtype])
    w = (rng.standard_normal((experts, hidden)) * 0.3).astype(np.float32)
    cfg = Qwen3_5MoeTextConfig(**{**tiny_text_config(), "num_experts": experts, "num_experts_per_tok": top_k,
                                  "hidden_size": hidden})
    ref = hf.Qwen3_5MoeTopKRouter(cfg).to(DTYPES[dtype][1])
    ref.weight.data = torch.from_numpy(w).to(DTYPES[dtype][1])
    logits, want_w, want_idx = ref(xt)
    got_w, got_idx = jax.jit(lambda lg: route(lg, top_k))(jnp.asarray(logits.float().detach().numpy())
                                                            .astype(DTYPES[dtype][0]))
    lg = _f64(logits)
    probs = torch.softmax(logits.float(), -1).detach().numpy()
    kth = np.sort(probs, -1)[:, ::-1][:, : top_k + 1]
    tied = np.array([len(set(r)) < len(r) for r in kth])
    got_idx = np.asarray(got_idx)
    np.testing.assert_array_equal(got_idx[~tied], want_idx.numpy()[~tied])
    np.testing.assert_array_equal(np.take_along_axis(probs, got_idx, -1),
                                  np.take_along_axis(probs, want_idx.numpy(), -1))
    assert got_w.dtype == DTYPES[dtype][0]
    p = np.exp(lg - lg.max(-1, keepdims=True))
    top = np.take_along_axis(p / p.sum(-1, keepdims=True), want_idx.numpy(), axis=-1)
    truth = top / top.sum(-1, keepdims=True)
    _no_worse_than_transformers(np.asarray(got_w.astype(jnp.float32)), want_w.float().detach().numpy(), truth,
                                DTYPES[dtype][0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["tiny", "odd"])
def test_rope_matches_transformers(which, dtype):
    """cos/sin tables from 3-row M-RoPE positions and the partial rotate-half rotation of q and k."""
    raw = (tiny_text_config if which == "tiny" else odd_text_config)()
    cfg = TextConfig.from_dict(raw)
    hf_cfg = Qwen3_5MoeTextConfig(**raw)
    rng = np.random.default_rng(3)
    b, t = 2, 11
    pos = rng.integers(0, 5000, (3, b, t)).astype(np.int64)
    rot = hf.Qwen3_5MoeTextRotaryEmbedding(hf_cfg)
    jd, td = DTYPES[dtype]
    q, qt = _pair(rng, (b, t, cfg.num_attention_heads, cfg.head_dim), DTYPES[dtype])
    k, kt = _pair(rng, (b, t, cfg.num_key_value_heads, cfg.head_dim), DTYPES[dtype])
    cos_t, sin_t = rot(qt, torch.from_numpy(pos))
    cos, sin = jax.jit(lambda p: rope_cos_sin(cfg, p, jd))(jnp.asarray(pos, jnp.int32))
    # the truth: cos/sin of the exact angles position × θ^(−2j/R), with the M-RoPE row of each frequency
    r = cfg.rotary_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    sec = cfg.mrope_section
    rows = [1 if j % 3 == 1 and j < 3 * sec[1] else 2 if j % 3 == 2 and j < 3 * sec[2] else 0 for j in range(r // 2)]
    ang = np.stack([pos[rows[j], :, :] * inv[j] for j in range(r // 2)], axis=-1)
    ang = np.concatenate([ang, ang], axis=-1)
    for got, theirs, truth in ((cos, cos_t, np.cos(ang)), (sin, sin_t, np.sin(ang))):
        ours = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - truth).max()
        hf_err = np.abs(theirs.double().numpy() - truth).max()
        # both compute the angle as one float32 product (|error| ≤ 2^-24 · 5000 rad), then cos/sin: the libms may
        # differ in the last bit, nothing more
        assert ours <= hf_err + np.finfo(np.float32 if jd == jnp.float32 else jnp.bfloat16).eps, (ours, hf_err)
    want_q, want_k = hf.apply_rotary_pos_emb(qt.transpose(1, 2), kt.transpose(1, 2), cos_t, sin_t)
    # rotate with transformers' own tables, so the rotation itself is compared exactly
    ct, st = (jnp.asarray(a.float().numpy()).astype(jd) for a in (cos_t, sin_t))
    got_q, got_k = jax.jit(lambda q, k: (apply_rope(q, ct, st), apply_rope(k, ct, st)))(q, k)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      want.transpose(1, 2).float().numpy())


@pytest.mark.parametrize("layer", [None, 1])
def test_one_linear_dense_or_packed(layer):
    """The packed Linear computes what the dense Linear does with the dequantized weight (the weight's type picks the
    kernel path; no twin class)."""
    rng = np.random.default_rng(11)
    n, k, g = 24, 96, 32
    meta = QuantMeta("int", 4, g, k, n, strategy="group", scale_dtype="float32")
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = (rng.random((n, k // g)) * 0.05 + 0.01).astype(np.float32)
    packed = Linear(k, n, dtype=jnp.float32, meta=meta)
    dense = Linear(k, n, dtype=jnp.float32)
    p = jnp.asarray(pack_int32(q, 4))
    s = jnp.asarray(scale)
    w = dequantize(p, s, None, meta, jnp.float32)
    if layer is None:
        packed.weight_packed[...], packed.weight_scale[...], dense.weight[...] = p, s, w
    else:  # a [L, …] layer stack, read at `layer`
        packed.weight_packed.set_value(jnp.stack([p * 0, p])), packed.weight_scale.set_value(jnp.stack([s * 0, s]))
        dense.weight.set_value(jnp.stack([w * 0, w]))
    x = jnp.asarray(rng.standard_normal((3, 5, k)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(packed(x, layer)), np.asarray(dense(x, layer)))
    if layer is None:
        np.testing.assert_array_equal(np.asarray(packed.accumulated(x)), np.asarray(dense.accumulated(x)))
    with pytest.raises(ValueError, match=r"quantized shape \[24, 96\] != \[24, 64\]"):
        Linear(64, n, dtype=jnp.float32, meta=meta)
