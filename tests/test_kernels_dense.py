"""Pallas-Triton dense dequant matmul (kernels/qmatmul_pallas.py) vs the plain-JAX reference
(kernels/qmatmul_reference.py).

Numerics run the real kernels in Pallas interpret mode on CPU, always under ``jax.jit`` (compiled with cheap XLA
options: the interpret-mode graphs are compile-bound). Random data everywhere: random int32 words (every bit
pattern), random scales, random zero points, random E4M3 bytes (NaN encodings excluded) and E8M0 exponents.
Shapes are odd on purpose (M ∈ {1, 5, 37}, N ∈ {24, 200}, K = 3 or 5 groups): nothing is a block multiple.

Tolerances:
- float32 x: ``max|y − ref| ≤ 1e-5 · max|ref|`` (measured ≤ 6e-7: the dequantized weights are bit-identical, only
  the fp32 summation order differs between the tiled kernel, its split-K partials and XLA's dot).
- bfloat16 x: kernel and reference both accumulate in fp32 and round once to bf16, so they may differ by one bf16
  ulp (2^-8…2^-7 relative, ≈ 0.4 %) where the two fp32 sums straddle a rounding boundary, plus fp32-order noise
  where the sum cancels to near zero: ``|y − ref| ≤ ulp(ref) + 1e-5·max|ref|`` and ≥ 97 % identical (measured: all
  identical).
- gradients w.r.t. x: the backward pass is plain JAX, same tolerances (measured: identical).

Level A: every ``lowering_cases()`` entry lowers for CUDA under an abstract H200 mesh to the Triton custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from h200_util import TRITON_TARGET, lower_for_h200, pallas_grids
from qjax.kernels import qmatmul_pallas as qp
from qjax.kernels import qmatmul_reference as reference
from qjax.kernels.qmatmul_pallas import KernelConfig, choose_config, lowering_cases, qmatmul_pallas
from qjax.kernels.quant_meta import QuantMeta, dense_meta

# jax ≥ 0.11 deprecates the Pallas Triton backend (id ``jax-pallas-triton``, docs/kernels.md §3)
pytestmark = [
    pytest.mark.interpret,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

# Interpret-mode kernels are big loop nests: compile them cheaply (numerics are unaffected).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
F32_RTOL = 1e-5


def run_jit(fn, *args):
    """``jax.jit(fn)(*args)``, compiled with :data:`FAST`."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)(*args)


def kernel(x, packed, scale, zero, meta, config=None):
    return run_jit(lambda x, p, s, z: qmatmul_pallas(x, p, s, z, meta, interpret=True, config=config),
                   x, packed, scale, zero)


def ref_qmatmul(x, packed, scale, zero, meta):
    """The oracle, :func:`kernels.qmatmul_reference.qmatmul`, jitted (op-by-op dispatch would recompile every op per
    shape)."""
    return run_jit(lambda x, p, s, z: reference.qmatmul(x, p, s, z, meta), x, packed, scale, zero)


def exact_f64(x, packed, scale, zero, meta):
    """Second oracle: the reference's dequantized weight materialized in its scale dtype, then x @ wᵀ in float64."""
    sd = jnp.bfloat16 if meta.fmt == "mxfp8" else jnp.dtype(meta.scale_dtype)
    w = run_jit(lambda p, s, z: reference.dequantize(p, s, z, meta, sd), packed, scale, zero)
    w = np.asarray(w, np.float64).astype(np.asarray(x).dtype).astype(np.float64)  # cast to x.dtype, as the contract
    return np.asarray(x, np.float64) @ w.T


def make_meta(fmt="int", bits=4, group=128, k=384, n=200, symmetric=True, scale_dtype="bfloat16"):
    if fmt == "mxfp8":
        return QuantMeta("mxfp8", 8, 32, k, n, scale_dtype="uint8")
    strategy = group if group in ("channel", "tensor") else "group"
    return QuantMeta("int", bits, k if strategy != "group" else group, k, n, symmetric=symmetric,
                     strategy=strategy, scale_dtype=scale_dtype)


