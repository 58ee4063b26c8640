"""GPTQ as llm-compressor 0.14's ``GPTQModifier`` does it, as pure JAX functions (float32, jit-able).

Per linear layer: the Hessian ``H = 2 Σ x xᵀ / n`` of its calibration inputs (:func:`accumulate_hessian`; an expert's
from the tokens routed to it, :func:`routed_hessians`); then :func:`quantize_weight` (Frantar et al. 2022, §3.4):

1. activation order (``actorder`` "static" — llm-compressor's default — or its alias "weight"): columns sorted by
   ``diag(H)`` descending; each column keeps the quantization group of its original position ("static groups":
   ``g_idx`` permuted with the columns), so the stored format is unchanged;
2. dead columns (``H_ii = 0``, an input channel that never fired) get ``H_ii = 1`` and their weights are zeroed;
3. dampening ``H += dampening_frac · mean(diag H) · I``; ``Hinv = chol(H⁻¹)ᵀ`` (upper); a Hessian that is not
   positive definite after dampening falls back to ``Hinv = I``, i.e. plain RTN;
4. columns quantized in blocks of ``block_size``, each error ``(w - q) / Hinv_ii`` fed back into the columns after
   it (inside the block column by column, to the later blocks by one matmul).

The scales and zero points are the min/max observer's on the *original* weight (llm-compressor observes the weight
before GPTQ starts), so GPTQ only chooses the integer codes. What an expert that receives no token gets differs: in
llm-compressor (``moe_calibrate_all_experts=False``) its hook still fires with a ``[0, K]`` input, ``H = 0``, every
column is dead and the expert's weights are quantized to **all zeros**; qjax instead quantizes such an expert with
plain RTN (``H = I``: :func:`quantize_weight` with ``no_tokens``), since its weights are still used at inference on
other text.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from qjax.autoround.schemes import Scheme
from qjax.quant import fake_quant

_F32 = jnp.float32
ACTORDERS = (None, "static", "weight")  # "static" is compressed-tensors' alias of "weight"


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """llm-compressor's ``GPTQModifier`` options (same names and defaults)."""

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = "static"

    def __post_init__(self):
        if self.actorder not in ACTORDERS:
            raise ValueError(f"actorder must be one of {ACTORDERS} (the deprecated 'group'/'dynamic' orderings are "
                             f"removed in compressed-tensors), got {self.actorder!r}")
        if self.block_size <= 0 or not 0 <= self.dampening_frac:
            raise ValueError(f"block_size {self.block_size} / dampening_frac {self.dampening_frac} out of range")


