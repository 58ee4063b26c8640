"""Plain-JAX reference of softmax attention (the model's gated full-attention layers), the oracle of
:mod:`.attention_pallas`.

:func:`attention` is the model's causal GQA attention over keys it is handed; :func:`decode_attention_reference` is one
query per row against layer ``layer`` of a ``[G, B, Hkv, S, D]`` K/V cache stack (the first ``kv_len`` slots), the
contract of the decode kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import indexing
from .precision import accum_dtype, dot_precision


def attention(q, k, v, allowed) -> jnp.ndarray:
    """GQA softmax attention in fp32 (float64 for float64 q); q head h reads kv head ``h // (Hq/Hkv)``.

    Args:
      q: ``[B, T, Hq, D]``; k, v: ``[B, Hkv, S, D]`` — the cache's layout, in which both matmuls batch over
        (B, Hkv) without transposing the keys or values.
      allowed: ``[B, T, S]`` bool, the keys each query may read (causality and padding).
    Returns:
      ``[B, T, Hq, D]`` in q's dtype: probabilities rounded to q's dtype before the value matmul, as torch's eager
      path does.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    precision, acc = dot_precision(q.dtype), accum_dtype(q.dtype)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=precision, preferred_element_type=acc)
    scores = scores * (d ** -0.5)
    # a finite minimum (not -inf) keeps fully masked rows (queries at left pads) NaN-free
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    o = jnp.einsum("bkgts,bksd->bkgtd", probs, v, precision=precision, preferred_element_type=acc)
    return o.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def decode_attention_reference(q, k_stack, v_stack, allowed, *, layer, kv_len: int) -> jnp.ndarray:
    """One query per row against layer ``layer`` of a K/V cache stack.

    Args:
      q: ``[B, Hq, D]``; k_stack, v_stack: ``[G, B, Hkv, S, D]`` (any float dtype: cast to q's); layer: int32 scalar
        (may be traced); kv_len: the slots read, ``[0, kv_len)`` (static, ≤ S); allowed: ``[B, kv_len]`` bool.
    Returns:
      ``[B, Hq, D]`` in q's dtype (:func:`attention`).
    """
    size = (1, *k_stack.shape[1:3], kv_len, k_stack.shape[4])
    k, v = (jax.lax.dynamic_slice(s, indexing.start(layer, s.ndim), size, allow_negative_indices=False)[0]
            .astype(q.dtype) for s in (k_stack, v_stack))
    return attention(q[:, None], k, v, allowed[:, None])[:, 0]