def make_weight(meta: QuantMeta, rng: np.random.Generator, *, e8m0=(118, 134)):
    """Random (packed, scale, zero) in the reference layout."""
    n, k = meta.out_features, meta.in_features
    if meta.fmt == "mxfp8":
        b = rng.integers(0, 256, (n, k), dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] ^= 0x01  # no NaN encodings (0x7F / 0xFF) in the weights
        packed = jnp.asarray(b.view(ml_dtypes.float8_e4m3fn))
        s = rng.integers(e8m0[0], e8m0[1] + 1, meta.scale_shape, dtype=np.uint8)
        return packed, jnp.asarray(s), None
    words = rng.integers(-(2**31), 2**31, (n, meta.packed_cols), dtype=np.int64).astype(np.int32)
    mag = rng.uniform(0.5, 2.0, meta.scale_shape) * rng.choice([-1.0, 1.0], meta.scale_shape) / 16
    scale = jnp.asarray(mag, jnp.dtype(meta.scale_dtype))
    zero = None
    if not meta.symmetric:
        half = 1 << (meta.bits - 1)
        zero = jnp.asarray(rng.integers(-half, half, meta.scale_shape), jnp.int8)
    return jnp.asarray(words), scale, zero


def make_x(rng, shape, dtype=jnp.float32, mult=1.0):
    return jnp.asarray(rng.standard_normal(shape) * mult, dtype)


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


ERRORS: dict[str, float] = {}


def record(kind: str, err: float) -> None:
    """Largest error seen per kind (printed by ``pytest -s``, see :func:`test_zz_report_errors`)."""
    ERRORS[kind] = max(ERRORS.get(kind, 0.0), err)


def assert_f32_close(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = rel_err(y, ref)
    assert err <= F32_RTOL, err
    return err


def assert_bf16_close(y, ref):
    """At most one bf16 ulp of ``ref`` (+ fp32-order noise where the sum cancels); nearly all outputs identical."""
    assert y.shape == ref.shape and y.dtype == ref.dtype == jnp.bfloat16
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    with np.errstate(divide="ignore"):
        ulp = np.exp2(np.floor(np.log2(np.abs(ref))) - 7)  # bf16: 8 significant bits
    bound = ulp + 1e-5 * np.max(np.abs(ref))
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) - bound)
    same = float(np.mean(y == ref))
    assert same > 0.97, same
    record("bf16 max |y-ref|/max|ref|", rel_err(y, ref))
    record("bf16 fraction differing", 1 - same)


# ---------------------------------------------------------------------------------------------------------------------
# every int variant: bits × group 32/64/128/channel/tensor × sym/asym, float32 x, odd shapes, both paths
# ---------------------------------------------------------------------------------------------------------------------
GROUPS = (32, 64, 128, "channel", "tensor")
INT_CASES = [(bits, g, sym) for bits in (2, 4, 8) for g in GROUPS for sym in (True, False)]


@pytest.mark.parametrize("i", range(len(INT_CASES)),
                         ids=[f"int{b}-g{g}-{'sym' if s else 'asym'}" for b, g, s in INT_CASES])
def test_int_variants(i):
    """Each (group, sym) sees M = 1 (row-reduce GEMV), 5 (16-row GEMV dot) and 37 (GEMM) across the three widths."""
    bits, group, sym = INT_CASES[i]
    bi, gi, si = (2, 4, 8).index(bits), GROUPS.index(group), int(not sym)
    rng = np.random.default_rng(100 + i)
    m = (1, 5, 37)[(bi + gi) % 3]
    n = (24, 200)[(bi + si) % 2]
    gs = group if isinstance(group, int) else 32
    k = gs * (3, 5)[(gi + si) % 2]  # 3 or 5 groups: never a power of two
    scale_dtype = ("bfloat16", "float16", "bfloat16", "float32")[(bi + gi + si) % 4]
    meta = make_meta("int", bits, group, k, n, sym, scale_dtype)
    packed, scale, zero = make_weight(meta, rng)
    x = make_x(rng, (m, k))
    y = kernel(x, packed, scale, zero, meta)
    ref = ref_qmatmul(x, packed, scale, zero, meta)
    record("f32", assert_f32_close(y, ref))
    if (bi + gi) % 3 == 0:  # a third of the cases (each group and width once): also vs the float64 oracle
        assert rel_err(y, exact_f64(x, packed, scale, zero, meta)) <= F32_RTOL


@pytest.mark.parametrize("m", (1, 5, 37))
def test_mxfp8(m):
    rng = np.random.default_rng(m)
    meta = make_meta("mxfp8", k=160, n=200)
    packed, scale, _ = make_weight(meta, rng)
    scale = scale.at[::7, ::3].set(0)  # some E8M0 0 bytes (2^-127) among ordinary exponents
    x = make_x(rng, (m, 160))
    record("f32", assert_f32_close(kernel(x, packed, scale, None, meta), ref_qmatmul(x, packed, scale, None, meta)))


