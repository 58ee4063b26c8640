"""Decode attention as two Pallas (Triton backend) kernels reading the K/V cache layer in place: the GPU twin of
:func:`.attention_reference.decode_attention_reference`.

Why: at decode the model's attention read layer ``g`` of the ``[G, B, Hkv, S, D]`` cache stacks with a bare dynamic
slice, which XLA:GPU turns into two asynchronous copies per layer (655 KB each at a 640-slot cache) — the one thing
that keeps the decode loop out of a single CUDA graph in the ``graphs`` mode (XLA will not put a loop whose body holds
a loop-dependent dynamic-slice copy into a WHILE command) — followed by six XLA kernels (two dots, softmax in three,
a convert). Here the layer offset is a runtime scalar in the pointer arithmetic, as in the other kernels.

Exact to the reference's rounding points: the probabilities are normalised by the global max and sum *before* they
are rounded to q's dtype for the value matmul, so a one-pass (flash) softmax would round differently. Hence two
passes, split over the keys so that at batch 1 more than B·Hkv programs work:

1. *stats*, grid ``(B, Hkv, P)``: program (b, h, p) takes the ``G = Hq/Hkv`` query heads of kv head h (padded to
   16 rows for ``tl.dot``) against its part of the keys, in blocks of :data:`BLOCK_KEYS`: scores ``q·kᵀ · D^−½`` in
   fp32, not-allowed keys at ``finfo(f32).min`` (as the reference: a fully masked row stays finite), keys past
   ``kv_len`` out; writes the part's running max and the sum of ``exp(s − max)``.
2. *values*, grid ``(B, Hkv, P)``: every program combines the P parts' (max, sum) into the global ones, recomputes its
   scores, ``p = exp(s − max) / sum`` rounded to q's dtype, and accumulates ``p · v`` in fp32 → ``[B, Hkv, P, 16, D]``.

The P partial outputs are summed (and rounded to q's dtype) by XLA, fused with what follows (the model's output gate).
P ≤ :data:`MAX_PARTS`: longer caches give each part more key blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention_reference import decode_attention_reference

__all__ = ["BLOCK_KEYS", "MAX_PARTS", "decode_attention_pallas", "decode_attention_reference", "lowering_cases",
           "parts", "supported"]

BLOCK_KEYS = 64  # keys per inner block: a [64, D] bf16 tile (32 KB at D = 256)
MAX_PARTS = 64  # key parts per (row, kv head): the values pass reads every part's (max, sum)
_ROWS = 16  # query rows per program (tl.dot needs ≥ 16): the G heads of one kv head, zero-padded


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def supported(q_shape, k_shape) -> bool:
    """A power-of-two head dim ≥ 16 and at most 16 query heads per kv head."""
    d, hq, hkv = q_shape[-1], q_shape[-2], k_shape[2]
    return d >= 16 and d & (d - 1) == 0 and hq % hkv == 0 and hq // hkv <= _ROWS


def parts(kv_len: int) -> tuple[int, int]:
    """``(P, blocks per part)``: the key parts of a ``kv_len``-slot read and the :data:`BLOCK_KEYS` blocks each
    holds (the last parts may be empty)."""
    blocks = -(-kv_len // BLOCK_KEYS)
    p = min(MAX_PARTS, blocks)
    return p, -(-blocks // p)


def _dot(a, b, dims):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _queries(q_ref, groups: int):
    """This program's query heads ``[16, D]`` (the G heads of its kv head, zero rows below)."""
    b, h = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[2]
    rows = lax.iota(jnp.int32, _ROWS)
    dims = lax.iota(jnp.int32, d)
    return plgpu.load(q_ref.at[b, h * groups + rows[:, None], dims[None, :]],
                      mask=jnp.broadcast_to((rows < groups)[:, None], (_ROWS, d)), other=0)


