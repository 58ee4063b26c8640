"""qjax.autoround.qdq against auto-round 0.16.1's own torch functions (forward bits, gradients, searches, MXFP8, KV).

Exactness policy, per output:
- dequantized weights, scales, zero points, q, searched scales, MXFP8 values/scales, KV scales: bit-identical
  (signed zeros compare equal);
- gradients w.r.t. v: bit-identical; w.r.t. alpha/beta: bit-identical for int_sym (the fp16 rounding of each
  partial scale gradient is mirrored); for int_asym the zero point's gradient is an f32 sum over the group that
  auto-round does not round to fp16, so torch's and XLA's summation orders show through: |diff| <= 1e-5 * max|g|
  (measured <= 1.1e-6) and identical signs (what sign-SGD uses).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from qjax.autoround import qdq

ar_int = pytest.importorskip("auto_round.data_type.int")
ar_mx = pytest.importorskip("auto_round.data_type.mxfp")
ar_kv = pytest.importorskip("auto_round.experimental.utils")

_TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
_NP = {"bf16": ml_dtypes.bfloat16, "f32": np.float32, "f16": np.float16}


def _weight(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, spread: bool = False) -> np.ndarray:
    """Random non-zero weight; ``spread`` gives each row its own magnitude (1e-3 .. 1e2) to vary the exponents."""
    w = rng.normal(size=shape).astype(np.float32) * 0.02
    if spread:
        w *= (10.0 ** rng.uniform(-3, 2, size=shape[:-1] + (1,))).astype(np.float32)
    return w.astype(_NP[dtype])


def _tuning(rng: np.random.Generator, w: np.ndarray, gs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """v uniform in (-0.5, 0.5), alpha/beta uniform in [0.5, 1], in qjax's layout."""
    g, size = qdq.group_shape(w.shape, gs)
    lead_n = w.shape[:-1]
    v = rng.uniform(-0.5, 0.5, lead_n + (g, size)).astype(np.float32)
    alpha = rng.uniform(0.5, 1.0, lead_n + (g,)).astype(np.float32)
    beta = rng.uniform(0.5, 1.0, lead_n + (g,)).astype(np.float32)
    return v, alpha, beta


def _f32(x) -> np.ndarray:
    """A JAX/numpy array or a torch tensor as float32 numpy."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy()
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _autoround_int(fn, w: np.ndarray, v, alpha, beta, *, bits, gs, dtype, init_scale=None, weight_r=None):
    """Run auto-round's quant function the way ``WrapperLinear._qdq_weight`` calls it (flat [N*G] scales,
    [N*G, gs] v, tensor_min/max from the grouped weight in its dtype); optionally backprop sum(w_dq * R)."""
    _, size = qdq.group_shape(w.shape, gs)
    wt = torch.from_numpy(w.astype(np.float32)).to(_TORCH[dtype])
    wr = wt.reshape(-1, size)
    tmin, tmax = torch.clamp(wr.min(1)[0], max=0), torch.clamp(wr.max(1)[0], min=0)
    vt = torch.from_numpy(v.reshape(-1, size).copy()).requires_grad_()
    at = torch.from_numpy(alpha.reshape(-1).copy()).requires_grad_()
    bt = torch.from_numpy(beta.reshape(-1).copy()).requires_grad_()
    kw = {}
    if init_scale is not None:
        kw["init_scale"] = torch.from_numpy(np.asarray(init_scale).reshape(-1, 1).copy()).to(_TORCH[dtype])
    out = fn(wt, bits=bits, group_size=gs, v=vt, min_scale=bt, max_scale=at, tensor_min=tmin, tensor_max=tmax, **kw)
    grads = None
    if weight_r is not None:
        (out[0].float() * torch.from_numpy(weight_r)).sum().backward()
        grads = [t.grad.numpy() if t.grad is not None else np.zeros(t.shape, np.float32) for t in (vt, at, bt)]
    return out, grads


# Module-level jit wrappers share their compilation cache across tests (compiling dominates these tests' time).
_search = jax.jit(qdq.search_scales, static_argnames=("bits", "group_size", "handle_zero", "scale_thresh"))
_opt_rtn = jax.jit(qdq.opt_rtn_int_sym, static_argnames=("bits", "group_size", "scale_thresh"))
_mx = jax.jit(qdq.quantize_mxfp8)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "scale_dtype"))
def _sym_and_asym(w, v, alpha, beta, *, bits, group_size, scale_dtype=jnp.float16, init_scale=None):
    """qdq_int_sym and qdq_int_asym in one compilation (the forward sweep has 24 configurations)."""
    wmin, wmax = qdq.weight_minmax(w, group_size)
    kw = dict(bits=bits, group_size=group_size, scale_dtype=scale_dtype)
    return (
        qdq.qdq_int_sym(w, v, alpha, beta, wmin, wmax, init_scale=init_scale, **kw),
        qdq.qdq_int_asym(w, v, alpha, beta, wmin, wmax, **kw),
    )


def _random_init_scale(rng: np.random.Generator, w: np.ndarray, gs: int, bits: int) -> np.ndarray:
    """A stand-in for search_scales' output: the signed full-range scale times U(0.7, 1.3), bf16-representable."""
    _, size = qdq.group_shape(w.shape, gs)
    wg = w.astype(np.float32).reshape(*w.shape[:-1], -1, size)
    gmax = np.take_along_axis(wg, np.abs(wg).argmax(-1)[..., None], -1)[..., 0]
    s0 = -gmax / 2 ** (bits - 1) * rng.uniform(0.7, 1.3, gmax.shape).astype(np.float32)
    return s0.astype(ml_dtypes.bfloat16).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------------
