"""One entry of a stacked array — a layer of a ``[L, …]`` layer stack, an expert of ``[E, …]`` — read or replaced
with a scalar index (a Python int or a traced int32).

Why not ``stack[i]`` / ``stack.at[i].set``: NumPy indexing wraps negative indices, so a traced index adds a
compare, an add and a select for every axis of the stack before the slice. These indices are never negative (layer
counters, expert ids) and a model's program indexes stacks ~100 times: the wrapping was ~10 % of the traced
operations of the built-in model's prefill. Out-of-range indices clamp, as XLA's dynamic slices do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def start(i, ndim: int) -> tuple:
    """``(i, 0, …, 0)`` of length ``ndim``, all int32 (Python zeros would be int64 next to an int32 index in JAX's
    x64 mode, which dynamic slices refuse)."""
    zero = jnp.zeros((), jnp.int32)
    return (jnp.asarray(i, jnp.int32),) + (zero,) * (ndim - 1)


def take(stack: jnp.ndarray, i) -> jnp.ndarray:
    """``stack [S, …]`` → ``stack[i]`` ``[…]``."""
    one = jax.lax.dynamic_slice(stack, start(i, stack.ndim), (1, *stack.shape[1:]), allow_negative_indices=False)
    return jax.lax.squeeze(one, (0,))


def put(stack: jnp.ndarray, i, value: jnp.ndarray) -> jnp.ndarray:
    """``stack [S, …]`` with entry ``i`` replaced by ``value […]`` (cast to the stack's dtype; in place under jit)."""
    return jax.lax.dynamic_update_slice(stack, value.astype(stack.dtype)[None], start(i, stack.ndim),
                                        allow_negative_indices=False)
