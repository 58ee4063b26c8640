"""Pallas MoE kernel (kernels/moe_pallas.py) against the plain-JAX oracle (kernels/moe_reference.py).

Numerics run the Pallas kernels in interpret mode on CPU under ``jax.jit``, jitted together with the reference
(compiled once per shape, with XLA's backend optimization level 0: half the compile time); GPU lowering is checked
at "Level A" (docs/kernels.md §6): ``.lower(lowering_platforms=("cuda",))`` under an abstract H200 mesh, no GPU needed.

Tolerances (max |out − ref| / max |ref|):
- fp32 x: 1e-5.  Both sides dequantize bit-identically (fp32 → scale dtype → x dtype) and accumulate in fp32 (IEEE,
  also on GPU: the kernel asks for HIGHEST so Triton does not pick TF32); only the summation order differs (K chunks,
  per-slot combine).  Measured 1.9e-7 … 5e-7, 1.4e-6 at most (mxfp8, N 3).
- bf16 x: 4e-3 (≈ one bf16 ulp of max |ref|).  The kernel rounds gate / up / every silu op / the product to bf16
  exactly where the reference does (measured 8e-8 … 2e-7 for most cases), but an fp32 sum that lands next to a
  bf16 rounding boundary can flip one ulp (2^-8 relative) of a gate / up / act element depending on the summation
  order (measured up to 7.7e-5: int4 g128); the bound leaves room for several flips and for a GPU's exp / division
  differing from XLA CPU's by an ulp, while any real dequant / routing bug is O(1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from h200_util import TRITON_TARGET, lower_for_h200, pallas_grids
from qjax.kernels import moe_pallas
from qjax.kernels.moe_pallas import MoEConfig, _align, _e8m0_to_f32, lowering_cases, moe_config, moe_experts_pallas
from qjax.kernels.moe_reference import moe_experts
from qjax.kernels.quant_meta import QuantMeta, dense_meta

from qjax.quant.packing import e8m0_to_float32

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated:DeprecationWarning"),
]

F32_TOL = 1e-5
BF16_TOL = 4e-3
_XLA_OPTS = {"xla_backend_optimization_level": 0}


# ----------------------------------------------------------------------------------------------------------------
# Random packed experts and routing
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    bits: int
    gu_group: int  # group size along H (gate_up)
    dn_group: int  # group size along I (down)
    symmetric: bool
    strategy: str
    scale_dtype: str
    hidden: int
    inter: int
    experts: int
    top_k: int

    def metas(self) -> tuple[QuantMeta, QuantMeta]:
        gs = {"group": (self.gu_group, self.dn_group)}.get(self.strategy, (self.hidden, self.inter))
        gm = QuantMeta(self.fmt, self.bits, gs[0], self.hidden, 2 * self.inter, self.symmetric, self.strategy,
                       self.scale_dtype)
        dm = QuantMeta(self.fmt, self.bits, gs[1], self.inter, self.hidden, self.symmetric, self.strategy,
                       self.scale_dtype)
        return gm, dm


CASES = {
    # power-of-two shapes with the real checkpoints' group sizes (the chunk / multi-group paths GPUs take)
    "int2_g64": Case("int", 2, 64, 64, True, "group", "float16", 256, 128, 8, 2),
    "int4_g128_asym": Case("int", 4, 128, 128, False, "group", "bfloat16", 256, 128, 8, 2),
    "int8_g32": Case("int", 8, 32, 32, True, "group", "bfloat16", 256, 128, 8, 2),
    "mxfp8": Case("mxfp8", 8, 32, 32, True, "group", "uint8", 256, 128, 8, 2),
    # odd shapes: nothing is a multiple of a tile; masks, partial groups, non-power-of-two groups (generic path)
    "odd_int2_g64_g20": Case("int", 2, 64, 20, True, "group", "float16", 192, 40, 6, 2),
    "odd_int4_asym_g32_g8": Case("int", 4, 32, 8, False, "group", "bfloat16", 96, 40, 6, 3),
    "odd_int8_channel": Case("int", 8, 0, 0, True, "channel", "float32", 96, 40, 6, 3),
    "odd_int4_tensor_asym": Case("int", 4, 0, 0, False, "tensor", "bfloat16", 96, 40, 6, 2),
    "odd_mxfp8": Case("mxfp8", 8, 32, 32, True, "group", "uint8", 160, 96, 6, 2),
}


def _weights(meta: QuantMeta, num_experts: int, rng: np.random.Generator):
    """Random (packed, scale, zero) of ``[E, out, in]``: every bit of every word random, no zero scales."""
    n, k = meta.out_features, meta.in_features
    if meta.fmt == "mxfp8":
        v = rng.standard_normal((num_experts, n, k)).astype(ml_dtypes.float8_e4m3fn)  # finite codes only
        target = 127 - int(np.round(np.log2(np.sqrt(k))))
        s = rng.integers(target - 2, target + 3, (num_experts, n, k // 32)).astype(np.uint8)
        s[rng.random(s.shape) < 0.03] = 0  # E8M0 code 0 = 2^-127 (fp32 subnormal)
        return jnp.asarray(v), jnp.asarray(s), None
    packed = rng.integers(-(2**31), 2**31, (num_experts, n, meta.packed_cols), dtype=np.int64).astype(np.int32)
    shape = (num_experts, *meta.scale_shape)
    base = 1.0 / (np.sqrt(k) * 2 ** (meta.bits - 1))
    scale = (base * rng.uniform(0.5, 1.5, shape)).astype(jnp.dtype(meta.scale_dtype))
    zero = None
    if not meta.symmetric:
        half = 2 ** (meta.bits - 1)
        zero = jnp.asarray(rng.integers(-half, half, shape).astype(np.int8))
    return jnp.asarray(packed), jnp.asarray(scale), zero


def _routing(n: int, case: Case, mode: str, dtype, rng: np.random.Generator):
    """``idx [n, k]`` int32 and softmax routing ``weights [n, k]``."""
    e, k = case.experts, case.top_k
    logits = rng.standard_normal((n, e))
    if mode == "topk":  # distinct experts per token, as a router picks them
        idx = np.argsort(-logits, axis=1)[:, :k]
    elif mode == "dup":  # with replacement: a token may hit one expert twice
        idx = rng.integers(0, e, (n, k))
    elif mode == "empty":  # only experts 1 and e−2: the others get no token
        idx = np.where(rng.random((n, k)) < 0.5, 1, e - 2)
    elif mode == "one_in_all":  # expert 2 is in every token's top-k (spans several M-blocks)
        idx = np.argsort(-logits, axis=1)[:, :k]
        has = (idx == 2).any(axis=1)
        idx[~has, 0] = 2
    elif mode == "all_one":  # every slot routes to expert 2; all other experts empty
        idx = np.full((n, k), 2)
    else:
        raise ValueError(mode)
    idx = idx.astype(np.int32)
    w = jax.nn.softmax(jnp.asarray(np.take_along_axis(logits, idx, axis=1), jnp.float32), axis=-1)
    return jnp.asarray(idx), w.astype(dtype)


def _data(case: Case, n: int, dtype, *, mode: str = "topk", seed: int = 0):
    rng = np.random.default_rng(seed)
    gm, dm = case.metas()
    gu = _weights(gm, case.experts, rng)
    dn = _weights(dm, case.experts, rng)
    x = jnp.asarray(rng.standard_normal((n, case.hidden)), dtype)
    idx, w = _routing(n, case, mode, dtype, rng)
    return x, idx, w, gu, dn


_COMPILED: dict = {}


def _run(case: Case, x, idx, w, gu, dn, config=None):
    """(Pallas interpret, reference) outputs from one jitted function, compiled once per (case, shapes): one XLA
    compile for both is ~20 % cheaper than two."""
    gm, dm = case.metas()
    args = (x, idx, w, gu, dn)
    key = (case, config, jax.tree.map(lambda a: (a.shape, a.dtype), args))
    if key not in _COMPILED:
        def f(x, idx, w, gu, dn):
            return (moe_experts_pallas(x, idx, w, (*gu, gm), (*dn, dm), interpret=True, config=config),
                    moe_experts(x, idx, w, (*gu, gm), (*dn, dm)))
        _COMPILED[key] = jax.jit(f).lower(*args).compile(compiler_options=_XLA_OPTS)
    return _COMPILED[key](*args)


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite kernel output"
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _check(case: Case, n: int, dtype, tol: float, *, mode: str = "topk", seed: int = 0, config=None) -> float:
    x, idx, w, gu, dn = _data(case, n, dtype, mode=mode, seed=seed)
    out, ref = _run(case, x, idx, w, gu, dn, config)
    assert out.shape == (n, case.hidden) and out.dtype == jnp.float32
    err = _rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    return err


# ----------------------------------------------------------------------------------------------------------------
# Numerics (interpret mode)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_f32(name):
    _check(CASES[name], 37, jnp.float32, F32_TOL)


@pytest.mark.parametrize("name, n", [("odd_int2_g64_g20", 1), ("mxfp8", 3)])
def test_decode_sizes_f32(name, n):
    _check(CASES[name], n, jnp.float32, F32_TOL)


def test_small_tiles_f32():
    """A K chunk smaller than the group (16 < 64: one scale per chunk, group index kk // 4), one int32 word per row
    and chunk (int2, bk 16), bm 32 and several column tiles per projection."""
    cfg = MoEConfig(bm=32, gu_bn=16, gu_bk=16, dn_bn=32, dn_bk=32, num_warps=4, num_stages=1)
    _check(CASES["int2_g64"], 37, jnp.float32, F32_TOL, config=cfg)


@pytest.mark.parametrize("mode", ["empty", "one_in_all", "all_one", "dup"])
def test_ragged_routing(mode):
    """Empty experts, one expert in every token (3 M-blocks), all slots on one expert, repeated experts per token
    (same shapes as test_matches_reference_f32's case: the compiled kernel is reused)."""
    _check(CASES["odd_int4_asym_g32_g8"], 37, jnp.float32, F32_TOL, mode=mode, seed=1)


@pytest.mark.parametrize("name", ["odd_int4_asym_g32_g8", "odd_mxfp8"])
def test_matches_reference_bf16(name):
    _check(CASES[name], 37, jnp.bfloat16, BF16_TOL)


def test_grad_matches_reference():
    case = CASES["odd_int4_asym_g32_g8"]
    gm, dm = case.metas()
    x, idx, w, gu, dn = _data(case, 37, jnp.float32, seed=2)
    ct = jnp.asarray(np.random.default_rng(3).standard_normal((37, case.hidden)), jnp.float32)

    def loss(impl):
        def f(x, w):
            if impl == "pallas":
                out = moe_experts_pallas(x, idx, w, (*gu, gm), (*dn, dm), interpret=True)
            else:
                out = moe_experts(x, idx, w, (*gu, gm), (*dn, dm))
            return jnp.sum(out * ct)
        return f

    both = jax.jit(lambda x, w: (jax.grad(loss("pallas"), argnums=(0, 1))(x, w),
                                 jax.grad(loss("reference"), argnums=(0, 1))(x, w)))
    got, want = both.lower(x, w).compile(compiler_options=_XLA_OPTS)(x, w)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_e8m0_scale_bits():
    """In-kernel E8M0 decode is bit-exact with the host decoder (qjax.quant.packing): 0 → 2^-127, 255 → +inf.

    The reference's ``jnp.ldexp`` gives 0 for code 0 on XLA CPU (subnormals flushed); the products with the E4M3
    values are flushed the same way there, so the kernels still match the reference (mxfp8 cases sprinkle code 0).
    """
    s = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(_e8m0_to_f32)(jnp.asarray(s)))
    np.testing.assert_array_equal(got.view(np.uint32), e8m0_to_float32(s).view(np.uint32))
    want = np.asarray(jnp.ldexp(jnp.ones((256,), jnp.float32), jnp.asarray(s, jnp.int32) - 127))
    np.testing.assert_array_equal(got[1:].view(np.uint32), want[1:].view(np.uint32))
    assert got[0].view(np.uint32) == 0x00400000 and np.isposinf(got[255])


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("mode", ["topk", "empty", "all_one", "dup"])
def test_align_blocks(mode, dense):
    """moe_align_block_size invariants (compare-based and sort-based formulations): each M-block one expert, rows
    hold exactly that expert's slots in slot order, empty experts own no block, unused blocks are −1, every slot has
    its own row."""
    case = dataclasses.replace(CASES["odd_int4_asym_g32_g8"], experts=7)
    n, k, e, bm = 37, case.top_k, case.experts, 16
    idx, _ = _routing(n, case, mode, jnp.float32, np.random.default_rng(4))
    blk_expert, row_slot, slot_row = map(np.asarray, jax.jit(_align, static_argnums=(1, 2), static_argnames="dense")(
        idx, e, bm, dense=dense))
    idx = np.asarray(idx)
    s = n * k
    counts = np.bincount(idx.reshape(-1), minlength=e)
    used = int(np.sum(-(-counts // bm)))
    assert blk_expert.shape[0] >= used and np.all(blk_expert[used:] == -1)
    assert sorted(np.unique(blk_expert[:used]).tolist()) == np.flatnonzero(counts).tolist()
    assert np.all(np.diff(blk_expert[:used]) >= 0)
    np.testing.assert_array_equal(row_slot[slot_row], np.arange(s).reshape(n, k))  # slot → row → slot
    np.testing.assert_array_equal(blk_expert[slot_row // bm], idx)  # each slot's row lies in its expert's block
    assert np.sum(row_slot < s) == s and np.all(row_slot[row_slot >= s] == s)  # the rest is padding
    for b in range(used):  # within a block: that expert's slots in slot order, then padding
        blk = row_slot[b * bm:(b + 1) * bm]
        real = blk[blk < s]
        assert np.all(np.diff(real) > 0) and np.all(blk[len(real):] == s)


@pytest.mark.parametrize("mode", ["topk", "dup", "dropped"])
def test_single_token_per_slot_blocks(mode, monkeypatch):
    """One token (batch-1 decode) takes the per-slot layout (block j = slot j, no alignment kernels): the same
    bits as the expert-sorted alignment, equal to the reference, with a token hitting one expert twice and with
    dropped slots (−1 blocks); its invariants."""
    case = CASES["odd_int4_asym_g32_g8"]
    gm, dm = case.metas()
    x, idx, w, gu, dn = _data(case, 1, jnp.float32, mode="dup" if mode == "dup" else "topk", seed=6)
    k, bm = case.top_k, 16
    if mode == "dup":
        idx = idx.at[0, 1].set(idx[0, 0])
    if mode == "dropped":
        idx = idx.at[0, 0].set(-1).at[0, k - 1].set(case.experts + 2)
    kept = (np.asarray(idx) >= 0) & (np.asarray(idx) < case.experts)
    blk_expert, row_slot, slot_row = map(np.asarray, _align(idx, case.experts, bm))
    assert blk_expert.shape == (k,) and row_slot.shape == (k * bm,)
    np.testing.assert_array_equal(blk_expert, np.where(kept[0], np.asarray(idx)[0], -1))
    np.testing.assert_array_equal(row_slot[slot_row[kept]], np.flatnonzero(kept.reshape(-1)))
    assert np.all(slot_row[~kept] >= k * bm) and np.sum(row_slot < k) == k

    def run():
        return np.asarray(jax.jit(lambda x, idx, w: moe_experts_pallas(
            x, idx, w, (*gu, gm), (*dn, dm), interpret=True))(x, idx, w))

    per_slot = run()
    monkeypatch.setattr(moe_pallas, "_align", functools.partial(_align, per_slot=False))
    np.testing.assert_array_equal(per_slot, run())
    want = moe_experts(x, jnp.where(jnp.asarray(kept), idx, 0), jnp.where(jnp.asarray(kept), w, 0.0),
                       (*gu, gm), (*dn, dm))
    assert _rel_err(per_slot, want) <= F32_TOL
    with pytest.raises(ValueError, match="per-slot layout needs one token"):
        _align(jnp.zeros((2, k), jnp.int32), case.experts, bm, per_slot=True)


# ----------------------------------------------------------------------------------------------------------------
# Unquantized experts (fmt="dense": the BF16 original model) through the same kernels
# ----------------------------------------------------------------------------------------------------------------


def _dense_data(n: int, dtype, *, hidden=96, inter=40, experts=6, top_k=3, seed=0, w_dtype=None):
    rng = np.random.default_rng(seed)
    w_dtype = w_dtype or dtype
    gu = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden), w_dtype)
    dn = jnp.asarray(rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter), w_dtype)
    x = jnp.asarray(rng.standard_normal((n, hidden)), dtype)
    case = dataclasses.replace(CASES["odd_int4_asym_g32_g8"], hidden=hidden, inter=inter, experts=experts,
                               top_k=top_k)
    idx, w = _routing(n, case, "topk", dtype, rng)
    metas = (dense_meta(2 * inter, hidden, w_dtype), dense_meta(hidden, inter, w_dtype))
    return x, idx, w, gu, dn, metas


@pytest.mark.parametrize("n, dtype, w_dtype", [(37, jnp.float32, None), (1, jnp.float32, None),
                                               (37, jnp.bfloat16, None), (5, jnp.float32, jnp.bfloat16)])
def test_dense_experts_match_reference(n, dtype, w_dtype):
    """Unquantized expert stacks (odd H, I; bf16 weights under fp32 activations too) give the reference's result:
    f32 within F32_TOL, bf16 within BF16_TOL (a bf16 ulp of the largest output: the kernels round act to bf16 at
    the same points as the reference, the fp32 sums differ in order)."""
    x, idx, w, gu, dn, (gm, dm) = _dense_data(n, dtype, w_dtype=w_dtype, seed=n)
    f = jax.jit(lambda x, idx, w, gu, dn: (
        moe_experts_pallas(x, idx, w, (gu, None, None, gm), (dn, None, None, dm), interpret=True),
        moe_experts(x, idx, w, (gu, None, None, gm), (dn, None, None, dm))))
    out, ref = f(x, idx, w, gu, dn)
    # the reference itself against plain float64 math (bf16 weights are exact in float64)
    xs, g64, d64 = (np.asarray(a, np.float64) for a in (x, gu, dn))
    want = np.zeros((n, xs.shape[1]))
    for t in range(n):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = np.split(g64[e] @ xs[t], 2)
            want[t] += float(w[t, j]) * (d64[e] @ (gate / (1 + np.exp(-gate)) * up))
    if dtype == jnp.float32:  # (bf16 rounds act on the way: both the reference and the kernels, not float64)
        assert _rel_err(ref, want) <= F32_TOL
    assert _rel_err(out, ref) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)


def test_dense_experts_grads():
    """The dense weight stacks are trainable through the kernels: gradients w.r.t. x, the routing weights and both
    weight stacks — read inside a [G, E, …] layer stack at layer 1 — equal the reference's."""
    from qjax.kernels import moe_experts as entry

    x, idx, w, gu, dn, (gm, dm) = _dense_data(7, jnp.float32, seed=9)
    gus, dns = jnp.stack([gu * 0.5, gu, -gu]), jnp.stack([dn, dn * 2, dn])  # layer 1 is (gu, dn)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)

    def loss(impl):
        def f(x, w, gus, dns):
            out = entry(x, idx, w, (gus, None, None, gm), (dns, None, None, dm), impl=impl, layer=jnp.int32(1))
            return jnp.sum(out * ct)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

    (v_k, g_k), (v_r, g_r) = loss("interpret")(x, w, gus, dns), loss("reference")(x, w, gus, dns)
    np.testing.assert_allclose(v_k, v_r, rtol=1e-5)
    for a, b in zip(g_k, g_r):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(g_k[2][1]).max()) > 0 and float(jnp.abs(g_k[2][0]).max()) == 0  # only layer 1 is read


def test_half_quantized_experts():
    """Packed gate_up with a dense down (what auto-round / llm-compressor leave when I is not a multiple of the
    group: W4G128 with a 40-wide intermediate here) runs the kernels with one meta each: equal to the reference."""
    case = CASES["odd_int4_asym_g32_g8"]
    gm, _ = case.metas()
    x, idx, w, gu, _ = _data(case, 37, jnp.float32, seed=12)
    dn = jnp.asarray(np.random.default_rng(13).standard_normal((case.experts, case.hidden, case.inter)) * 0.1,
                     jnp.float32)
    dm = dense_meta(case.hidden, case.inter, jnp.float32)
    out, ref = jax.jit(lambda x, idx, w: (
        moe_experts_pallas(x, idx, w, (*gu, gm), (dn, None, None, dm), interpret=True),
        moe_experts(x, idx, w, (*gu, gm), (dn, None, None, dm))))(x, idx, w)
    assert _rel_err(out, ref) <= F32_TOL


def test_dense_experts_bad_shapes():
    x, idx, w, gu, dn, (gm, dm) = _dense_data(3, jnp.float32)
    with pytest.raises(ValueError, match=r"gate_up: a dense weight is \[E, 80, 96\] with no scale or zero"):
        moe_experts_pallas(x, idx, w, (gu, jnp.ones((6, 80, 1)), None, gm), (dn, None, None, dm), interpret=True)


def test_config_tiles():
    gm, dm = QuantMeta("int", 2, 64, 2048, 1024), QuantMeta("int", 2, 64, 512, 2048)
    dec, pre = moe_config(8, 256, 2048, 512, gm, dm), moe_config(4096, 256, 2048, 512, gm, dm)
    assert (dec.bm, dec.gu_bn, dec.gu_bk, dec.dn_bn, dec.dn_bk) == (16, 32, 128, 64, 128)
    assert (pre.bm, pre.gu_bn) == (32, 64)
    assert moe_config(65536, 256, 2048, 512, gm, dm).bm == 64
    for cfg in (dec, pre):
        for v in dataclasses.astuple(cfg)[:5]:
            assert v >= 16 and v & (v - 1) == 0


# ----------------------------------------------------------------------------------------------------------------
# GPU lowering, Level A (abstract H200, Triton custom call in the StableHLO)
# ----------------------------------------------------------------------------------------------------------------



def _odd_lowering_cases():
    """Masked / generic-group / tensor-strategy paths (odd shapes) — they never occur in the real model, but
    must obey the Triton lowering rules too."""
    out = []
    for name in ("odd_int2_g64_g20", "odd_int4_asym_g32_g8", "odd_int4_tensor_asym", "odd_mxfp8"):
        case = CASES[name]
        gm, dm = case.metas()
        x, idx, w, gu, dn = _data(case, 37, jnp.float32)
        ng = len([a for a in gu if a is not None])

        def fn(x, idx, w, *arrays, _gm=gm, _dm=dm, _ng=ng):
            gu_, dn_ = arrays[:_ng], arrays[_ng:]
            gu_ = (*gu_, None) if len(gu_) == 2 else gu_
            dn_ = (*dn_, None) if len(dn_) == 2 else dn_
            return moe_experts_pallas(x, idx, w, (*gu_, _gm), (*dn_, _dm), interpret=False)

        arrays = (x, idx, w, *[a for a in (*gu, *dn) if a is not None])
        out.append((f"odd_{name}", fn, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)))
    return out