# STE primitives
# ---------------------------------------------------------------------------------------------------------------------
def test_round_ste_half_even_identity_grad():
    x = jnp.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.3, -0.7], jnp.float32)
    np.testing.assert_array_equal(np.asarray(qdq.round_ste(x)), torch.round(torch.tensor(np.asarray(x))).numpy())
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: jnp.sum(qdq.round_ste(x) * 3.0))(x)), 3.0)


def test_clamp_ste_gradient_inclusive_like_torch():
    x = np.array([-3.0, -2.0, -1.0, 0.0, 1.0, 1.5, 2.0], np.float32)
    g = np.asarray(jax.grad(lambda x: jnp.sum(qdq.clamp_ste(x, -2, 1)))(jnp.asarray(x)))
    xt = torch.from_numpy(x).requires_grad_()
    torch.clamp(xt, -2, 1).sum().backward()
    np.testing.assert_array_equal(g, xt.grad.numpy())  # [0, 1, 1, 1, 1, 0, 0]: bounds pass the gradient
    np.testing.assert_array_equal(np.asarray(qdq.clamp_ste(jnp.asarray(x), -2, 1)), np.clip(x, -2, 1))


# ---------------------------------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------------------------------
def test_group_shape_init_params_and_errors():
    assert qdq.group_shape((5, 256), 64) == (4, 64)
    assert qdq.group_shape((3, 5, 256), -1) == (1, 256)
    with pytest.raises(ValueError, match=r"\(5, 100\).*group_size=64"):
        qdq.group_shape((5, 100), 64)
    with pytest.raises(ValueError):
        qdq.group_shape((5, 128), 0)
    p = qdq.init_params(jnp.ones((3, 5, 256), jnp.bfloat16), 64)
    assert p["v"].shape == (3, 5, 4, 64) and p["alpha"].shape == (3, 5, 4) and p["beta"].shape == (3, 5, 4)
    assert all(x.dtype == jnp.float32 for x in p.values())
    assert not np.any(np.asarray(p["v"])) and np.all(np.asarray(p["alpha"]) == 1) and np.all(np.asarray(p["beta"]) == 1)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32))
    wmin, wmax = qdq.weight_minmax(w, 32)
    assert wmin.shape == (3, 2) and np.all(np.asarray(wmin) <= 0) and np.all(np.asarray(wmax) >= 0)
    with pytest.raises(ValueError, match="K % 32"):
        qdq.quantize_mxfp8(jnp.ones((4, 48)))


