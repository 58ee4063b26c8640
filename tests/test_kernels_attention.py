"""Decode attention: the Pallas kernels (kernels/attention_pallas.py, interpret mode) against the plain-JAX reference
(kernels/attention_reference.py), and their GPU lowering (Level A).

Tolerances (max |out − ref| / max |ref|), measured:
- float32: 1e-6. Both sides compute the scores, the softmax and the value sums in fp32 and round the probabilities at
  the same point; the kernel sums per key block and per part, then over the parts (measured 3e-7 … 5e-7).
- bfloat16: 4e-3, about one bf16 ulp of max |ref| (2^-8; measured 0 at the real shapes): a probability whose fp32
  value sits next to a bf16 rounding boundary can round the other way when the fp32 sum differs in its last bit.
  Skipping the probabilities' rounding to bf16 before the value matmul (the reference's rounding point) gives 6.9e-3
  there: the bound catches it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200_util import TRITON_TARGET, lower_for_h200, pallas_grids
from qjax.kernels import attention_pallas, decode_attention
from qjax.kernels.attention_pallas import decode_attention_pallas, lowering_cases, parts
from qjax.kernels.attention_reference import decode_attention_reference

pytestmark = [pytest.mark.interpret,
              pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated:DeprecationWarning")]

F32_TOL, BF16_TOL = 1e-6, 4e-3


def _data(b, hq, hkv, d, slots, kv_len, layers, dtype, seed, *, masked_row=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((layers, b, hkv, slots, d)), dtype) for _ in range(2))
    allowed = rng.random((b, kv_len)) < 0.7
    allowed[:, 0] = True
    if masked_row:  # a query at a left pad: no key allowed (finite, as the reference)
        allowed[-1] = False
    return q, k, v, jnp.asarray(allowed)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("b, hq, hkv, d, slots, kv_len, dtype, masked", [
    (2, 6, 2, 64, 200, 150, jnp.float32, True),     # 3 heads per kv head, kv_len inside a block, a masked row
    (1, 16, 2, 256, 640, 640, jnp.bfloat16, False),  # the real shapes at a 640-slot cache
    (3, 4, 4, 16, 300, 257, jnp.float32, False),     # one head per kv head, a block of one key at the end
])
def test_matches_reference(b, hq, hkv, d, slots, kv_len, dtype, masked):
    q, k, v, allowed = _data(b, hq, hkv, d, slots, kv_len, 3, dtype, seed=1, masked_row=masked)
    both = jax.jit(lambda q, k, v, a, g: (decode_attention_pallas(q, k, v, a, layer=g, kv_len=kv_len, interpret=True),
                                          decode_attention_reference(q, k, v, a, layer=g, kv_len=kv_len)))
    for g in (0, 2):  # the layer's offset inside the stack
        got, want = both(q, k, v, allowed, jnp.int32(g))
        assert got.shape == (b, hq, d) and got.dtype == dtype
        assert _rel(got, want) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL), g


def test_long_cache_many_blocks_per_part():
    """Past 64 blocks the parts hold several key blocks each and the last parts are empty (their max −∞, their sum
    0): still the reference, no NaN."""
    kv_len = 64 * 64 + 70  # 66 blocks → 64 parts of 2 blocks, the last 31 parts empty
    assert parts(kv_len) == (64, 2)
    q, k, v, allowed = _data(1, 2, 1, 16, kv_len + 5, kv_len, 2, jnp.float32, seed=2)
    got, want = jax.jit(lambda q, k, v, a: (
        decode_attention_pallas(q, k, v, a, layer=1, kv_len=kv_len, interpret=True),
        decode_attention_reference(q, k, v, a, layer=1, kv_len=kv_len)))(q, k, v, allowed)
    assert _rel(got, want) <= F32_TOL


def test_grids_and_dispatch():
    """Two launches of (B, Hkv, P) programs, whatever the stack depth; the entry point takes the kernels only where
    they apply (an FP8 cache, float64, or 32 query heads per kv head go to the reference)."""
    sds = jax.ShapeDtypeStruct
    specs = (sds((1, 16, 256), jnp.bfloat16), sds((10, 1, 2, 640, 256), jnp.bfloat16),
             sds((10, 1, 2, 640, 256), jnp.bfloat16), sds((1, 640), jnp.bool_), sds((), jnp.int32))
    grids = pallas_grids(lambda q, k, v, a, g: decode_attention(q, k, v, a, layer=g, kv_len=640, impl="interpret"),
                         *specs)
    assert grids == [("qjax_attn_decode_stats", (1, 2, 10)), ("qjax_attn_decode_values", (1, 2, 10))]
    fp8 = (specs[0], sds(specs[1].shape, jnp.float8_e4m3fn), sds(specs[2].shape, jnp.float8_e4m3fn), *specs[3:])
    assert not pallas_grids(lambda q, k, v, a, g: decode_attention(q, k, v, a, layer=g, kv_len=640,
                                                                   impl="interpret"), *fp8)
    assert not attention_pallas.supported((1, 32, 64), (1, 1, 1, 8, 64))  # 32 heads per kv head
    assert not attention_pallas.supported((1, 4, 48), (1, 1, 2, 8, 48))  # D not a power of two
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention_pallas(jnp.zeros((1, 4, 16)), jnp.zeros((1, 1, 2, 8, 16)), jnp.zeros((1, 1, 2, 8, 16)),
                                jnp.ones((1, 9), bool), layer=0, kv_len=9, interpret=True)


_LOWERING = {name: (fn, specs) for name, fn, specs in lowering_cases()}


@pytest.mark.parametrize("name", list(_LOWERING))
def test_lowers_for_h200(name):
    fn, specs = _LOWERING[name]
    text = lower_for_h200(fn, specs)
    assert text.count(TRITON_TARGET) == 2 and "mosaic_gpu" not in text