# ---------------------------------------------------------------------------------------------------------------------
# Hessians
# ---------------------------------------------------------------------------------------------------------------------
def accumulate_hessian(hessian: jax.Array, x: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """``hessian [..., K, K] + Σ_t w_t · (√2 x_t)(√2 x_t)ᵀ`` in f32 for one calibration batch ``x [T, K]``.

    ``weights [..., T]`` (0/1): which tokens count, per leading slice (the routed-token mask of each expert,
    ``[E, T]``); None: every token. Divide by the sample count at the end (:func:`normalise`).
    """
    xs = math.sqrt(2) * x.reshape(-1, x.shape[-1]).astype(_F32)
    if weights is None:
        return hessian + xs.T @ xs
    return hessian + jnp.einsum("...t,tk,tl->...kl", weights.astype(_F32), xs, xs)


def normalise(hessian: jax.Array, num_samples) -> jax.Array:
    """``H / n``. llm-compressor counts samples per hook call (the batch's leading size: sequences for a dense layer,
    1 per call for an expert, whose input is a flat ``[tokens, K]``); any positive count gives the same GPTQ result
    up to rounding, since dampening is relative and the updates are ratios."""
    return hessian / jnp.asarray(num_samples, _F32)


@jax.jit
def routed_hessians(x: jax.Array, top_k_index: jax.Array, hessian: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Add one batch to every routed expert's Hessian: ``x [T, K]`` the MoE block input, ``top_k_index [T, k]`` the
    router's choices, ``hessian [E, K, K]``. Returns the new Hessians and each expert's token count ``[E]``."""
    e = hessian.shape[0]
    mask = jax.nn.one_hot(top_k_index, e, dtype=_F32).sum(axis=1).T  # [E, T]
    return accumulate_hessian(hessian, x, mask), mask.sum(axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------------------------------------
def _factorize(h: jax.Array, dampening_frac: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(Hinv upper [K, K], dead [K], fallback [])`` for one ``h [K, K]`` (llm-compressor's ``factorize_hessian``)."""
    k = h.shape[-1]
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    damp = dampening_frac * jnp.mean(jnp.diagonal(h))
    h = h + damp * jnp.eye(k, dtype=_F32)
    low = jnp.linalg.cholesky(h)
    ok = jnp.all(jnp.isfinite(low))
    eye = jnp.eye(k, dtype=_F32)
    low = jnp.where(ok, low, eye)
    hinv = jax.scipy.linalg.cho_solve((low, True), eye)  # H⁻¹ (torch.cholesky_inverse)
    hinv = (hinv + hinv.T) / 2  # exactly symmetric, as cholesky_inverse's result is
    upper = jnp.linalg.cholesky(hinv).T
    return jnp.where(ok, upper, eye), dead, ~ok


def _quantize_one(w, h, scale, zp, *, bits, group_size, block_size, dampening_frac, actorder):
    """GPTQ of ``w [N, K]`` with ``h [K, K]`` and fixed ``scale``/``zp`` ``[N, G]``: (dequantized f32 ``[N, K]``,
    loss, fallback)."""
    n, k = w.shape
    g = scale.shape[-1]
    w = w.astype(_F32)
    h = h.astype(_F32)
    gid = jnp.arange(k) // (k // g)
    if actorder is not None:
        perm = jnp.argsort(-jnp.diagonal(h), stable=True)
        w, h, gid = w[:, perm], h[perm][:, perm], gid[perm]
    hinv, dead, fallback = _factorize(h, dampening_frac)
    w = jnp.where(dead[None, :], 0.0, w)
    # per-column scale / zero point, expanded once ([N, K]); a column's group follows it through the permutation
    col_scale, col_zp = scale[:, gid].astype(_F32), zp[:, gid].astype(_F32)
    qmin, qmax = fake_quant.int_range(bits)

    def column_qdq(col, s, z):
        q = jnp.round(jnp.clip(col / s + z, qmin, qmax))
        return (q - z) * s

    losses = jnp.zeros((n,), _F32)
    quantized = []
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2]
        u1 = hinv[i1:i2, i1:i2]

        def body(i, carry, i1=i1, u1=u1):
            w1, q1, err1 = carry
            col = w1[:, i]
            q = column_qdq(col, col_scale[:, i1 + i], col_zp[:, i1 + i])
            err = (col - q) / u1[i, i]
            # u1 is upper triangular: row i is 0 left of the diagonal, so the whole-row update only touches i:
            w1 = w1 - err[:, None] * u1[i][None, :]
            return w1, q1.at[:, i].set(q), err1.at[:, i].set(err)

        zeros = jnp.zeros_like(w1)
        w1, q1, err1 = jax.lax.fori_loop(0, i2 - i1, body, (w1, zeros, zeros))
        quantized.append(q1)
        losses = losses + jnp.sum(err1 * err1, axis=1) / 2
        if i2 < k:
            w = w.at[:, i2:].add(-(err1 @ hinv[i1:i2, i2:]))
    q = jnp.concatenate(quantized, axis=1)
    if actorder is not None:
        q = q[:, jnp.argsort(perm, stable=True)]
    return q, jnp.sum(losses), fallback


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_size", "dampening_frac", "actorder"))
def _quantize_batched(w, h, scale, zp, *, bits, group_size, block_size, dampening_frac, actorder):
    fn = functools.partial(_quantize_one, bits=bits, group_size=group_size, block_size=block_size,
                           dampening_frac=dampening_frac, actorder=actorder)
    return jax.vmap(fn)(w, h, scale, zp)


def quantize_weight(w: jax.Array, hessian: jax.Array, scheme: Scheme, cfg: GPTQConfig = GPTQConfig(), *,
                    scale: jax.Array | None = None, zero_point: jax.Array | None = None,
                    no_tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """GPTQ of ``w [*lead, N, K]`` (a Linear, or ``[E, N, K]`` experts) with normalised Hessians ``[*lead, K, K]``.

    ``scale`` / ``zero_point`` ``[*lead, N, G]``: the observer's qparams (default: min/max of ``w``,
    :func:`qjax.quant.fake_quant.qparams`). ``no_tokens [*lead]`` bool: slices whose Hessian saw no token are
    quantized with plain RTN (``H = I``) instead of llm-compressor's all-zero weights.

    Returns ``(dequantized f32 [*lead, N, K], scale, zero_point, loss [*lead], rtn_fallback [*lead])``; the codes
    are :func:`qjax.quant.fake_quant.quantize_codes` of the dequantized weight with the same qparams (exact).
    """
    if not scheme.quantized or scheme.is_mxfp8:
        raise ValueError(f"GPTQ quantizes int schemes, got {scheme.describe()}")
    lead = w.shape[:-2]
    n, k = w.shape[-2:]
    if hessian.shape != (*lead, k, k):
        raise ValueError(f"hessian {hessian.shape} does not match weight {w.shape}")
    if scale is None:
        scale, zero_point = fake_quant.qparams(w, bits=scheme.bits, symmetric=scheme.sym, group_size=scheme.group_size)
    if no_tokens is not None:
        hessian = jnp.where(jnp.asarray(no_tokens)[..., None, None], jnp.eye(k, dtype=_F32), hessian)
    flat = lambda a, tail: a.reshape(-1, *a.shape[a.ndim - tail:])  # noqa: E731 — lead dims → one batch axis
    q, loss, fallback = _quantize_batched(
        flat(w, 2), flat(hessian, 2), flat(scale, 2), flat(zero_point, 2), bits=scheme.bits,
        group_size=scheme.group_size, block_size=cfg.block_size, dampening_frac=float(cfg.dampening_frac),
        actorder=None if cfg.actorder is None else "weight")
    return q.reshape(w.shape), scale, zero_point, loss.reshape(lead), fallback.reshape(lead)