# ---------------------------------------------------------------------------------------------------------------------
# int_sym / int_asym forward
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qdq_int_forward_bit_identical(dtype: str, bits: int):
    rng = np.random.default_rng(100 + bits)
    for gs in (32, 64, 128, -1):
        shape = (37, 256) if gs != 64 else (3, 7, 128)  # odd N; stacked experts on one group size
        w = _weight(rng, shape, dtype)
        v, alpha, beta = _tuning(rng, w, gs)
        wj = jnp.asarray(w)
        (w_dq, scale, q), asym_out = _sym_and_asym(wj, v, alpha, beta, bits=bits, group_size=gs)
        (ref, ref_scale, _), _ = _autoround_int(
            ar_int.quant_tensor_sym, w, v, alpha, beta, bits=bits, gs=gs, dtype=dtype
        )
        assert w_dq.dtype == wj.dtype and w_dq.shape == w.shape and scale.shape == alpha.shape
        np.testing.assert_array_equal(_f32(w_dq), _f32(ref))
        np.testing.assert_array_equal(np.asarray(scale).reshape(-1), _f32(ref_scale).reshape(-1))
        nmax = 2 ** (bits - 1)
        assert q.dtype == jnp.int32 and int(q.min()) >= -nmax and int(q.max()) <= nmax - 1
        deq = np.asarray(q, np.float32).reshape(v.shape) * np.asarray(scale)[..., None]
        np.testing.assert_array_equal(deq.astype(_NP[dtype]).astype(np.float32), _f32(ref).reshape(v.shape))
        assert np.any(np.asarray(scale) < 0) and np.any(np.asarray(scale) > 0)  # signed scales, both sides dominate

        w_dq, scale, zp, q = asym_out
        (ref, ref_scale, ref_zp), _ = _autoround_int(
            ar_int.quant_tensor_asym, w, v, alpha, beta, bits=bits, gs=gs, dtype=dtype
        )
        np.testing.assert_array_equal(_f32(w_dq), _f32(ref))
        np.testing.assert_array_equal(np.asarray(scale).reshape(-1), _f32(ref_scale).reshape(-1))
        np.testing.assert_array_equal(np.asarray(zp, np.float32).reshape(-1), _f32(ref_zp).reshape(-1))
        assert int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1 and zp.dtype == jnp.int32
        deq = (np.asarray(q, np.float32).reshape(v.shape) - np.asarray(zp, np.float32)[..., None]) * np.asarray(scale)[
            ..., None
        ]
        np.testing.assert_array_equal(deq.astype(_NP[dtype]).astype(np.float32), _f32(ref).reshape(v.shape))


def test_qdq_int_sym_init_scale_bit_identical():
    """alg_ext: s = fp16(init_scale * alpha), beta unused (zero gradient)."""
    rng = np.random.default_rng(7)
    w = _weight(rng, (37, 256), "bf16")
    v, alpha, beta = _tuning(rng, w, 64)
    alpha = alpha * 2 - 0.5  # alg_ext lets alpha roam [0, 2]
    wj = jnp.asarray(w)
    s0 = _random_init_scale(rng, w, 64, 2)
    (w_dq, scale, _), _ = _sym_and_asym(wj, v, alpha, beta, bits=2, group_size=64, init_scale=s0)
    (ref, ref_scale, _), _ = _autoround_int(
        ar_int.quant_tensor_sym, w, v, alpha, beta, bits=2, gs=64, dtype="bf16", init_scale=s0
    )
    np.testing.assert_array_equal(_f32(w_dq), _f32(ref))
    np.testing.assert_array_equal(np.asarray(scale).reshape(-1), _f32(ref_scale).reshape(-1))


def test_scale_floor_and_fp32_scale_dtype():
    """alpha = beta = 0 gives a zero range: the scale is floored at fp16(1e-5) (1e-8 with float32 scales)."""
    rng = np.random.default_rng(3)
    w = _weight(rng, (5, 64), "f32")
    v, alpha, beta = _tuning(rng, w, 32)
    alpha[0], beta[0] = 0.0, 0.0
    wj = jnp.asarray(w)
    for sd, tdt in ((jnp.float16, torch.float16), (jnp.float32, torch.float32)):
        (w_dq, scale, _), _ = _sym_and_asym(wj, v, alpha, beta, bits=4, group_size=32, scale_dtype=sd)
        _, size = qdq.group_shape(w.shape, 32)
        wr = torch.from_numpy(w).reshape(-1, size)
        ref = ar_int.quant_tensor_sym(
            torch.from_numpy(w), bits=4, group_size=32, v=torch.from_numpy(v.reshape(-1, size)),
            min_scale=torch.from_numpy(beta.reshape(-1)), max_scale=torch.from_numpy(alpha.reshape(-1)),
            tensor_min=torch.clamp(wr.min(1)[0], max=0), tensor_max=torch.clamp(wr.max(1)[0], min=0),
            scale_dtype=tdt, q_scale_thresh=1e-8 if sd == jnp.float32 else 1e-5,
        )
        np.testing.assert_array_equal(np.asarray(w_dq), ref[0].numpy())
        np.testing.assert_array_equal(np.asarray(scale).reshape(-1), ref[1].float().numpy().reshape(-1))
        assert float(scale[0, 0]) == (float(np.float16(1e-5)) if sd == jnp.float16 else float(np.float32(1e-8)))