# ---------------------------------------------------------------------------------------------------------------------
# E8M0 edge bytes
# ---------------------------------------------------------------------------------------------------------------------
def _exact_mx(x, packed, scale):
    """float64 oracle: w = bf16(e4m3 · 2^(s−127)) without any flush to zero, then x @ wᵀ in float64."""
    v = np.asarray(packed).astype(np.float64)
    p = np.exp2(np.asarray(scale).astype(np.float64) - 127)
    w = v * np.repeat(p, 32, axis=1)[:, : v.shape[1]]
    with np.errstate(over="ignore"):
        w = w.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, np.float64) @ w.T


@pytest.mark.parametrize("m", (1, 37))
def test_e8m0_huge_and_inf(m):
    """Bytes 253 / 254 (2^126, 2^127: finite bf16 weights near the top of the range) and 255 (+inf, as
    ``2^(255−127)`` is in fp32: ±inf weights, NaN where the E4M3 value is 0) — same values as the reference."""
    rng = np.random.default_rng(7 + m)
    meta = make_meta("mxfp8", k=96, n=24)
    packed, _, _ = make_weight(meta, rng)
    b = np.asarray(packed).view(np.uint8).copy()
    b[:16] &= 0xBF  # rows 0–15: |v| < 2, so v·2^127 stays finite
    packed = jnp.asarray(b.view(ml_dtypes.float8_e4m3fn))
    s = np.full(meta.scale_shape, 127, np.uint8)
    s[0:8] = 254
    s[8:16] = 253
    s[16:20, 1] = 255  # rows 16–19: one infinite group
    s[20:24] = [250, 251, 252]
    scale = jnp.asarray(s)
    x = make_x(rng, (m, 96), mult=1e-30)  # keep the finite sums far from fp32 overflow
    y = np.asarray(kernel(x, packed, scale, None, meta))
    ref = np.asarray(ref_qmatmul(x, packed, scale, None, meta))
    assert np.isinf(ref[:, 16:20]).any() or np.isnan(ref[:, 16:20]).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.sign(y[~fin]), np.sign(ref[~fin]))
    assert np.all(np.abs(y[fin] - ref[fin]) <= F32_RTOL * np.max(np.abs(ref[fin])))
    exact = _exact_mx(x, packed, scale)
    rows = np.isfinite(exact).all(axis=0)  # output columns (weight rows) without inf/NaN
    assert rows[:16].all()
    assert rel_err(y[:, rows], exact[:, rows]) <= F32_RTOL


@pytest.mark.parametrize("m", (37,))
def test_e8m0_zero_byte(m):
    """Byte 0 is 2^-127, an fp32 subnormal: the kernel builds it as 2^-63·2^-64, so v·2^-127 is exact wherever it is
    a normal number (the reference's ``ldexp`` gives 0 on XLA:CPU, which flushes the subnormal factor)."""
    rng = np.random.default_rng(11 + m)
    meta = make_meta("mxfp8", k=96, n=24)
    packed, _, _ = make_weight(meta, rng)
    s = rng.integers(1, 3, meta.scale_shape).astype(np.uint8)  # 2^-126, 2^-125 ...
    s[:8] = 0  # ... and rows 0–7 all 2^-127
    scale = jnp.asarray(s)
    x = make_x(rng, (m, 96))
    y = np.asarray(kernel(x, packed, scale, None, meta), np.float64)
    exact = _exact_mx(x, packed, scale)
    # values below 2^-126 are subnormal (flushed by XLA:CPU); allow that much per term
    atol = 2 * 2.0**-126 * np.sum(np.abs(np.asarray(x, np.float64)), axis=1, keepdims=True)
    assert np.all(np.abs(y - exact) <= 1e-5 * np.abs(exact) + atol)
    assert np.all(np.abs(y[:, :8]) > 0)  # rows of 2^-127 scales are not flushed to zero
    ref = np.asarray(ref_qmatmul(x, packed, scale, None, meta), np.float64)
    assert np.all(np.abs(y[:, 8:] - ref[:, 8:]) <= 1e-5 * np.abs(exact[:, 8:]) + atol)