_LOWERING = {name: (fn, specs) for name, fn, specs in lowering_cases()}


def test_lowering_cases_cover_the_matrix():
    names = set(_LOWERING)
    assert len(names) == 20
    for scheme in ("int2_g64", "int4_g128", "int8_g32", "mxfp8", "bf16"):
        for label in ("decode1", "decode8", "prefill512", "routed_decode1"):
            assert f"moe_{scheme}_{label}" in names
    _, specs = _LOWERING["moe_int2_g64_prefill512"]
    assert specs[0].shape == (512, 2048) and specs[1].shape == (512, 8)
    assert specs[3].shape == (256, 1024, 128) and specs[5].shape == (256, 2048, 32)  # int2: 16 values per word
    _, specs = _LOWERING["moe_bf16_decode1"]
    assert [a.shape for a in specs[3:]] == [(256, 1024, 2048), (256, 2048, 512)] and specs[3].dtype == jnp.bfloat16
    _, specs = _LOWERING["moe_int2_g64_routed_decode1"]
    assert specs[1].shape == (1, 256) and specs[2].shape == (256, 1024, 128)  # router logits, then the weights


@pytest.mark.parametrize("name", list(_LOWERING))
def test_lowers_for_h200(name):
    fn, specs = _LOWERING[name]
    text = lower_for_h200(fn, specs)
    assert text.count(TRITON_TARGET) == 2  # gate_up and down kernels
    assert "mosaic_gpu" not in text


