"""Indexing without NumPy's negative-index wrapping: one entry of a stacked array (a layer of a ``[L, …]`` layer
stack, an expert of ``[E, …]``) read or replaced by a scalar index, and gathers by index arrays.

Why: ``a[i]`` wraps negative indices, so every traced index adds a compare, an add and a select — per axis of the
array for a scalar index — before the slice or gather. The indices here are never negative (layer counters, expert
ids, token slots), and a model's program indexes a few hundred times: the wrapping was ~15 % of the traced
operations of the built-in model's prefill, traced, lowered and compiled in every program. Out-of-range indices
behave as in ``a[i]``: dynamic slices clamp, gathers follow the default (promise-in-bounds) mode.
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
    """``stack [S, …]`` → ``stack[i]`` ``[…]`` for a scalar ``i`` (a Python int or a traced integer)."""
    one = jax.lax.dynamic_slice(stack, start(i, stack.ndim), (1, *stack.shape[1:]), allow_negative_indices=False)
    return jax.lax.squeeze(one, (0,))


def put(stack: jnp.ndarray, i, value: jnp.ndarray) -> jnp.ndarray:
    """``stack [S, …]`` with entry ``i`` replaced by ``value […]`` (cast to the stack's dtype; in place under jit)."""
    return jax.lax.dynamic_update_slice(stack, value.astype(stack.dtype)[None], start(i, stack.ndim),
                                        allow_negative_indices=False)


def gather(a: jnp.ndarray, idx) -> jnp.ndarray:
    """``a [S, …]`` → ``a[idx]`` ``[*idx.shape, …]`` for integer ``idx`` of entries in ``[0, S)``: a scalar is one
    dynamic slice (:func:`take`), an array one gather."""
    if jnp.ndim(idx) == 0:
        return take(a, idx)
    return a.at[idx].get(wrap_negative_indices=False)