# ---------------------------------------------------------------------------------------------------------------------
# bf16 activations, forced configs (split-K, bk vs group), batch dims, gradients
# ---------------------------------------------------------------------------------------------------------------------
BF16_CASES = [("int", 4, 128, True, 1), ("int", 8, 32, False, 5), ("int", 2, 64, False, 37), ("mxfp8", 8, 32, True, 37),
              ("int", 4, "channel", False, 1), ("mxfp8", 8, 32, True, 1)]


@pytest.mark.parametrize("i", range(len(BF16_CASES)), ids=[f"{c[0]}{c[1]}-g{c[2]}-m{c[4]}" for c in BF16_CASES])
def test_bf16_activations(i):
    fmt, bits, group, sym, m = BF16_CASES[i]
    rng = np.random.default_rng(200 + i)
    k = 5 * (group if isinstance(group, int) else 32)
    meta = make_meta(fmt, bits, group, k, 200, sym)
    packed, scale, zero = make_weight(meta, rng)
    x = make_x(rng, (m, k), jnp.bfloat16)
    assert_bf16_close(kernel(x, packed, scale, zero, meta), ref_qmatmul(x, packed, scale, zero, meta))


FORCED = [
    # (name, meta args, m, config)
    ("gemv-splitk-bk<g", ("int", 4, 128, 640, 200, False), 5, KernelConfig("gemv", 16, 32, 64, split_k=4)),
    ("gemv-m1-splitk-bk>g", ("int", 2, 32, 160, 24, True), 1, KernelConfig("gemv", 16, 16, 64, split_k=2)),
    ("gemm-splitk-bk<g", ("int", 8, 64, 192, 200, False), 37, KernelConfig("gemm", 16, 64, 32, split_k=2)),
    ("gemm-small-m", ("int", 4, 32, 96, 24, False), 3, KernelConfig("gemm", 16, 16, 64)),
    ("gemm-mx-splitk", ("mxfp8", 8, 32, 160, 200, True), 37, KernelConfig("gemm", 32, 128, 64, split_k=4)),
    ("gemv-channel-splitk", ("int", 8, "channel", 160, 24, False), 16, KernelConfig("gemv", 16, 16, 32, split_k=4)),
]


@pytest.mark.parametrize("case", FORCED, ids=[c[0] for c in FORCED])
def test_forced_configs(case):
    _, margs, m, cfg = case
    rng = np.random.default_rng(len(case[0]))
    meta = make_meta(*margs)
    packed, scale, zero = make_weight(meta, rng)
    x = make_x(rng, (m, meta.in_features))
    y = kernel(x, packed, scale, zero, meta, cfg)
    record("f32", assert_f32_close(y, ref_qmatmul(x, packed, scale, zero, meta)))


@pytest.mark.parametrize("lead", [(2, 3), (2, 19)])
def test_leading_batch_dims(lead):
    rng = np.random.default_rng(sum(lead))
    meta = make_meta("int", 4, 32, 96, 24, False)
    packed, scale, zero = make_weight(meta, rng)
    x = make_x(rng, (*lead, 96))
    y = kernel(x, packed, scale, zero, meta)
    assert y.shape == (*lead, 24)
    assert_f32_close(y, ref_qmatmul(x, packed, scale, zero, meta))


@pytest.mark.parametrize("dtype,m", [(jnp.float32, 5), (jnp.float32, 37), (jnp.bfloat16, 1)])
def test_grad_x(dtype, m):
    rng = np.random.default_rng(m)
    meta = make_meta("int", 4, 32, 96, 24, False)
    packed, scale, zero = make_weight(meta, rng)
    x = make_x(rng, (m, 96), dtype)
    c = make_x(rng, (m, 24), dtype)

    def loss(f):
        return lambda x: jnp.sum((f(x) * c).astype(jnp.float32))

    pal = loss(lambda x: qmatmul_pallas(x, packed, scale, zero, meta, interpret=True))
    ref = loss(lambda x: reference.qmatmul(x, packed, scale, zero, meta))
    g = run_jit(jax.grad(pal), x)
    g_ref = run_jit(jax.grad(ref), x)
    assert g.dtype == g_ref.dtype == dtype
    if dtype == jnp.float32:
        record("grad f32", assert_f32_close(g, g_ref))
    else:
        assert_bf16_close(g, g_ref)