# ---------------------------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------------------------
_GRAD_CASES = [
    # (kind, dtype, bits, group_size, shape)
    ("sym", "bf16", 2, 32, (37, 256)),  # int2: half the levels are clamp bounds
    ("sym", "f32", 4, 128, (37, 256)),
    ("sym", "bf16", 8, -1, (3, 7, 128)),
    ("asym", "bf16", 2, 64, (37, 256)),
    ("asym", "f32", 4, -1, (37, 256)),
    ("alg_ext", "bf16", 2, 64, (37, 256)),
]


@pytest.mark.parametrize("kind,dtype,bits,gs,shape", _GRAD_CASES)
def test_gradients_match_torch_autograd(kind: str, dtype: str, bits: int, gs: int, shape: tuple[int, ...]):
    rng = np.random.default_rng(11 + bits)
    w = _weight(rng, shape, dtype)
    v, alpha, beta = _tuning(rng, w, gs)
    r = rng.normal(size=shape).astype(np.float32)
    wj = jnp.asarray(w)
    wmin, wmax = qdq.weight_minmax(wj, gs)
    s0 = _random_init_scale(rng, w, gs, bits) if kind == "alg_ext" else None

    def loss(v, a, b):
        if kind == "asym":
            out = qdq.qdq_int_asym(wj, v, a, b, wmin, wmax, bits=bits, group_size=gs)
        else:
            out = qdq.qdq_int_sym(wj, v, a, b, wmin, wmax, bits=bits, group_size=gs, init_scale=s0)
        return jnp.sum(out[0].astype(jnp.float32) * r), out[1]

    (gv, ga, gb), scale = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(v, alpha, beta)
    fn = ar_int.quant_tensor_asym if kind == "asym" else ar_int.quant_tensor_sym
    _, (tv, ta, tb) = _autoround_int(fn, w, v, alpha, beta, bits=bits, gs=gs, dtype=dtype, init_scale=s0, weight_r=r)

    np.testing.assert_array_equal(np.asarray(gv).reshape(-1), tv.reshape(-1))
    for got, want in ((ga, ta), (gb, tb)):
        got, want = np.asarray(got).reshape(-1), want.reshape(-1)
        if kind == "asym":
            tol = 1e-5 * np.max(np.abs(want))
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)
            big = np.abs(want) > tol
            np.testing.assert_array_equal(np.sign(got[big]), np.sign(want[big]))
        else:
            np.testing.assert_array_equal(got, want)
    if kind == "alg_ext":
        assert not np.any(np.asarray(gb))  # beta is unused under alg_ext
    if bits == 2 and kind == "sym":
        # Prove the inclusive clamp: round(w/s + v) lands exactly on a bound (-2 or 1) very often, and v there
        # receives the full gradient s * R (jnp.clip would give half, lax.clamp nothing); beyond a bound, nothing.
        x = np.asarray(wj.astype(jnp.float32)).reshape(v.shape) / np.asarray(scale)[..., None] + v
        rounded = np.round(x)
        on_bound, outside = (rounded == -2) | (rounded == 1), (rounded < -2) | (rounded > 1)
        assert on_bound.mean() > 0.3 and outside.any()
        expected = np.asarray(scale)[..., None] * r.astype(_NP[dtype]).astype(np.float32).reshape(v.shape)
        np.testing.assert_array_equal(np.asarray(gv)[on_bound], expected[on_bound])
        assert not np.any(np.asarray(gv)[outside])