def _scores(q, b, row, k_ref, allowed_ref, kb, *, kv_len: int, scale: float):
    """Scores of key block ``kb`` for queries ``q [16, D]`` of row ``b``, whose keys are row ``row`` of the flattened
    ``[G·B·Hkv, S, D]`` stack: ``[16, BLOCK_KEYS]`` fp32 — ``−inf`` past ``kv_len``, ``finfo.min`` where not
    allowed — with the block's key positions and which of them are inside ``kv_len``. (Program ids are read outside
    the key loops: interpret mode cannot evaluate ``program_id`` inside a loop body.)"""
    d = q.shape[1]
    dims = lax.iota(jnp.int32, d)
    keys = kb * BLOCK_KEYS + lax.iota(jnp.int32, BLOCK_KEYS)
    inside = keys < kv_len
    k = plgpu.load(k_ref.at[row, keys[:, None], dims[None, :]],
                   mask=jnp.broadcast_to(inside[:, None], (BLOCK_KEYS, d)), other=0).astype(q.dtype)
    s = _dot(q, k, ((1,), (1,))) * scale  # [16, BK]
    ok = plgpu.load(allowed_ref.at[b, keys], mask=inside, other=0) != 0
    s = jnp.where(ok[None, :], s, jnp.finfo(jnp.float32).min)
    return jnp.where(inside[None, :], s, -jnp.inf), keys, inside


def _stack_row(layer_ref, batch: int, hkv: int):
    """The flattened stack's row of this program's (layer, b, h)."""
    return (layer_ref[0] * batch + pl.program_id(0)) * hkv + pl.program_id(1)