def test_config_choice():
    """Paths and tiles by shape: GEMV to M = 16, power-of-two blocks, split-K only where N/bn is small."""
    meta = make_meta("int", 4, 128, 4096, 2048)
    assert choose_config(16, 2048, 4096, meta).path == "gemv"
    assert choose_config(17, 2048, 4096, meta).path == "gemm"
    big = choose_config(1, 8192, 2048, make_meta("int", 4, 128, 2048, 8192))
    assert big.split_k == 1
    small = choose_config(1, 512, 2048, make_meta("int", 4, 128, 2048, 512))
    assert small.split_k > 1 and 2048 % (small.split_k * small.bk) == 0
    # a weight of ≤ 64 KiB (the GDN layers' 32-row in_proj_a / in_proj_b) is not split: no second launch
    tiny = choose_config(1, 32, 2048, make_meta("int", 4, 128, 2048, 32))
    assert tiny.split_k == 1 and qp.SPLIT_MIN_BYTES == 64 * 1024
    assert choose_config(1, 64, 2048, make_meta("int", 8, 128, 2048, 64)).split_k > 1  # 128 KiB: split
    for m in (1, 8, 64, 512):
        c = choose_config(m, 200, 160, make_meta("mxfp8", k=160, n=200))
        assert all(v & (v - 1) == 0 for v in (c.bm, c.bn, c.bk, c.split_k))


def test_empty_and_fallback():
    rng = np.random.default_rng(0)
    meta = make_meta("int", 4, 32, 96, 24)
    packed, scale, zero = make_weight(meta, rng)
    y = qmatmul_pallas(jnp.zeros((0, 96)), packed, scale, zero, meta, interpret=True)
    assert y.shape == (0, 24)
    odd = QuantMeta("int", 4, 48, 96, 24)  # non-power-of-two group: plain-JAX fallback
    packed, scale, zero = make_weight(odd, rng)
    x = make_x(rng, (3, 96))
    assert_f32_close(run_jit(lambda x: qmatmul_pallas(x, packed, scale, None, odd, interpret=True), x),
                     ref_qmatmul(x, packed, scale, None, odd))


# ---------------------------------------------------------------------------------------------------------------------
# Level A: lower every kernel variant for CUDA under an abstract H200 (docs/kernels.md §6)
# ---------------------------------------------------------------------------------------------------------------------
CASES = lowering_cases()
VARIANTS = sorted({name.split("_m")[0] for name, _, _ in CASES})


@pytest.mark.parametrize("variant", VARIANTS)
def test_lowering_h200(variant):
    cases = [c for c in CASES if c[0].split("_m")[0] == variant]
    assert len(cases) == 16  # M ∈ {1, 8, 64, 512} × 4 layer shapes
    for name, fn, specs in cases:
        text = lower_for_h200(fn, specs)
        assert TRITON_TARGET in text, name
        assert "mosaic_gpu" not in text, name


def test_zz_report_errors():
    """Runs last (file order): prints the largest measured errors (``pytest -s``)."""
    print("\nmeasured errors:", {k: f"{v:.2e}" for k, v in sorted(ERRORS.items())})


@pytest.mark.parametrize("fmt, bits, group, k, n, symmetric, m", [
    ("int", 4, 128, 512, 256, False, 1),   # read in place (no padding), GEMV path, zero points
    ("int", 2, 64, 512, 256, True, 9),     # read in place, split across rows
    ("mxfp8", 8, 32, 256, 128, True, 37),  # GEMM path
    ("int", 4, 128, 384, 200, True, 3),    # N needs padding: the layer is sliced out instead
])
def test_layer_in_stack(fmt, bits, group, k, n, symmetric, m):
    """``layer=g`` on a ``[L, N, ·]`` stack (how the model's layer scan passes packed weights, so they are not copied
    out) equals the kernel on layer g alone, for the in-place grid and the padding fallback; the references too."""
    from qjax.kernels import qmatmul as entry

    rng = np.random.default_rng(7)
    meta = make_meta(fmt, bits, group, k=k, n=n, symmetric=symmetric)
    layers = [make_weight(meta, rng) for _ in range(3)]
    stack = tuple(None if a[0] is None else jnp.stack(a) for a in zip(*layers))
    x = make_x(rng, (m, k))
    from qjax.kernels.qmatmul_pallas import _in_stack_ok

    assert _in_stack_ok(meta, choose_config(m, n, k, meta, x.dtype), stack[1], stack[2]) == (n % 8 == 0 and k != 384)
    for g in (0, 2):
        want = kernel(x, *layers[g], meta)
        got = run_jit(lambda x, p, s, z, g_: qmatmul_pallas(x, p, s, z, meta, interpret=True, layer=g_),
                      x, *stack, jnp.int32(g))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        ref = run_jit(lambda x, p, s, z, g_: entry(x, p, s, z, meta, impl="reference", layer=g_), x, *stack,
                      jnp.int32(g))
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(ref_qmatmul(x, *layers[g], meta)))