@pytest.mark.parametrize("name, fn, specs", [pytest.param(*c, id=c[0]) for c in _odd_lowering_cases()])
def test_odd_shapeslower_for_h200(name, fn, specs):
    assert lower_for_h200(fn, specs).count(TRITON_TARGET) == 2


@pytest.mark.parametrize("n", [37, 3])
@pytest.mark.slow  # > 7 s on 2 cores: out of the fast loop (RESULTS.md, suite time)
def test_dropped_slots(n):
    """Ids outside [0, E) (how expert parallelism passes other devices' experts) add nothing: equal to the same
    routing with those slots' weights zeroed — for the Pallas kernels (both alignments) and every reference path."""
    from qjax.kernels.moe_reference import experts_blocked, experts_gather, experts_grouped
    from qjax.kernels.qmatmul_reference import dequantize_experts

    case = CASES["odd_int4_asym_g32_g8"]
    x, idx, w, gu, dn = _data(case, n, jnp.float32, seed=3)
    gm, dm = case.metas()
    drop = np.random.default_rng(5).random(idx.shape) < 0.5
    dropped = jnp.where(drop, jnp.where(jnp.asarray(drop[:, :1]), -1, case.experts + 3), idx)
    zeroed = jnp.where(drop, 0.0, w)
    want = moe_experts(x, idx, zeroed, (*gu, gm), (*dn, dm))
    out, ref = _run(case, x, dropped, w, gu, dn)
    assert _rel_err(ref, want) <= 1e-6 and _rel_err(out, want) <= F32_TOL
    gfn = lambda sel: dequantize_experts(*gu, gm, sel, jnp.float32)  # noqa: E731
    dfn = lambda sel: dequantize_experts(*dn, dm, sel, jnp.float32)  # noqa: E731
    for path in (experts_blocked, experts_grouped):
        assert _rel_err(path(x, dropped, w, gfn, dfn, case.experts), want) <= 1e-6, path.__name__
    assert _rel_err(experts_gather(x, dropped, w, gfn, dfn, case.experts), want) <= 1e-6
    for dense in (True, False):
        blk_expert, row_slot, slot_row = map(np.asarray, _align(dropped, case.experts, 16, dense=dense))
        kept = ~drop
        assert np.all(slot_row[drop] >= row_slot.shape[0])
        assert np.sum(row_slot < n * case.top_k) == kept.sum()  # no row for a dropped slot
        np.testing.assert_array_equal(row_slot[slot_row[kept]], np.flatnonzero(kept.reshape(-1)))


