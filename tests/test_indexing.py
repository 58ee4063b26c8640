"""qjax.kernels.indexing: one entry of a stacked array by a scalar index, without NumPy's negative-index wrapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.kernels import indexing


@pytest.mark.parametrize("shape", [(5,), (3, 7), (4, 2, 3, 5)])
def test_take_and_put_equal_numpy_indexing(shape):
    rng = np.random.default_rng(len(shape))
    stack = rng.normal(size=shape).astype(np.float32)
    value = rng.normal(size=shape[1:]).astype(np.float64)  # put casts to the stack's dtype
    take, put = jax.jit(indexing.take), jax.jit(indexing.put)
    for i in range(shape[0]):
        np.testing.assert_array_equal(take(stack, i), stack[i])
        np.testing.assert_array_equal(indexing.take(stack, i), stack[i])  # a Python int, unjitted
        want = stack.copy()
        want[i] = value
        got = put(stack, jnp.int32(i), value)
        assert got.dtype == stack.dtype
        np.testing.assert_array_equal(got, want)
    # out of range clamps (XLA's dynamic slices), it never wraps around as stack[-1] would
    np.testing.assert_array_equal(take(stack, shape[0] + 3), stack[-1])
    np.testing.assert_array_equal(take(stack, -1), stack[0])


def test_traced_index_is_one_slice_without_wrapping(x64):
    """The reason for the module: a traced index is one dynamic slice (no compare/add/select per axis), also with
    JAX's x64 mode on (int32 starts throughout)."""
    jax.config.update("jax_enable_x64", True)
    stack = jnp.zeros((6, 3, 4), jnp.float32)
    jaxpr = jax.make_jaxpr(indexing.take)(stack, jnp.int32(2))
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert "lt" not in prims and "select_n" not in prims and prims.count("dynamic_slice") == 1, prims
    indexed = [e.primitive.name for e in jax.make_jaxpr(lambda s, i: s[i])(stack, jnp.int32(2)).eqns]
    assert "lt" in indexed  # what NumPy-style indexing traces (the check above can fail)
    prims = [e.primitive.name for e in jax.make_jaxpr(indexing.put)(stack, 2, jnp.ones((3, 4))).eqns]
    assert "lt" not in prims and prims.count("dynamic_update_slice") == 1, prims