STACK_FORCED = [
    # (name, meta args, m, config): one layer of a 3-layer stack read in place, every path with split-K (the split's
    # K offset and the layer's row offset both added inside the kernel)
    ("gemv-m1-splitk-bk>g", ("int", 2, 32, 256, 48, True), 1, KernelConfig("gemv", 16, 16, 64, split_k=2)),
    ("gemv-splitk-bk<g-asym", ("int", 4, 128, 512, 96, False), 5, KernelConfig("gemv", 16, 32, 64, split_k=4)),
    ("gemv-channel-splitk-asym", ("int", 8, "channel", 256, 48, False), 16,
     KernelConfig("gemv", 16, 16, 32, split_k=4)),
    ("gemm-splitk-bk<g-asym", ("int", 8, 64, 256, 192, False), 37, KernelConfig("gemm", 16, 64, 32, split_k=2)),
    ("gemm-mx-splitk", ("mxfp8", 8, 32, 256, 128, True), 37, KernelConfig("gemm", 32, 64, 64, split_k=2)),
    ("dense-gemv-m1-splitk", None, 1, KernelConfig("gemv", 16, 16, 64, split_k=2)),
]


@pytest.mark.parametrize("case", STACK_FORCED, ids=[c[0] for c in STACK_FORCED])
def test_layer_in_stack_configs(case):
    """Each layer of a ``[3, N, ·]`` stack, its index traced by a ``lax.scan`` over the layers (as the model's layer
    scan passes it), gives the same bits as the kernel on that layer alone with the same blocks, through a grid of
    the same size (one layer's programs, none idle)."""
    from qjax.kernels.qmatmul_pallas import _in_stack_ok, matmul_pallas

    name, margs, m, cfg = case
    rng = np.random.default_rng(len(name))
    if margs is None:  # an unquantized weight: kernels.matmul's in-stack path
        meta = dense_meta(48, 256, jnp.float32)
        layers = [(make_x(rng, (48, 256)), None, None) for _ in range(3)]

        def call(x, p, s, z, layer=None):
            return matmul_pallas(x, p, interpret=True, config=cfg, layer=layer)
    else:
        meta = make_meta(*margs)
        layers = [make_weight(meta, rng) for _ in range(3)]

        def call(x, p, s, z, layer=None):
            return qmatmul_pallas(x, p, s, z, meta, interpret=True, config=cfg, layer=layer)
    stack = tuple(None if a[0] is None else jnp.stack(a) for a in zip(*layers))
    x = make_x(rng, (m, meta.in_features))
    assert _in_stack_ok(meta, cfg, stack[1], stack[2])

    def scanned(x, p, s, z):
        return jax.lax.scan(lambda c, g: (c, call(x, p, s, z, layer=g)), 0, jnp.arange(3, dtype=jnp.int32))[1]

    alone = jax.jit(call).lower(x, *layers[0]).compile(compiler_options=FAST)
    got = run_jit(scanned, x, *stack)
    for g in range(3):
        np.testing.assert_array_equal(np.asarray(got[g]), np.asarray(alone(x, *layers[g])), err_msg=f"layer {g}")
    assert pallas_grids(scanned, x, *stack) == pallas_grids(call, x, *layers[0])


# The real model's projections as its layer scan calls them: (meta, M); weights stacked over G = 10 layer groups.
_REAL = [
    (QuantMeta("int", 4, 128, 2048, 8192, symmetric=False), 1),  # w2w4 q_proj / in_proj_qkv, GEMV
    (QuantMeta("int", 4, 128, 2048, 8192), 8),
    (QuantMeta("int", 4, 128, 4096, 2048), 64),  # o_proj, GEMM
    (QuantMeta("int", 8, 32, 2048, 8192), 1),  # w8a16-g32
    (QuantMeta("int", 8, 32, 512, 2048), 1),  # shared expert down: split-K
    (QuantMeta("int", 8, 2048, 2048, 512, strategy="channel"), 1),
    (QuantMeta("mxfp8", 8, 32, 2048, 512, scale_dtype="uint8"), 512),
    (dense_meta(8192, 2048, jnp.bfloat16), 1),  # bf16 q_proj: kernels.matmul
]


