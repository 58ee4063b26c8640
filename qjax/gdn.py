"""The gated delta rule (MODEL.md §2.5) as pure functions.

Two forms with one signature: the exact token-by-token recurrence (the reference, used for single-token decode) and
the chunked form (64-token chunks, a unit-lower-triangular inverse per chunk and a scan across chunks) used for every
multi-token call. Everything runs in float32 — a bf16 recurrent state corrupts long decodes (MODEL.md §8.3) — and
every matmul asks for full fp32 precision so a GPU never silently drops to TF32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    """``x · rsqrt(Σx² + eps)`` over the last axis: eps inside the sqrt, as FLA and transformers do."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta):
    """Repeat qk heads onto v heads, move heads before time, go to fp32, l2-normalise q/k and scale q.

    In: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; g, beta ``[B, T, Hv]``.
    Out: q, k ``[B, Hv, T, Dk]``; v ``[B, Hv, T, Dv]``; g, beta ``[B, Hv, T]`` — all float32.
    """
    hk, hv = q.shape[2], v.shape[2]
    if hv != hk:
        # v head j reads qk head j // (hv/hk): repeat_interleave, not tile (MODEL.md §8.11)
        q = jnp.repeat(q, hv // hk, axis=2)
        k = jnp.repeat(k, hv // hk, axis=2)
    q, k, v, g, beta = (jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (q, k, v, g, beta))
    q = l2norm(q)
    k = l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def _zero_state(q, v):
    b, h, _, dk = q.shape
    return jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """Exact recurrence ``S ← e^g S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq``.

    Args:
      q, k: ``[B, T, Hk, Dk]``; v: ``[B, T, Hv, Dv]``; g (log decay, ≤ 0), beta: ``[B, T, Hv]``.
      initial_state: ``[B, Hv, Dk, Dv]`` float32 or None (zeros).
    Returns:
      o ``[B, T, Hv, Dv]`` in q's dtype, final state ``[B, Hv, Dk, Dv]`` float32.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s0 = _zero_state(q, v) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, D] / [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)
        return s, o_t

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 2)  # [B, H, T, Dv]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), s


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


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Chunked form of :func:`recurrent_gated_delta_rule` (same arguments and results).

    T is padded to a multiple of ``chunk_size`` with zeros for q, k, v, β *and* g, so the padding leaves the state
    unchanged (the bug of transformers #46190 was non-zero decay on padded positions).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s0 = _zero_state(q, v) if initial_state is None else initial_state.astype(jnp.float32)
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
    gc = jnp.cumsum(g, axis=-1)  # [B, H, N, C] log decay from chunk start
    lower = jnp.tril(jnp.ones((c, c), bool))
    # exp(γ_i − γ_j) for i ≥ j; the upper triangle is masked before exp so it cannot overflow
    decay = jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    a = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=HIGHEST) * decay
    attn = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=HIGHEST) * decay
    # (I + strictly_lower(A)) X = B, unit diagonal: the UT transform that folds the chunk's delta updates together
    unit_lower = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0.0) + jnp.eye(c, dtype=jnp.float32)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(gc)[..., None]], axis=-1)
    sol = jnp.matmul(unit_lower_inverse(unit_lower), rhs, precision=HIGHEST)
    u, w = sol[..., :dv], sol[..., dv:]

    q_dec = q * jnp.exp(gc)[..., None]
    k_dec = k * jnp.exp(gc[..., -1:] - gc)[..., None]
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