def _stats_kernel(layer_ref, q_ref, k_ref, allowed_ref, m_ref, l_ref, *, groups: int, kv_len: int, scale: float,
                  per_part: int, batch: int, hkv: int):
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = _stack_row(layer_ref, batch, hkv)
    q = _queries(q_ref, groups)

    def body(i, carry):
        m, l = carry
        s, _, _ = _scores(q, b, row, k_ref, allowed_ref, p * per_part + i.astype(jnp.int32), kv_len=kv_len,
                          scale=scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        finite = m_new > -jnp.inf  # a block past kv_len leaves (−inf, 0) as it is, without NaNs
        alpha = jnp.where(finite, jnp.exp(m - jnp.where(finite, m_new, 0.0)), 0.0)
        e = jnp.where(s > -jnp.inf, jnp.exp(s - jnp.where(finite, m_new, 0.0)[:, None]), 0.0)
        return m_new, l * alpha + jnp.sum(e, axis=1)

    init = (jnp.full((_ROWS,), -jnp.inf, jnp.float32), jnp.zeros((_ROWS,), jnp.float32))
    m, l = lax.fori_loop(0, per_part, body, init)
    rows = lax.iota(jnp.int32, _ROWS)
    plgpu.store(m_ref.at[b, h, p, rows], m)
    plgpu.store(l_ref.at[b, h, p, rows], l)


def _values_kernel(layer_ref, q_ref, k_ref, v_ref, allowed_ref, m_ref, l_ref, o_ref, *, groups: int, kv_len: int,
                   scale: float, per_part: int, batch: int, hkv: int, num_parts: int):
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = _stack_row(layer_ref, batch, hkv)
    pp = _pow2(num_parts)
    idx = lax.iota(jnp.int32, pp)
    rows = lax.iota(jnp.int32, _ROWS)
    mask = jnp.broadcast_to((idx < num_parts)[:, None], (pp, _ROWS))
    m_parts = plgpu.load(m_ref.at[b, h, idx[:, None], rows[None, :]], mask=mask, other=-jnp.inf)  # [P, 16]
    l_parts = plgpu.load(l_ref.at[b, h, idx[:, None], rows[None, :]], mask=mask, other=0)
    m = jnp.max(m_parts, axis=0)  # [16]: the global max (finite: every row has ≥ 1 key inside kv_len)
    l = jnp.sum(jnp.where(m_parts > -jnp.inf, l_parts * jnp.exp(m_parts - m[None, :]), 0.0), axis=0)
    d = q_ref.shape[2]
    dims = lax.iota(jnp.int32, d)
    q = _queries(q_ref, groups)

    def body(i, acc):
        s, keys, inside = _scores(q, b, row, k_ref, allowed_ref, p * per_part + i.astype(jnp.int32),
                                  kv_len=kv_len, scale=scale)
        probs = (jnp.exp(s - m[:, None]) / l[:, None]).astype(q_ref.dtype)  # the reference's rounding point
        v = plgpu.load(v_ref.at[row, keys[:, None], dims[None, :]],
                       mask=jnp.broadcast_to(inside[:, None], (BLOCK_KEYS, d)), other=0).astype(q_ref.dtype)
        return acc + _dot(probs, v, ((1,), (0,)))

    acc = lax.fori_loop(0, per_part, body, jnp.zeros((_ROWS, d), jnp.float32))
    plgpu.store(o_ref.at[b, h, p, rows[:, None], dims[None, :]], acc)


def decode_attention_pallas(q, k_stack, v_stack, allowed, *, layer, kv_len: int, interpret: bool = False):
    """:func:`.attention_reference.decode_attention_reference`'s contract, on the GPU: ``q [B, Hq, D]``, the
    ``[G, B, Hkv, S, D]`` K/V stacks read in place at ``layer``, ``allowed [B, kv_len]`` → ``[B, Hq, D]`` in q's dtype.
    Not differentiable (decode only)."""
    batch, hq, d = q.shape
    g_stack, _, hkv, slots, _ = k_stack.shape
    if not supported(q.shape, k_stack.shape) or not 0 < kv_len <= slots or allowed.shape != (batch, kv_len):
        raise ValueError(f"decode attention: q {q.shape}, K/V {k_stack.shape}, allowed {allowed.shape}, "
                         f"kv_len {kv_len} do not fit (power-of-two D, ≤ {_ROWS} query heads per kv head)")
    groups = hq // hkv
    num_parts, per_part = parts(kv_len)
    scale = float(d) ** -0.5
    flat = lambda s: s.reshape(g_stack * batch * hkv, slots, d)  # noqa: E731 (a bitcast)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    mask = allowed.astype(jnp.int8)
    static = dict(groups=groups, kv_len=kv_len, scale=scale, per_part=per_part, batch=batch, hkv=hkv)
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    grid = (batch, hkv, num_parts)
    stats = jax.ShapeDtypeStruct((batch, hkv, num_parts, _ROWS), jnp.float32)
    m, l = pl.pallas_call(functools.partial(_stats_kernel, **static), out_shape=(stats, stats), grid=grid,
                          compiler_params=params, interpret=interpret, name="qjax_attn_decode_stats",
                          )(layer_arr, q, flat(k_stack), mask)
    out = pl.pallas_call(functools.partial(_values_kernel, **static, num_parts=num_parts),
                         out_shape=jax.ShapeDtypeStruct((batch, hkv, num_parts, _ROWS, d), jnp.float32), grid=grid,
                         compiler_params=params, interpret=interpret, name="qjax_attn_decode_values",
                         )(layer_arr, q, flat(k_stack), flat(v_stack), mask, m, l)
    return out.sum(axis=2)[:, :, :groups].reshape(batch, hq, d).astype(q.dtype)


def lowering_cases() -> list[tuple[str, Callable, tuple[jax.ShapeDtypeStruct, ...]]]:
    """Qwen3.6-35B-A3B's full-attention decode (16 query heads, 2 kv heads, D 256, bf16; a 10-layer cache stack) at
    batch 1 / 8 and caches of 640 and 32,768 slots (more key blocks per part)."""
    sds = jax.ShapeDtypeStruct
    cases = []
    for b, slots in ((1, 640), (8, 640), (1, 32768)):
        specs = (sds((b, 16, 256), jnp.bfloat16), sds((10, b, 2, slots, 256), jnp.bfloat16),
                 sds((10, b, 2, slots, 256), jnp.bfloat16), sds((b, slots), jnp.bool_), sds((), jnp.int32))

        def fn(q, k, v, allowed, layer, _slots=slots):
            return decode_attention_pallas(q, k, v, allowed, layer=layer, kv_len=_slots)
        cases.append((f"attn_decode_b{b}_s{slots}", fn, specs))
    return cases

