"""Partial NeoX rotary embedding with interleaved M-RoPE (docs/model.md §2.4).

Only the first ``rotary_dim`` channels of each head rotate, pairing channel i with i + rotary_dim/2 (rotate-half).
Frequency j reads the T, H or W position row in the interleaved pattern T H W T H W …; for text all three rows are
equal and this is plain RoPE.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from qjax.kernels import accum_dtype
from qjax.model.config import TextConfig


def inv_freq(cfg: TextConfig, dtype=np.float32) -> np.ndarray:
    """``[rotary_dim/2]`` inverse frequencies ``1 / θ^(2j/R)``, computed in float64 and rounded once to ``dtype``
    (float32, or float64 for a float64 model).

    transformers computes them with a float32 ``pow``, which is off by up to a few float32 ulps; an angle of
    position × inv_freq carries that error times the position (measured on the test configs: cos/sin 5.0e-6 from the
    float64 truth with the float32 pow at positions < 5000, 3.1e-6 for transformers' own, 1 ulp or less rounded
    once)."""
    r = cfg.rotary_dim
    exps = np.arange(0, r, 2, dtype=np.float64) / r
    return (1.0 / (float(cfg.rope_theta) ** exps)).astype(dtype)


def mrope_rows(cfg: TextConfig) -> np.ndarray:
    """``[rotary_dim/2]`` int: which position row (0 = T, 1 = H, 2 = W) frequency j reads."""
    half = cfg.rotary_dim // 2
    sec = cfg.mrope_section
    rows = np.zeros(half, np.int32)
    for j in range(half):
        if j % 3 == 1 and j < 3 * sec[1]:
            rows[j] = 1
        elif j % 3 == 2 and j < 3 * sec[2]:
            rows[j] = 2
    return rows


def rope_cos_sin(cfg: TextConfig, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables for ``positions``.

    Args:
      positions: ``[B, T]`` text positions or ``[3, B, T]`` (T, H, W) M-RoPE positions, integer.
      dtype: activation dtype; transformers casts cos/sin to it before rotating. The angles are formed in its
        accumulation dtype (float32; float64 for a float64 model).
    Returns:
      cos, sin: ``[B, T, rotary_dim]``.
    """
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions[None], (3, *positions.shape))
    acc = accum_dtype(dtype)
    freqs = positions.astype(acc)[..., None] * jnp.asarray(inv_freq(cfg, acc))  # [3, B, T, R/2]
    rows = jnp.asarray(mrope_rows(cfg))
    sel = jnp.where(rows == 1, freqs[1], jnp.where(rows == 2, freqs[2], freqs[0]))  # [B, T, R/2]
    emb = jnp.concatenate([sel, sel], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate the first ``R = cos.shape[-1]`` channels of every head, in x's dtype as transformers' text
    ``apply_rotary_pos_emb`` does (a bf16 model rotates in bf16: only the vision tower's rotation upcasts).

    Args:
      x: ``[B, T, heads, head_dim]``.
      cos, sin: ``[B, T, R]`` in x's dtype.
    """
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot = jnp.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], axis=-1)
    return jnp.concatenate([xr * c + rot * s, xp], axis=-1).astype(x.dtype)