@pytest.mark.parametrize("meta, m", _REAL, ids=[f"{mt.fmt}{'' if mt.fmt == 'mxfp8' else mt.bits}-n{mt.out_features}"
                                                f"-k{mt.in_features}-m{m}" for mt, m in _REAL])
def test_stack_grid_is_one_layer(meta, m):
    """A layer read inside a ``[10, N, ·]`` stack launches exactly one layer's programs, ``(M/bm, N/bn, S)`` — the
    grid of the same call on that layer alone — not ``10·N/bn`` row blocks of which nine tenths return at once."""
    from qjax.kernels.qmatmul_pallas import matmul_pallas

    sds = jax.ShapeDtypeStruct
    n, k = meta.out_features, meta.in_features
    x = sds((m, k), jnp.bfloat16)
    if meta.fmt == "dense":
        def call(x, w, layer=None):
            return matmul_pallas(x, w, interpret=True, layer=layer)

        one = (sds((n, k), jnp.bfloat16),)
    else:
        def call(x, p, s, z=None, layer=None):
            return qmatmul_pallas(x, p, s, z, meta, interpret=True, layer=layer)

        wdt = jnp.float8_e4m3fn if meta.fmt == "mxfp8" else jnp.int32
        sdt = jnp.uint8 if meta.fmt == "mxfp8" else jnp.dtype(meta.scale_dtype)
        one = (sds((n, k if meta.fmt == "mxfp8" else meta.packed_cols), wdt), sds(meta.scale_shape, sdt))
        one += () if meta.symmetric else (sds(meta.scale_shape, jnp.int8),)
    stack = tuple(sds((10, *a.shape), a.dtype) for a in one)
    grids = pallas_grids(lambda x, *a: call(x, *a[:-1], layer=a[-1]), x, *stack, sds((), jnp.int32))
    cfg = choose_config(m, n, k, meta, jnp.bfloat16)
    rows = 1 if cfg.path == "gemv" else -(-m // cfg.bm)
    assert [g for _, g in grids] == [(rows, n // cfg.bn, cfg.split_k)], (grids, cfg)
    assert grids == pallas_grids(call, x, *one)


# ---------------------------------------------------------------------------------------------------------------------
# dense (unquantized) weights read inside their layer stack: kernels.matmul / matmul_pallas
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype, w_dtype, m, n, k", [
    (jnp.float32, jnp.float32, 1, 200, 100),   # M = 1 row reduction, N and K need padding
    (jnp.float32, jnp.float32, 5, 24, 160),    # GEMV path, split-K
    (jnp.float32, jnp.bfloat16, 37, 200, 96),  # GEMM path, weight cast to x's dtype in the kernel
    (jnp.bfloat16, jnp.bfloat16, 9, 256, 512),
])
def test_dense_matmul(x_dtype, w_dtype, m, n, k):
    """The dense kernel (``fmt="dense"``: the weight tile goes straight to the dot) equals XLA's ``x @ wᵀ``."""
    from qjax.kernels.qmatmul_pallas import matmul_pallas

    rng = np.random.default_rng(m * n + k)
    w = make_x(rng, (n, k), w_dtype)
    x = make_x(rng, (m, k), x_dtype)
    y = run_jit(lambda x, w: matmul_pallas(x, w, interpret=True), x, w)
    ref = run_jit(reference.matmul, x, w)
    if x_dtype == jnp.float32:
        record("dense f32", assert_f32_close(y, ref))
    else:
        assert_bf16_close(y, ref)


@pytest.mark.parametrize("n, k, m", [
    (256, 512, 1),    # read in place, M = 1
    (128, 256, 37),   # read in place, GEMM path
    (200, 100, 3),    # N and K need padding: kernels.matmul leaves the layer to XLA
])
def test_dense_layer_in_stack(n, k, m):
    """``kernels.matmul(x, w[G, N, K], layer=g)`` equals ``x @ w[g]ᵀ`` through every implementation; the Pallas
    kernel reads layer g in place when no padding is needed; a layer that would need padding (matmul_pallas would
    slice and pad it: a copy and an extra launch) and rows above DENSE_IN_STACK_MAX_ROWS go to XLA's dot."""
    from qjax.kernels import matmul as entry
    from qjax.kernels.ops import DENSE_IN_STACK_MAX_ROWS
    from qjax.kernels.qmatmul_pallas import _in_stack_ok, dense_in_stack_ok, dense_meta, matmul_pallas

    rng = np.random.default_rng(n + k + m)
    stack = make_x(rng, (3, n, k))
    x = make_x(rng, (m, k))
    meta = dense_meta(n, k, stack.dtype)
    assert _in_stack_ok(meta, choose_config(m, n, k, meta, x.dtype), None, None) == (n != 200)
    assert dense_in_stack_ok(m, n, k, stack.dtype, x.dtype) == (n != 200)
    for g in (0, 2):
        want = run_jit(reference.matmul, x, stack[g])
        got = run_jit(lambda x, w, g_: matmul_pallas(x, w, interpret=True, layer=g_), x, stack, jnp.int32(g))
        assert_f32_close(got, want)
        for impl in ("reference", "xla", "interpret"):
            y = run_jit(lambda x, w, g_: entry(x, w, impl=impl, layer=g_), x, stack, jnp.int32(g))
            assert_f32_close(y, want)
    def program(rows):
        return str(jax.make_jaxpr(lambda x, w: entry(x, w, impl="interpret", layer=jnp.int32(1)))(
            make_x(rng, (rows, k)), stack))

    assert ("pallas_call" in program(m)) == (n != 200)
    big = program(DENSE_IN_STACK_MAX_ROWS + 1)  # prefill-sized: sliced out for XLA's dot
    assert "pallas_call" not in big and "dot_general" in big


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_grads(dtype):
    """Gradients w.r.t. x and the weight stack equal plain JAX's on the sliced layer (the dense weights are trained:
    qjax.builtin.train, and a model must learn the same with the kernels on)."""
    from qjax.kernels import matmul as entry
    from qjax.kernels.qmatmul_pallas import matmul_pallas

    rng = np.random.default_rng(3)
    stack = make_x(rng, (3, 32, 96), dtype)
    x, c = make_x(rng, (5, 96), dtype), make_x(rng, (5, 32), dtype)

    def loss(f):
        return lambda x, w: jnp.sum((f(x, w) * c).astype(jnp.float32))

    pal = loss(lambda x, w: matmul_pallas(x, w, interpret=True, layer=jnp.int32(1)))
    ref = loss(lambda x, w: reference.matmul(x, w[1]))
    ent = loss(lambda x, w: entry(x, w, impl="interpret", layer=jnp.int32(1)))
    want = run_jit(jax.grad(ref, argnums=(0, 1)), x, stack)
    for f in (pal, ent):
        got = run_jit(jax.grad(f, argnums=(0, 1)), x, stack)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == dtype
            if dtype == jnp.float32:
                assert_f32_close(a, b)
            else:
                assert_bf16_close(a, b)
        assert not np.any(np.asarray(got[1][0], np.float32)) and not np.any(np.asarray(got[1][2], np.float32))
    unstacked = run_jit(jax.grad(loss(lambda x, w: matmul_pallas(x, w, interpret=True)), argnums=1), x, stack[1])
    (assert_f32_close if dtype == jnp.float32 else assert_bf16_close)(unstacked, want[1][1])


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2.0 ** -8)])
def test_matmul_gradient_equals_autodiff(dtype, tol):
    """The reference matmul's own VJP (the weight's cotangent as ``(xᵀ g)ᵀ``, so XLA transposes the stored input,
    not the incoming cotangent) gives JAX's autodiff gradients of the plain dot: same products, same dtypes (measured
    bit-identical on these shapes; the bound allows a different summation order)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(3, 37, 24)), dtype)
    w = jnp.asarray(rng.normal(size=(40, 24)), dtype)
    probe = jnp.asarray(rng.normal(size=(3, 37, 40)), jnp.float32)

    def plain(x, w):
        return jax.lax.dot_general(x, w, (((2,), (1,)), ((), ())), precision=reference.dot_precision(dtype),
                                   preferred_element_type=jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) * probe), argnums=(0, 1)))(x, w)

    for got, want in zip(grads(reference.matmul_accumulated), grads(plain)):
        assert got.dtype == want.dtype == dtype
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.abs(got - want).max() <= tol * np.abs(want).max()