@pytest.mark.parametrize("name, n", [("odd_int2_g64_g20", 1), ("odd_int4_asym_g32_g8", 7), ("mxfp8", 3)])
def test_xla_baseline_matches_reference(name, n):
    """The benchmarks' plain-XLA baseline (``impl="xla"``: every expert dequantized, then ragged_dot) computes the
    same function as the reference, dropped slots included (f32: both sum k fp32 products per output)."""
    from qjax.kernels import moe_experts as entry

    case = CASES[name]
    x, idx, w, gu, dn = _data(case, n, jnp.float32, seed=11)
    idx = idx.at[0, 0].set(-1)  # one dropped slot
    gm, dm = case.metas()
    ref = entry(x, idx, w, (*gu, gm), (*dn, dm), impl="reference")
    out = entry(x, idx, w, (*gu, gm), (*dn, dm), impl="xla")
    assert _rel_err(out, ref) <= 1e-6


def test_kernel_scope():
    """``qjax.kernels.use`` picks the implementation for calls traced inside it, nests, restores, and names the
    choices when given a wrong one."""
    from qjax.kernels import IMPLS, resolve, use

    outside = resolve()
    with use("xla"):
        assert resolve() == "xla"
        with use("interpret"):
            assert resolve() == "interpret"
        assert resolve() == "xla" and resolve("reference") == "reference"
    assert resolve() == outside
    with pytest.raises(ValueError, match="kernel implementation must be one of") as e:
        with use("triton"):
            pass
    assert all(i in str(e.value) for i in IMPLS)


