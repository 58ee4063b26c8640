"""The gated delta rule (docs/model.md §2.5) as pure functions: the chunked form (64-token chunks, a
unit-lower-triangular inverse per chunk and a scan across chunks) used for every multi-token call, with the same
signature as the exact token-by-token recurrence it is tested against (:mod:`qjax.kernels.gdn_reference`, the
reference of the decode kernels, re-exported here). Everything runs in the accumulation dtype (float32; float64 for a
float64 model) with full-precision matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qjax.kernels.gdn_reference import HIGHEST, l2norm, prepare, recurrent_gated_delta_rule, zero_state

__all__ = ["chunk_gated_delta_rule", "l2norm", "recurrent_gated_delta_rule", "unit_lower_inverse"]


def unit_lower_inverse(a: jnp.ndarray) -> jnp.ndarray:
    """Inverse of unit-lower-triangular ``a [..., C, C]`` (C a power of two) by recursive 2×2 block inversion:
    ``[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]]`` — matmuls only (the entries above the diagonal are
    ignored).

    Why not ``lax.linalg.triangular_solve``: XLA:CPU runs a batched solve of 64×64 blocks ~50× slower than these
    matmuls and its gradient slower still, and inside a jitted ``lax.scan`` of training steps it was seen to hang
    XLA:CPU for good (AutoRound tuning on the built-in model). Matmuls are also what a GPU wants.
    """
    c = a.shape[-1]
    if c == 1:
        return jnp.ones_like(a)
    if c % 2:
        raise ValueError(f"block size {c} is not a power of two")
    h = c // 2
    both = unit_lower_inverse(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
    ai, di = both[0], both[1]
    low = -jnp.matmul(jnp.matmul(di, a[..., h:, :h], precision=HIGHEST), ai, precision=HIGHEST)
    top = jnp.concatenate([ai, jnp.zeros_like(ai)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([low, di], axis=-1)], axis=-2)


def _two_sum(a, b):
    """``a + b`` as (rounded sum, its exact rounding error) — Knuth's TwoSum, no branch, any float dtype."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def cumsum_two_float(g: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Inclusive cumulative sum over the last axis as ``hi + lo`` (about twice the dtype's precision).

    Why: the chunked form needs decays between positions, ``exp(γ_i − γ_j)``; formed from one rounded cumulative
    sum, the difference of two values of size |γ| (tens, for strongly decaying heads) carries an absolute error of
    ulp(|γ|) even when it is small — float32 chunked outputs were 10× further from the float64 truth than the
    token-by-token recurrence (measured: max 2.7–6.5e-7 against 3–5e-8 on T = 90, Dk 12, Dv 20). With the rounding
    errors kept, ``(hi_i − hi_j) + (lo_i − lo_j)`` is accurate to ulp of the difference itself.

    How: ``hi`` is one ordinary cumulative sum (whatever order XLA adds in); step j of it added
    ``hi_j − hi_{j−1}``, which TwoSum gives exactly as ``s + e``, instead of ``g_j``. ``g_j − s`` is exact
    whenever s is within a factor 2 of ``g_j`` (Sterbenz; otherwise both are below ulp(hi) and so is its error), so
    ``δ_j = (g_j − s) − e`` is what step j lost, and ``lo = cumsum(δ)`` (tiny values: its own rounding is
    negligible). Two cumsum primitives and a few elementwise ops: a double-word ``associative_scan`` (the form
    before 2026-12-05) unrolled into ~700 traced operations per GDN layer and made the GDN chunk's forward +
    backward compile ~1.1 s slower on CPU, for the same run time and accuracy.
    """
    hi = jnp.cumsum(g, axis=-1)
    prev = jnp.concatenate([jnp.zeros_like(hi[..., :1]), hi[..., :-1]], axis=-1)
    s, e = _two_sum(hi, -prev)
    return hi, jnp.cumsum((g - s) - e, axis=-1)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Chunked form of :func:`recurrent_gated_delta_rule` (same arguments and results).

    T is padded to a multiple of ``chunk_size`` with zeros for q, k, v, β *and* g, so the padding leaves the state
    unchanged (the bug of transformers #46190 was non-zero decay on padded positions).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta)
    s0 = zero_state(q, v) if initial_state is None else initial_state.astype(q.dtype)
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    hi, lo = cumsum_two_float(g)  # [B, H, N, C] log decay from chunk start, as hi + lo
    gc = hi + lo
    lower = jnp.tril(jnp.ones((c, c), bool))
    # exp(γ_i − γ_j) for i ≥ j, the difference taken on both words (see cumsum_two_float); the upper triangle is masked
    # before exp so it cannot overflow
    between = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
    decay = jnp.exp(jnp.where(lower, between, -jnp.inf))
    a = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=HIGHEST) * decay
    attn = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=HIGHEST) * decay
    # (I + strictly_lower(A)) X = B, unit diagonal: the UT transform that folds the chunk's delta updates together
    unit_lower = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0.0) + jnp.eye(c, dtype=q.dtype)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(gc)[..., None]], axis=-1)
    sol = jnp.matmul(unit_lower_inverse(unit_lower), rhs, precision=HIGHEST)
    u, w = sol[..., :dv], sol[..., dv:]

    q_dec = q * jnp.exp(gc)[..., None]
    k_dec = k * jnp.exp((hi[..., -1:] - hi) + (lo[..., -1:] - lo))[..., None]  # decay to the chunk's end
    chunk_decay = jnp.exp(gc[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(s, xs):
        u_i, w_i, q_i, k_i, attn_i, d_i = xs
        v_new = u_i - jnp.einsum("bhck,bhkv->bhcv", w_i, s, precision=HIGHEST)
        o_i = jnp.einsum("bhck,bhkv->bhcv", q_i, s, precision=HIGHEST) + jnp.einsum(
            "bhcj,bhjv->bhcv", attn_i, v_new, precision=HIGHEST)
        s = s * d_i + jnp.einsum("bhck,bhcv->bhkv", k_i, v_new, precision=HIGHEST)
        return s, o_i

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, attn, chunk_decay))
    s, o = jax.lax.scan(step, s0, xs)  # o: [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), s