# ---------------------------------------------------------------------------------------------------------------------
# search_scales (alg_ext / opt-RTN)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,bits,gs", [("bf16", 2, 32), ("f32", 4, 64), ("bf16", 8, -1)]
)
def test_search_scales_matches_autoround(dtype: str, bits: int, gs: int):
    """Same argmin and bit-identical scales. auto-round searches in the weight's dtype; so does qjax (a bf16
    weight is searched with bf16 candidates, docs/autoround.md §11a), so both dtypes compare exactly."""
    rng = np.random.default_rng(20 + bits)
    shape = (24, 256)
    w = _weight(rng, shape, dtype, spread=True)
    imatrix = rng.uniform(0.01, 50.0, shape[-1]).astype(np.float32)
    s0 = _search(jnp.asarray(w), jnp.asarray(imatrix), bits=bits, group_size=gs)
    _, size = qdq.group_shape(shape, gs)
    wt = torch.from_numpy(w.astype(np.float32)).to(_TORCH[dtype]).reshape(-1, size)
    qw = torch.from_numpy(np.broadcast_to(imatrix, shape).reshape(-1, size).copy())
    ref = ar_int.search_scales(wt, bits, qw)
    # auto-round floors the searched scale at +-q_scale_thresh before use (search_optimized_init_scale)
    ref = torch.where(ref < 0, torch.clamp(ref, max=-1e-5), torch.clamp(ref, min=1e-5))
    assert s0.shape == (shape[0], shape[1] // size) and s0.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s0).reshape(-1), _f32(ref).reshape(-1))
    # the imatrix weighting matters: an unweighted search picks other scales in some groups
    ones = _search(jnp.asarray(w), jnp.ones_like(jnp.asarray(imatrix)), bits=bits, group_size=gs)
    assert not np.array_equal(np.asarray(ones), np.asarray(s0))


def test_search_scales_stacked_experts_use_each_experts_imatrix():
    """Stacked experts ``[E, N, K]`` with their ``[E, K]`` imatrix (what the imatrix collector gives an expert unit)
    search each expert as auto-round searches that expert's own Linear: equal to the per-expert search."""
    rng = np.random.default_rng(27)
    e, shape, gs = 3, (16, 128), 32
    w = np.stack([_weight(rng, shape, "bf16", spread=True) for _ in range(e)])
    imatrix = rng.uniform(0.01, 50.0, (e, shape[-1])).astype(np.float32)
    stacked = np.asarray(_search(jnp.asarray(w), jnp.asarray(imatrix), bits=2, group_size=gs))
    for j in range(e):
        one = _search(jnp.asarray(w[j]), jnp.asarray(imatrix[j]), bits=2, group_size=gs)
        np.testing.assert_array_equal(stacked[j], np.asarray(one))
    assert not np.array_equal(stacked[0], np.asarray(_search(jnp.asarray(w[0]), jnp.asarray(imatrix[1]), bits=2,
                                                            group_size=gs)))


@pytest.mark.parametrize("bits", [2, 4])
def test_opt_rtn_int_sym_matches_autoround(bits: int):
    """opt-RTN (``quant_tensor_opt_rtn_sym``) replaces imatrix zeros before the search: groups with more than
    gs/2 zeros fall back to |w| (int2) or |w| + sqrt(sum(w^2)/32), others get their group mean."""
    rng = np.random.default_rng(30 + bits)
    shape, gs = (24, 256), 32
    w = _weight(rng, shape, "bf16")
    imatrix = rng.uniform(0.1, 5.0, shape[-1]).astype(np.float32)
    imatrix[:20] = 0.0  # group 0: 20 > 16 zeros -> fallback
    imatrix[40:43] = 0.0  # group 1: 3 zeros -> group mean
    imatrix[200] = 0.0  # group 6: 1 zero -> group mean
    w_dq, scale, q = _opt_rtn(jnp.asarray(w), jnp.asarray(imatrix), bits=bits, group_size=gs)
    wt = torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16)
    ref_dq, ref_scale, _ = ar_int.quant_tensor_opt_rtn_sym(
        wt, bits=bits, group_size=gs, imatrix=torch.from_numpy(imatrix)
    )
    np.testing.assert_array_equal(np.asarray(scale).reshape(-1), _f32(ref_scale).reshape(-1))
    np.testing.assert_array_equal(_f32(w_dq), _f32(ref_dq))
    nmax = 2 ** (bits - 1)
    assert int(q.min()) >= -nmax and int(q.max()) <= nmax - 1
    # the zero handling matters: the raw imatrix gives other scales
    raw = _search(jnp.asarray(w), jnp.asarray(imatrix), bits=bits, group_size=gs)
    assert not np.array_equal(np.asarray(raw), np.asarray(scale))