@pytest.mark.parametrize("impl", ["reference", "xla", "interpret"])
@pytest.mark.parametrize("n", [1, 9])
def test_expert_group_in_stack(impl, n):
    """``layer=g`` reads layer g's experts inside a ``[G, E, …]`` stack (how the model's layer scan passes them, so
    the layer's experts are not copied out): equal to the same call on the sliced layer, dropped slots included."""
    from qjax.kernels import moe_experts as entry

    case = CASES["odd_int4_asym_g32_g8"]
    gm, dm = case.metas()
    layers = [_data(case, n, jnp.float32, seed=20 + i) for i in range(3)]
    x, idx, w = layers[0][:3]
    idx = idx.at[0, -1].set(-1)
    stack = [tuple(None if a[0] is None else jnp.stack(a) for a in zip(*(lay[j] for lay in layers)))
             for j in (3, 4)]
    for g in (0, 2):
        want = entry(x, idx, w, (*layers[g][3], gm), (*layers[g][4], dm), impl="reference")
        got = jax.jit(lambda g_: entry(x, idx, w, (*stack[0], gm), (*stack[1], dm), impl=impl, layer=g_))(g)
        assert _rel_err(got, want) <= (1e-6 if impl != "interpret" else F32_TOL), (impl, g)


def _routed_data(case: Case, dtype, *, seed: int, ties: bool = False, layers: int = 1):
    """One token's x, router logits ``[1, E]`` (``ties``: logits repeated, so probabilities tie inside and at the
    edge of the top-k) and ``layers`` layers' expert stacks (``[G, E, …]`` when layers > 1)."""
    rng = np.random.default_rng(seed)
    gm, dm = case.metas()
    per = [(_weights(gm, case.experts, rng), _weights(dm, case.experts, rng)) for _ in range(layers)]
    x = jnp.asarray(rng.standard_normal((1, case.hidden)), dtype)
    logits = rng.standard_normal((1, case.experts)) * 2
    if ties:  # experts 2i and 2i + 1 tie: with an odd k one pair straddles the top-k's edge
        logits = np.repeat(logits[:, : -(-case.experts // 2)], 2, axis=1)[:, : case.experts]
    gu, dn = per[0] if layers == 1 else (
        tuple(None if a[0] is None else jnp.stack(a) for a in zip(*(p[j] for p in per))) for j in (0, 1))
    return x, jnp.asarray(logits, dtype), gu, dn, per


@pytest.mark.parametrize("name, dtype, ties", [("odd_int4_asym_g32_g8", jnp.float32, False),
                                               ("odd_int4_asym_g32_g8", jnp.bfloat16, True),
                                               ("odd_mxfp8", jnp.bfloat16, False)])
def test_routed_one_token_matches_reference(name, dtype, ties):
    """One decode token routed inside the kernels (softmax, top-k with ties to the lower id, renormalised weights
    rounded to the logits' dtype, recomputed by every program) equals the reference routing + experts: E and k off
    powers of two, bf16 logits with tied probabilities; one compile for both sides."""
    from qjax.kernels import moe_routed

    case = CASES[name]
    gm, dm = case.metas()
    x, logits, gu, dn, _ = _routed_data(case, dtype, seed=31, ties=ties)
    got, want = jax.jit(lambda x, lg: tuple(moe_routed(x, lg, case.top_k, (*gu, gm), (*dn, dm), impl=i)
                                            for i in ("interpret", "reference")))(x, logits)
    assert got.shape == (1, case.hidden) and got.dtype == jnp.float32
    assert _rel_err(got, want) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)


def test_routed_one_token_in_stack_and_grads():
    """In a ``[G, E, …]`` stack (``layer=g``: the experts offset inside the kernels) the routed call equals the
    reference on the sliced layer, with the per-slot grids of one layer; its gradients (x, logits) are the
    reference's (the backward runs through the reference routing)."""
    from qjax.kernels import moe_routed

    case = CASES["odd_int4_asym_g32_g8"]
    gm, dm = case.metas()
    x, logits, gu, dn, per = _routed_data(case, jnp.float32, seed=32, layers=3)

    def loss(impl, g):
        return lambda x, lg: jnp.sum(jnp.sin(moe_routed(x, lg, case.top_k, (*gu, gm), (*dn, dm), impl=impl,
                                                        layer=g)))

    for g in (0, 2):
        want = moe_routed(x, logits, case.top_k, (*per[g][0], gm), (*per[g][1], dm), impl="reference")
        got = jax.jit(lambda x, lg, g_: moe_routed(x, lg, case.top_k, (*gu, gm), (*dn, dm), impl="interpret",
                                                   layer=g_))(x, logits, g)
        assert _rel_err(got, want) <= F32_TOL, g
    grads = jax.jit(lambda x, lg: (jax.grad(loss("interpret", 1), (0, 1))(x, lg),
                                   jax.grad(loss("reference", 1), (0, 1))(x, lg)))(x, logits)
    for got, want in zip(*grads):
        assert _rel_err(got, want) <= F32_TOL
    grids = pallas_grids(lambda x, lg, g: moe_routed(x, lg, case.top_k, (*gu, gm), (*dn, dm), impl="interpret",
                                                      layer=g), x, logits, jnp.int32(1))
    cfg = moe_config(case.top_k, case.experts, case.hidden, case.inter, gm, dm)
    assert [g for _, g in grids] == [(case.top_k, -(-case.inter // cfg.gu_bn)),
                                     (case.top_k, -(-case.hidden // cfg.dn_bn))]


@pytest.mark.parametrize("n", [1, 8])
def test_stack_grid_is_one_layer(n):
    """Layer g's experts are reached by an expert offset into the flattened ``[G·E, …]`` stacks, so the grids are
    those of the same call on one layer's ``[E, …]`` experts, ``(B, ⌈I/bn⌉)`` and ``(B, ⌈H/bn⌉)`` with B the
    routed M-blocks (at one token: its k slots, every block working), whatever G is (real shapes, int2 g64)."""
    from qjax.kernels import moe_experts as entry

    sds = jax.ShapeDtypeStruct
    h, i, e, k = moe_pallas.QWEN36_HIDDEN, moe_pallas.QWEN36_INTER, moe_pallas.QWEN36_EXPERTS, moe_pallas.QWEN36_TOP_K
    gm = QuantMeta("int", 2, 64, h, 2 * i, True, "group", "float16")
    dm = QuantMeta("int", 2, 64, i, h, True, "group", "float16")
    head = (sds((n, h), jnp.bfloat16), sds((n, k), jnp.int32), sds((n, k), jnp.bfloat16))

    def weights(lead):
        return [sds((*lead, e, mt.out_features, mt.packed_cols), jnp.int32) for mt in (gm, dm)], \
            [sds((*lead, e, *mt.scale_shape), jnp.float16) for mt in (gm, dm)]

    (gp, dp), (gs, ds) = weights(())
    alone = pallas_grids(lambda x, idx, w, gp, gs, dp, ds: moe_experts_pallas(
        x, idx, w, (gp, gs, None, gm), (dp, ds, None, dm), interpret=True), *head, gp, gs, dp, ds)
    cfg = moe_config(n * k, e, h, i, gm, dm)
    blocks = k if n == 1 else moe_pallas._num_blocks(n * k, e, cfg.bm)
    assert [g for _, g in alone] == [(blocks, -(-i // cfg.gu_bn)), (blocks, -(-h // cfg.dn_bn))]
    (gp, dp), (gs, ds) = weights((10,))
    stacked = pallas_grids(lambda x, idx, w, gp, gs, dp, ds, g: entry(
        x, idx, w, (gp, gs, None, gm), (dp, ds, None, dm), impl="interpret", layer=g),
        *head, gp, gs, dp, ds, sds((), jnp.int32))
    assert stacked == alone


@pytest.mark.parametrize("n, experts, top_k, h, inter", [(37, 5, 2, 24, 12), (200, 32, 4, 64, 32), (3, 8, 3, 16, 8),
                                                      (20, 1, 1, 16, 8)])
def test_blocked_gradient_of_dense_stacks(x64, n, experts, top_k, h, inter):
    """The blocked path's own backward pass for dense expert stacks (weight gradients added into each block's expert
    in place) equals JAX's autodiff of the grouped ``ragged_dot`` path, for x, the routing weights and both stacks —
    with a dropped slot, experts that get no rows (3 tokens × 3 of 8) and blocks padded past the routed rows. float64:
    the two sum the same products in different orders (measured max relative difference ≤ 1e-14)."""
    from qjax.kernels.moe_reference import as_weight_fn, experts_blocked, experts_grouped

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(n, h)))
    idx = jnp.asarray(np.argsort(rng.random((n, experts)), 1)[:, :top_k], jnp.int32).at[0, 0].set(-1)
    w = jnp.asarray(rng.random((n, top_k)))
    gu = jnp.asarray(rng.normal(size=(experts, 2 * inter, h)) / np.sqrt(h))
    dn = jnp.asarray(rng.normal(size=(experts, h, inter)) / np.sqrt(inter))
    probe = jnp.asarray(rng.normal(size=(n, h)))  # a loss whose gradient differs per output element

    def grads(path, wrap):
        def loss(x, w, gu, dn):
            out = path(x, idx, w, wrap(gu), wrap(dn), experts)
            return jnp.sum(out * probe)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, gu, dn)

    want = grads(experts_grouped, as_weight_fn)
    for wrap in (lambda a: a, as_weight_fn):  # dense stacks (own backward); WeightFns (autodiff through the scan)
        for got, ref, name in zip(grads(experts_blocked, wrap), want, ("x", "weights", "gate_up", "down")):
            assert _rel_err(got, ref) <= 1e-12, name


@pytest.mark.parametrize("n, experts, top_k, sizes", [(512, 32, 4, None), (37, 5, 2, None), (3, 8, 3, None),
                                                     (300, 16, 8, None), (64, 256, 8, None), (20, 1, 1, None),
                                                     (512, 32, 4, (64, 32, 16)), (300, 16, 8, (128, 8))])
def test_block_layout_places_every_slot_once(n, experts, top_k, sizes):
    """The blocked path's layout: every routed slot in exactly one row, every row of a block routed to the block's
    expert, no rows past ``used``, at most one block of a middle size and fewer blocks of the last size than fit in
    one block of the size before, and fewer padding rows per expert than the last size (dropped slots, ids outside
    [0, E), get no row) — for the default sizes and for sizes given."""
    from qjax.kernels.moe_reference import _block_layout, block_sizes

    rng = np.random.default_rng(n + experts)
    idx = np.argsort(rng.random((n, experts)), 1)[:, :top_k].astype(np.int32)
    idx[0, 0], idx[-1, -1] = -1, experts + 2
    flat = idx.reshape(-1)
    layout = jax.jit(_block_layout, static_argnums=(1, 2))(jnp.asarray(idx), experts, sizes)
    sizes = sizes or block_sizes(n * top_k, experts)
    assert len(layout) == len(sizes) and sizes[-1] >= 8
    seen = np.zeros(flat.shape, int)
    padding = np.zeros(experts, int)
    for i, ((rows, blk_expert, used), block) in enumerate(zip(layout, sizes)):
        rows, blk_expert, used = np.asarray(rows).reshape(-1, block), np.asarray(blk_expert), int(used)
        assert np.all(rows[used:] == -1)
        for b in range(used):
            r = rows[b][rows[b] >= 0]
            assert r.size and np.all(flat[r] == blk_expert[b])
            np.add.at(seen, r, 1)
            padding[blk_expert[b]] += block - r.size
        if i:
            limit = 1 if i < len(sizes) - 1 else sizes[i - 1] // block - 1
            assert np.all(np.bincount(blk_expert[:used], minlength=experts) <= limit)
    valid = (flat >= 0) & (flat < experts)
    np.testing.assert_array_equal(seen, valid.astype(int))
    assert np.all(padding < sizes[-1])


def test_blocked_path_with_sizes_given_computes_the_same():
    """The layout's sizes change which rows share a matmul, not the result: the default two sizes, three sizes (the
    benchmarks' comparison) and one size equal the gather path to f32 rounding; sizes that are not descending powers
    of two are refused."""
    from qjax.kernels.moe_reference import as_weight_fn, experts_blocked, experts_gather

    rng = np.random.default_rng(7)
    n, experts, top_k, h, inter = 200, 32, 4, 32, 16
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.random((n, experts)), 1)[:, :top_k], jnp.int32).at[0, 0].set(-1)
    w = jnp.asarray(rng.random((n, top_k)), jnp.float32)
    gu = as_weight_fn(jnp.asarray(rng.normal(size=(experts, 2 * inter, h)) / np.sqrt(h), jnp.float32))
    dn = as_weight_fn(jnp.asarray(rng.normal(size=(experts, h, inter)) / np.sqrt(inter), jnp.float32))
    want = experts_gather(x, idx, w, gu, dn, experts)
    for sizes in (None, (32, 16, 8), (8,), (64, 8)):
        got = jax.jit(lambda x: experts_blocked(x, idx, w, gu, dn, experts, sizes))(x)
        assert _rel_err(got, want) <= 1e-6, sizes
    for bad in ((16, 32), (24, 8), (16, 16)):
        with pytest.raises(ValueError, match="descending powers of two"):
            experts_blocked(x, idx, w, gu, dn, experts, bad)