# ---------------------------------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------------------------------
def _check_mx(values, scale, w_dq, ref_dq, ref_exp, w_dtype):
    assert values.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.uint8 and w_dq.dtype == w_dtype
    np.testing.assert_array_equal(np.asarray(scale, np.float32).reshape(-1), _f32(ref_exp).reshape(-1) + 127)
    np.testing.assert_array_equal(_f32(w_dq), _f32(ref_dq))
    # values * 2^(scale - 127) is the dequantized weight, exactly
    exp = np.repeat(np.asarray(scale, np.float32) - 127, 32, axis=-1)
    np.testing.assert_array_equal(np.asarray(values, np.float32) * np.exp2(exp), _f32(ref_dq).reshape(exp.shape))


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_quantize_mxfp8_rtn_matches_quant_mx(dtype: str):
    rng = np.random.default_rng(40)
    w = _weight(rng, (3, 19, 256), dtype, spread=True)  # stacked experts, odd N, exponents across 5 decades
    w[0, 0, :32] = 0  # an all-zero group: shared exponent 1 - 8
    values, scale, w_dq = _mx(jnp.asarray(w))
    ref_dq, ref_exp, _ = ar_mx.quant_mx(
        torch.from_numpy(w.astype(np.float32)).to(_TORCH[dtype]), bits=8, group_size=32, data_type="mx_fp8"
    )
    assert scale.shape == (3, 19, 8)
    _check_mx(values, scale, w_dq, ref_dq, ref_exp, jnp.asarray(w).dtype)
    assert int(scale[0, 0, 0]) == 127 - 7
    assert np.any(np.abs(np.asarray(values, np.float32)) < 2**-6)  # E4M3 subnormals are exercised


@pytest.mark.parametrize("with_zeros", [False, True])
def test_quantize_mxfp8_opt_rtn_matches_quant_mx_opt_rtn(with_zeros: bool):
    rng = np.random.default_rng(41)
    w = _weight(rng, (29, 256), "bf16", spread=True)
    imatrix = rng.uniform(0.01, 100.0, 256).astype(np.float32) ** 2
    if with_zeros:
        imatrix[:20] = 0.0  # > 16 zeros in group 0 -> |w| + sqrt(sum(w^2)/32)
        imatrix[64:66] = 0.0  # 2 zeros in group 2 -> group mean
    values, scale, w_dq = _mx(jnp.asarray(w), jnp.asarray(imatrix))
    ref_dq, ref_exp, _ = ar_mx.quant_mx_opt_rtn(
        torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16), bits=8, group_size=32, data_type="mx_fp8",
        imatrix=torch.from_numpy(imatrix),
    )
    _check_mx(values, scale, w_dq, ref_dq, ref_exp, jnp.bfloat16)
    _, rtn_scale, _ = _mx(jnp.asarray(w))
    assert np.any(np.asarray(rtn_scale) != np.asarray(scale))  # the {1, 0.5, 2} search changed some groups


# ---------------------------------------------------------------------------------------------------------------------
# FP8 KV scale
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_fp8_kv_scale_matches_autoround(dtype: str):
    rng = np.random.default_rng(50)
    x = (rng.normal(size=(2, 9, 4, 16)) * rng.uniform(0.5, 30, size=(1, 1, 4, 1))).astype(np.float32)
    x[:, :, 3] *= 1e-6  # one head below the 1/(448*512) floor
    x = x.astype(_NP[dtype])
    xt = torch.from_numpy(x.astype(np.float32)).to(_TORCH[dtype]).transpose(1, 2)  # auto-round's [B, H, T, D]
    xj = jnp.asarray(x)

    per_tensor = jax.jit(qdq.fp8_kv_scale, static_argnames="per_head")(xj, per_head=False)
    _, ref = ar_kv.per_tensor_fp8_qdq(xt)
    assert per_tensor.shape == (1,) and per_tensor.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(per_tensor), ref.float().numpy().reshape(1))

    per_head = qdq.fp8_kv_scale(xj, per_head=True)
    _, ref = ar_kv.per_head_fp8_qdq(xt)
    assert per_head.shape == (4,)
    np.testing.assert_array_equal(np.asarray(per_head), ref.float().numpy())
    assert float(per_head[3]) == np.float32(1.0 / (448.0 * 512.0))
