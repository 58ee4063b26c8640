"""Quantize-dequantize functions of auto-round 0.16.1, re-derived in JAX (docs/autoround.md §1.2, §2, §11-14).

Every weight is ``[*lead, N, K]`` (``lead = ()`` for a Linear, ``(E,)`` for stacked experts); groups run along K.
``group_size`` g > 0 means groups of g input channels (K % g == 0 is required: auto-round's zero padding of a ragged
last group is not supported), g == -1 means one group per output channel. With ``G = K // g`` (or 1) and
``gs = g`` (or K) the trainable tensors are ``v [*lead, N, G, gs]`` and ``alpha``, ``beta`` ``[*lead, N, G]``, all
float32; the layout is the one of auto-round's ``[N * G, gs]`` grouped weight, with the leading dims kept.

Bit-exactness with auto-round comes from reproducing torch's dtype rules op by op:

* a binary op between a bf16 and an fp16 tensor, or with a float32 tensor, runs in float32;
* a bf16/fp16 op with a Python scalar runs in float32 (the scalar is rounded to float32, not to bf16) and its result
  is rounded to the tensor dtype (``_rnd``);
* the scale is rounded to ``scale_dtype`` inside the differentiable graph, as in ``quant_tensor_sym``.

All functions are jit-able (``bits``, ``group_size``, ``scale_dtype`` and ``per_head`` are static Python values) and
differentiable with respect to ``v``, ``alpha`` and ``beta``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32
E4M3_MAX = 448.0  # largest float8_e4m3fn magnitude (torch.finfo(torch.float8_e4m3fn).max)
MX_GROUP_SIZE = 32  # elements sharing one E8M0 scale in MXFP8
_E4M3_EMAX = 8  # exponent of E4M3's largest binade: auto-round's shared exponent is floor(log2(amax)) - 8
_E4M3_MIN_EXP = -6  # smallest normal E4M3 exponent (auto-round's quant_element clips the private exponent here)
_E4M3_MBITS = 3  # stored mantissa bits (auto-round's mbits = 5 counts the sign and the implicit bit)


# ---------------------------------------------------------------------------------------------------------------------
# straight-through estimators
# ---------------------------------------------------------------------------------------------------------------------
def round_ste(x: jax.Array) -> jax.Array:
    """Round half to even in the forward pass, identity gradient (auto-round ``round_ste``)."""
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def clamp_ste(x: jax.Array, lo: float, hi: float) -> jax.Array:
    """``clip(x, lo, hi)`` whose gradient is 1 on ``[lo, hi]`` inclusive and 0 outside, like ``torch.clamp``.

    ``jnp.clip`` would give 0.5 at a bound and ``lax.clamp`` 0; after rounding, q sits exactly on a bound very
    often (int2: 2 of the 4 levels), so the difference changes which parameters move (docs/autoround.md §2.4).
    """
    inside = (x >= lo) & (x <= hi)
    return jnp.where(inside, x, jax.lax.stop_gradient(jnp.clip(x, lo, hi)))


# ---------------------------------------------------------------------------------------------------------------------
# grouping
# ---------------------------------------------------------------------------------------------------------------------
def group_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    """``(G, gs)`` for a weight of shape ``[..., N, K]``: groups of ``group_size`` along K, or one group of K (-1)."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"weight shape {shape}: expected [..., N, K] with at least 2 dims")
    k = shape[-1]
    if group_size == -1:
        return 1, k
    if group_size <= 0:
        raise ValueError(f"weight shape {shape}: group_size must be > 0 or -1, got {group_size}")
    if k % group_size:
        raise ValueError(f"weight shape {shape}: K={k} is not a multiple of group_size={group_size}")
    return k // group_size, group_size


def _grouped(x: jax.Array, group_size: int) -> jax.Array:
    """``[..., N, K]`` -> ``[..., N, G, gs]`` (a free reshape)."""
    g, gs = group_shape(x.shape, group_size)
    return x.reshape(*x.shape[:-1], g, gs)


def weight_minmax(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """Per-group range widened to contain 0: ``(min(group_min, 0), max(group_max, 0))``, each f32 ``[*lead, N, G]``.

    Computed once from the frozen weight (auto-round ``WrapperLinear.weight_min`` / ``weight_max``).
    """
    wg = _grouped(w, group_size)
    wmin = jnp.minimum(jnp.min(wg, axis=-1), 0).astype(_F32)
    wmax = jnp.maximum(jnp.max(wg, axis=-1), 0).astype(_F32)
    return wmin, wmax


def init_params(w: jax.Array, group_size: int) -> dict[str, jax.Array]:
    """Trainable tensors at their auto-round start: ``v = 0 [*lead, N, G, gs]``, ``alpha = beta = 1 [*lead, N, G]``."""
    g, gs = group_shape(w.shape, group_size)
    lead_n = tuple(w.shape[:-1])
    return {
        "v": jnp.zeros((*lead_n, g, gs), _F32),
        "alpha": jnp.ones((*lead_n, g), _F32),
        "beta": jnp.ones((*lead_n, g), _F32),
    }


# ---------------------------------------------------------------------------------------------------------------------
# helpers reproducing torch's rounding
# ---------------------------------------------------------------------------------------------------------------------
def _compute_dtype(x: jax.Array) -> jnp.dtype:
    """The dtype torch would compute ``x``'s own ops in: its dtype if a float16/bfloat16/float32, else float32."""
    dt = jnp.dtype(x.dtype)
    return dt if dt in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(_F32)) else jnp.dtype(_F32)


def _round_to(x: jax.Array, dtype) -> jax.Array:
    """f32 ``x`` rounded (to nearest even) to the values of ``dtype``, still f32.

    ``x.astype(bf16).astype(f32)`` is not enough: with XLA's default ``xla_allow_excess_precision`` such a convert
    pair is dropped inside fusions, which silently keeps f32 precision (measured on CPU: 94 of 296 bf16
    ``search_scales`` groups changed). XLA's ``reduce-precision`` is an explicit rounding it keeps; it flushes what
    would be float16 subnormals to zero, so those (|x| < 2^-14, where fp16 scales of ~1e-5 live) are rounded on
    their fixed grid of 2^-24 instead. Bit-identical to numpy's casts on 2.4 million values from 1e-9 to 7e4 and the
    edge cases (±0, ±inf, NaN, 65504/65520, the subnormal boundaries); the integer bit manipulation used before
    traced ~4× the operations (a quarter of the AutoRound step's).
    """
    dt = jnp.dtype(dtype)
    if dt == jnp.dtype(_F32):
        return x
    if dt == jnp.dtype(jnp.bfloat16):
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    if dt == jnp.dtype(jnp.float16):
        subnormal = jnp.round(x * 2.0 ** 24) * 2.0 ** -24  # exact: a power-of-two scaling and an integer
        normal = jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
        return jnp.where(jnp.abs(x) < 2.0 ** -14, subnormal, normal)
    raise TypeError(f"unsupported rounding dtype {dt}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rnd(x: jax.Array, dtype) -> jax.Array:
    """Round the f32 result of one op to ``dtype``, keep f32: what torch stores for a bf16/fp16 op computed in f32.

    The gradient is rounded the same way, as torch's gradient of a bf16/fp16 tensor has that tensor's dtype.
    """
    return _round_to(x, dtype)


def _rnd_fwd(x: jax.Array, dtype) -> tuple[jax.Array, None]:
    return _round_to(x, dtype), None


def _rnd_bwd(dtype, _res: None, ct: jax.Array) -> tuple[jax.Array]:
    return (_round_to(ct, dtype),)


_rnd.defvjp(_rnd_fwd, _rnd_bwd)


def _cast(x: jax.Array, dtype) -> jax.Array:
    """f32 -> ``dtype`` rounding first with :func:`_rnd`, so the convert itself is exact and cannot be elided."""
    return _rnd(x, dtype).astype(dtype)


def _true_div(x: jax.Array, y) -> jax.Array:
    """``x / y`` as a correctly rounded division, like torch's.

    XLA's algebraic simplifier rewrites ``A / broadcast(B)`` (a scalar or a per-group divisor broadcast over the
    group) into ``A * broadcast(1 / B)``, one rounding more: measured on CPU, 16494 of 64000 quotients ``w / s``
    were 1 ulp off. Hiding the broadcast divisor behind an optimization barrier keeps a real division.
    """
    y = jnp.broadcast_to(jnp.asarray(y, x.dtype), jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y)))
    return x / jax.lax.optimization_barrier(y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_rnd(x: jax.Array, dtype) -> jax.Array:
    """Identity whose gradient is rounded to ``dtype``: one use of a bf16/fp16 tensor in torch's autograd, where
    each use's gradient is reduced in f32 and cast to the tensor's dtype before the uses are added up."""
    return x


def _grad_rnd_fwd(x: jax.Array, dtype) -> tuple[jax.Array, None]:
    return x, None


def _grad_rnd_bwd(dtype, _res: None, ct: jax.Array) -> tuple[jax.Array]:
    return (_round_to(ct, dtype),)


_grad_rnd.defvjp(_grad_rnd_fwd, _grad_rnd_bwd)


@jax.custom_vjp
def _div(x: jax.Array, s: jax.Array) -> jax.Array:
    """``x / s`` (``s`` broadcast along the last axis when its last dim is 1) with torch's backward formulas:
    ``d x = g / s`` and ``d s = sum(-g * ((x / s) / s))`` (``div_tensor_other_backward``), which round differently
    from JAX's ``-g * x * s**-2``."""
    return _true_div(x, s)


def _div_fwd(x: jax.Array, s: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _true_div(x, s), (x, s)


def _div_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, s = res
    ds = -g * _true_div(_true_div(x, s), s)
    if s.shape != ds.shape:
        ds = jnp.sum(ds, axis=-1, keepdims=True)
    return _true_div(g, s), ds


_div.defvjp(_div_fwd, _div_bwd)


def _scale_thresh(scale_dtype) -> float:
    """auto-round's ``q_scale_thresh``: 1e-8 when scales are kept in float32, else 1e-5."""
    return 1e-8 if jnp.dtype(scale_dtype) == jnp.dtype(_F32) else 1e-5


def _floor_magnitude(s: jax.Array, thr: float, dtype, *, signed: bool) -> jax.Array:
    """``torch.where(s < 0, clamp(s, max=-thr), clamp(s, min=thr))`` on a ``dtype`` tensor, f32 in and out.

    torch compares in float32 against float32(thr) and stores the bound rounded to ``dtype``; the gradient passes
    where ``s`` is inside the bound, inclusive (torch.clamp), and is 0 where the bound is substituted.
    """
    thr32 = float(np.float32(thr))
    bound = float(np.asarray(np.float32(thr)).astype(jnp.dtype(dtype)).astype(np.float32))
    pos = jnp.where(s < thr32, bound, s)
    if not signed:
        return pos
    return jnp.where(s < 0, jnp.where(s > -thr32, -bound, s), pos)


# ---------------------------------------------------------------------------------------------------------------------
# int quantize-dequantize (SignRound)
# ---------------------------------------------------------------------------------------------------------------------
def qdq_int_sym(
    w: jax.Array,
    v: jax.Array,
    alpha: jax.Array,
    beta: jax.Array,
    wmin: jax.Array,
    wmax: jax.Array,
    *,
    bits: int,
    group_size: int,
    scale_dtype=jnp.float16,
    init_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """auto-round ``int_sym`` (``quant_tensor_sym``): full-range symmetric int with a signed scale.

    Args:
      w: frozen weight ``[*lead, N, K]`` (bf16/fp16/f32).
      v: rounding offsets f32 ``[*lead, N, G, gs]``.
      alpha, beta: ``max_scale`` / ``min_scale`` f32 ``[*lead, N, G]`` (callers clamp them, see ``optim``).
      wmin, wmax: f32 ``[*lead, N, G]`` from :func:`weight_minmax`.
      init_scale: alg_ext searched scale f32 ``[*lead, N, G]`` (:func:`search_scales`); then
        ``s = scale_dtype(init_scale * alpha)`` and ``beta``, ``wmin``, ``wmax`` are unused.

    The dominant side's extreme maps to ``-2^(b-1)``, the level with no positive counterpart, so the scale is
    negative when the positive side is larger. The scale is rounded to ``scale_dtype`` and floor-clamped to
    +-1e-5 (1e-8 for a float32 ``scale_dtype``) inside the graph.

    Returns:
      ``(w_dq [*lead, N, K] w.dtype, scale f32 [*lead, N, G] holding scale_dtype values, q int32 [*lead, N, K])``
      with ``q`` in ``[-2^(b-1), 2^(b-1) - 1]``.
    """
    nmax = 2 ** (bits - 1)
    if init_scale is None:
        lo = -(wmin * beta)  # magnitude of the negative side
        hi = wmax * alpha
        # -1 unless the negative side dominates; a constant factor, so no gradient goes through the comparison.
        sign = jax.lax.stop_gradient(jnp.where(hi < lo, 1.0, -1.0).astype(_F32))
        s = sign * jnp.maximum(hi, lo) / nmax
    else:
        s = init_scale.astype(_F32) * alpha
    s = _floor_magnitude(_rnd(s, scale_dtype), _scale_thresh(scale_dtype), scale_dtype, signed=True)
    # torch reduces the scale's gradient from `w / s` and from `s * q` separately, casting each to scale_dtype
    # before adding them (in scale_dtype); mirroring that keeps alpha/beta gradients close to auto-round's.
    s_div, s_mul = _grad_rnd(s, scale_dtype)[..., None], _grad_rnd(s, scale_dtype)[..., None]
    x = _div(_grouped(w, group_size).astype(_F32), s_div) + v  # bf16 / fp16 promotes to f32 in torch too
    q = clamp_ste(round_ste(x), -nmax, nmax - 1)
    w_dq = _cast(s_mul * q, w.dtype).reshape(w.shape)
    return w_dq, s, jax.lax.stop_gradient(q).astype(jnp.int32).reshape(w.shape)


def qdq_int_asym(
    w: jax.Array,
    v: jax.Array,
    alpha: jax.Array,
    beta: jax.Array,
    wmin: jax.Array,
    wmax: jax.Array,
    *,
    bits: int,
    group_size: int,
    scale_dtype=jnp.float16,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """auto-round ``int_asym`` (``quant_tensor_asym``); the zero point goes through ``round_ste`` (it has gradient).

    ``s = max(scale_dtype((wmax*alpha - wmin*beta) / (2^b - 1)), thr)``, ``zp = round(-wmin*beta / s)``,
    ``q = clamp(round(w / s + v) + zp, 0, 2^b - 1)``, ``w_dq = s * (q - zp)``. Shapes as :func:`qdq_int_sym`.

    Returns:
      ``(w_dq [*lead, N, K] w.dtype, scale f32 [*lead, N, G], zp int32 [*lead, N, G], q int32 [*lead, N, K])``,
      ``q`` and ``zp`` in ``[0, 2^b - 1]``.
    """
    maxq = 2**bits - 1
    lo = wmin * beta
    hi = wmax * alpha
    s = _rnd(_true_div(hi - lo, float(maxq)), scale_dtype)
    s = _floor_magnitude(s, _scale_thresh(scale_dtype), scale_dtype, signed=False)
    # Gradient grouping as in torch: uses of the unsqueezed scale (`w / s`, `s * (q - zp)`) are each cast to
    # scale_dtype and added, then added to the zero point's use (`-lo / s`), each sum in scale_dtype.
    s_col = _grad_rnd(s, scale_dtype)[..., None]
    s_div, s_mul = _grad_rnd(s_col, scale_dtype), _grad_rnd(s_col, scale_dtype)
    zp = round_ste(_div(-lo, _grad_rnd(s, scale_dtype)))
    x = _div(_grouped(w, group_size).astype(_F32), s_div) + v
    q = clamp_ste(round_ste(x) + zp[..., None], 0, maxq)
    w_dq = _cast(s_mul * (q - zp[..., None]), w.dtype).reshape(w.shape)
    # zp lies in [0, maxq] by construction (lo <= 0 <= hi); the clip only guards the int cast.
    zp_int = jnp.clip(jax.lax.stop_gradient(zp), 0, maxq).astype(jnp.int32)
    return w_dq, s, zp_int, jax.lax.stop_gradient(q).astype(jnp.int32).reshape(w.shape)


def qdq_unit(w, p: dict, c: dict, s, scale_dtype):
    """One unit's quantize-dequantize under scheme ``s`` (a :class:`.schemes.Scheme`, symmetric or asymmetric int)
    with its tunable ``p`` (v, alpha, beta) and frozen ``c`` (wmin, wmax, alg_ext's init_scale) → ``(dequantized w,
    scale, zp or None, q)``: what the blocks' loss, the end of a block and the head's loss all quantize with."""
    if s.sym:
        wdq, scale, q = qdq_int_sym(w, p["v"], p["alpha"], p["beta"], c["wmin"], c["wmax"], bits=s.bits,
                                    group_size=s.group_size, scale_dtype=scale_dtype, init_scale=c.get("init_scale"))
        return wdq, scale, None, q
    wdq, scale, zp, q = qdq_int_asym(w, p["v"], p["alpha"], p["beta"], c["wmin"], c["wmax"], bits=s.bits,
                                     group_size=s.group_size, scale_dtype=scale_dtype)
    return wdq, scale, zp, q


# ---------------------------------------------------------------------------------------------------------------------
# imatrix-weighted initial scale search (alg_ext, opt-RTN)
# ---------------------------------------------------------------------------------------------------------------------
def _search_multipliers(bits: int) -> np.ndarray:
    """``-(nmax - step*k)`` for k = 0, then k = -S..S without 0, in auto-round's order, rounded to float32.

    int2: k in [-90, 90], step 0.01. Other widths: 200 steps spanning +-ratio*nmax, ratio from the environment
    variable ``AR_SEARCH_SCALE_RATIO`` (auto-round reads the same variable) or 0.75. The arithmetic is done in
    Python floats exactly as auto-round does it, so ``int()`` truncates the same way.
    """
    nmax = int(2.0 ** (bits - 1))
    if bits == 2:
        search_min, step = 18 * 5, 0.01
    else:
        env = os.getenv("AR_SEARCH_SCALE_RATIO")
        ratio = (float(env) if env is not None else None) or 0.75
        span = nmax * ratio
        step = span / 200 * 2
        search_min = int(span / step)
    ks = [0] + [k for k in range(-search_min, search_min + 1) if k != 0]
    # torch multiplies a bf16/f32 tensor by a Python float in float32 arithmetic.
    return np.asarray([-(nmax - step * k) for k in ks], np.float64).astype(np.float32)


def _reciprocal(t: jax.Array, dtype) -> jax.Array:
    """auto-round ``get_reciprocal`` on a ``dtype`` tensor (f32 in/out): 0 where ``|t| < eps``, else ``1/t``."""
    eps = 1e-5 if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else 1e-30
    safe = jnp.abs(t) >= eps
    return jnp.where(safe, _rnd(1.0 / jnp.where(safe, t, 1.0), dtype), 0.0)


def _broadcast_imatrix(imatrix: jax.Array | None, w: jax.Array, group_size: int) -> jax.Array | None:
    """imatrix ``[K]``, ``[*lead, K]`` (one row per stacked matrix: the experts' ``[E, K]``) or anything broadcastable
    to ``[*lead, N, K]`` -> f32 ``[*lead, N, G, gs]`` (None stays None)."""
    if imatrix is None:
        return None
    im = jnp.asarray(imatrix, _F32)
    if 1 < im.ndim == w.ndim - 1 and im.shape == w.shape[:-2] + w.shape[-1:]:
        im = im[..., None, :]  # [*lead, K]: the same channel weights for every output row of that matrix
    im = jnp.broadcast_to(im, w.shape)
    return _grouped(im, group_size)


def handle_imatrix_zeros(imatrix_g: jax.Array, w_g: jax.Array, *, bits: int, group_size: int | None) -> jax.Array:
    """auto-round ``_imatrix_handle_zero`` (applied by opt-RTN, not by alg_ext), per matrix.

    ``imatrix_g`` f32 and ``w_g`` are grouped ``[*lead, N, G, gs]``; a matrix is the last three axes (auto-round sees
    one Linear at a time). If the matrix's imatrix holds an exact 0: groups with more than ``group_size // 2``
    entries <= 1e-30 fall back to ``|w|`` (bits <= 3) or ``|w| + sqrt(sum(w^2) / 32)`` (computed in w's dtype);
    then, if some group has between 1 and ``group_size // 2`` such entries, every exact 0 left in the matrix becomes
    its group's sum divided by the group's count of entries > 1e-30 (inf/nan where that count is 0, as in
    auto-round). ``group_size`` is the layer's (-1 makes every group fall back); None means 16 for int2, else 32.
    """
    dt = _compute_dtype(w_g)
    w32 = w_g.astype(_F32)
    gs = imatrix_g.shape[-1]
    half = (group_size if group_size is not None else (16 if bits == 2 else 32)) // 2
    mat_axes = (-3, -2, -1)
    has_zero = jnp.any(imatrix_g == 0, axis=mat_axes, keepdims=True)
    zero_cnt = jnp.sum(imatrix_g <= 1e-30, axis=-1, keepdims=True)
    if bits <= 3:
        fallback = jnp.abs(w32)
    else:
        sigma2 = _rnd(_rnd(jnp.sum(_rnd(w32 * w32, dt), axis=-1, keepdims=True), dt) / 32, dt)
        fallback = _rnd(jnp.abs(w32) + _rnd(jnp.sqrt(sigma2), dt), dt)
    im = jnp.where(has_zero & (zero_cnt > half), fallback, imatrix_g)
    mean_groups = has_zero & (zero_cnt > 0) & (zero_cnt <= half)
    any_mean = jnp.any(mean_groups, axis=mat_axes, keepdims=True)
    group_mean = _true_div(jnp.sum(im, axis=-1, keepdims=True), (gs - zero_cnt).astype(_F32))
    return jnp.where(any_mean & (im == 0), group_mean, im)


def search_scales(
    w: jax.Array,
    imatrix: jax.Array | None,
    *,
    bits: int,
    group_size: int,
    handle_zero: bool = False,
    scale_thresh: float = 1e-5,
) -> jax.Array:
    """alg_ext / opt-RTN initial scale (auto-round ``data_type/int.py: search_scales``), floor-clamped.

    Per group, ``gmax`` is the signed element of largest magnitude; candidate scales ``s = 1 / (-(nmax - step*k) /
    gmax)`` (k = 0 is the plain full-range scale) are scored by ``sum(imatrix * (s * clamp(round(w / s), -nmax,
    nmax - 1) - w)^2)`` and the first minimum wins. The arithmetic runs in w's dtype like auto-round's (bf16
    candidates and products, squared error in f32), so a bf16 weight gets the same argmin as auto-round, not the
    one an f32 search would give (docs/autoround.md §11a). The candidates are scanned with ``lax.scan`` so memory stays
    a few copies of w.

    Args:
      w: ``[*lead, N, K]``.
      imatrix: sum of x^2 per input channel, ``[K]`` or broadcastable to ``[*lead, N, K]``; None = ones.
      handle_zero: apply :func:`handle_imatrix_zeros` first (auto-round's opt-RTN path does, alg_ext does not).
      scale_thresh: magnitude floor (auto-round's ``q_scale_thresh``, 1e-5 unless scales are kept in f32).

    Returns:
      ``s0`` f32 ``[*lead, N, G]`` (signed, holding values of w's dtype).
    """
    dt = _compute_dtype(w)
    nmax = int(2 ** (bits - 1))
    w32 = _grouped(w, group_size).astype(dt).astype(_F32)
    qw = _broadcast_imatrix(imatrix, w, group_size)
    if qw is not None and handle_zero:
        qw = handle_imatrix_zeros(qw, w32.astype(dt), bits=bits, group_size=group_size)

    idx = jnp.argmax(jnp.abs(w32), axis=-1, keepdims=True)  # first maximum, like torch.argmax
    recip = _reciprocal(jnp.take_along_axis(w32, idx, axis=-1), dt)  # [*, G, 1]

    def candidate(mult: jax.Array) -> tuple[jax.Array, jax.Array]:
        iscale = _rnd(mult * recip, dt)
        scale = _reciprocal(iscale, dt)
        levels = jnp.clip(jnp.round(_rnd(iscale * w32, dt)), -nmax, nmax - 1)
        err = _rnd(_rnd(scale * levels, dt) - w32, dt)
        sq = err * err if qw is None else err * err * qw
        return jnp.sum(sq, axis=-1), scale[..., 0]

    mults = jnp.asarray(_search_multipliers(bits))

    def step(carry, mult):
        best_loss, best_scale = carry
        loss, scale = candidate(mult)
        better = loss < best_loss  # strict: the earliest minimum is kept, as in auto-round's in-place update
        return (jnp.where(better, loss, best_loss), jnp.where(better, scale, best_scale)), None

    (_, best), _ = jax.lax.scan(step, candidate(mults[0]), mults[1:])
    return _floor_magnitude(best, scale_thresh, dt, signed=True)


def opt_rtn_int_sym(
    w: jax.Array, imatrix: jax.Array | None, *, bits: int, group_size: int, scale_thresh: float = 1e-5
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """auto-round optimized RTN for sym int (``opt_rtn_int_sym`` / ``quant_tensor_opt_rtn_sym``, §12).

    ``s = search_scales(w, imatrix, handle_zero=True)``; then ``q = clamp(round(w / s), -nmax, nmax - 1)`` and
    ``w_dq = q * s`` with both ops rounded to w's dtype, as auto-round does them in bf16 (``tensor.div(scale)``
    rounds the quotient to bf16 before ``round``, unlike :func:`qdq_int_sym`'s f32 quotient, so
    ``qdq_int_sym(init_scale=s)`` is not a substitute). The scale stays in w's dtype (not rounded to fp16).

    Returns:
      ``(w_dq [*lead, N, K] w.dtype, scale f32 [*lead, N, G] holding w-dtype values, q int32 [*lead, N, K])``.
    """
    dt = _compute_dtype(w)
    nmax = int(2 ** (bits - 1))
    s = search_scales(w, imatrix, bits=bits, group_size=group_size, handle_zero=True, scale_thresh=scale_thresh)
    w32 = _grouped(w, group_size).astype(dt).astype(_F32)
    q = jnp.clip(jnp.round(_rnd(_true_div(w32, s[..., None]), dt)), -nmax, nmax - 1)
    w_dq = _cast(_rnd(q * s[..., None], dt), w.dtype).reshape(w.shape)
    return w_dq, s, q.astype(jnp.int32).reshape(w.shape)


# ---------------------------------------------------------------------------------------------------------------------
# MXFP8 (E4M3 elements, E8M0 scale per 32)
# ---------------------------------------------------------------------------------------------------------------------
def _floor_log2(x: jax.Array) -> jax.Array:
    """Exact ``floor(log2(x))`` for f32 ``x > 0`` from the exponent bits (XLA's CPU log2 is not exact).

    Subnormals give -127; every caller clips far above that.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.int32)
    return (((bits >> 23) & 0xFF) - 127).astype(_F32)


def _pow2(e: jax.Array) -> jax.Array:
    """Exact ``2^e`` for integer-valued f32 ``e`` in [-126, 127], built from the exponent bits (XLA's exp2 is not
    exact). ``e = -127`` gives 0 instead of the subnormal 2^-127 (XLA on CPU flushes subnormals anyway)."""
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, _F32)


def _quant_e4m3(t: jax.Array) -> jax.Array:
    """auto-round ``quant_element`` for E4M3 (f32 in, f32 values exactly representable in float8_e4m3fn out).

    Private exponent ``floor(log2|t|)`` clipped at -6 (subnormals), 3 mantissa bits, round half to even written as
    auto-round writes it, then clip to +-448.
    """
    pe = jnp.maximum(_floor_log2(jnp.abs(t) + (t == 0).astype(_F32)), float(_E4M3_MIN_EXP))
    p = _pow2(pe)
    y = t / p * float(2**_E4M3_MBITS)
    ay = jnp.abs(y)
    tie_to_even = (jnp.mod(ay - 0.5, 2.0) == 0).astype(_F32)
    y = jnp.sign(y) * (jnp.floor(ay + 0.5) - tie_to_even)
    return jnp.clip(y / float(2**_E4M3_MBITS) * p, -E4M3_MAX, E4M3_MAX)


def _mx_candidate(xg: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One MXFP8 quantization of groups ``xg`` f32 ``[..., 32]`` with shared max ``amax`` ``[..., 1]``.

    Returns (elements f32 ``[..., 32]``, shared exponent f32 ``[..., 1]`` in [-127, 127], dequantized f32).
    """
    # auto-round: floor(where(amax == 0, 1, log2(amax))) - emax, clamped to the E8M0 range.
    se = jnp.where(amax == 0, 1.0, _floor_log2(jnp.where(amax == 0, 1.0, amax)))
    se = jnp.clip(se - _E4M3_EMAX, -127.0, 127.0)
    scale = _pow2(se)
    el = _quant_e4m3(jnp.clip(_true_div(xg, scale), -E4M3_MAX, E4M3_MAX))
    return el, se, el * scale


def quantize_mxfp8(w: jax.Array, imatrix: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """auto-round MXFP8 round-to-nearest (``data_type/mxfp.py``).

    Without ``imatrix``: ``quant_mx`` (shared exponent ``floor(log2(amax)) - 8``). With ``imatrix`` (``[K]`` or
    broadcastable to w): ``quant_mx_opt_rtn``, which first replaces imatrix zeros (:func:`handle_imatrix_zeros`,
    group 32) and then picks, per group, ``amax * t`` for t in (1, 0.5, 2) minimizing the imatrix-weighted squared
    error (first minimum wins). ``imatrix = ones`` gives auto-round's opt-RTN choice without calibration data.

    Args:
      w: ``[*lead, N, K]`` with ``K % 32 == 0``.

    Returns:
      ``(values float8_e4m3fn [*lead, N, K], scale uint8 E8M0 [*lead, N, K/32] = shared_exp + 127,
      w_dq [*lead, N, K] in w.dtype)``.
    """
    if w.ndim < 2 or w.shape[-1] % MX_GROUP_SIZE:
        raise ValueError(f"weight shape {tuple(w.shape)}: MXFP8 needs [..., N, K] with K % {MX_GROUP_SIZE} == 0")
    xg = _grouped(w, MX_GROUP_SIZE).astype(_F32)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    el, se, dq = _mx_candidate(xg, amax)
    if imatrix is not None:
        qw = handle_imatrix_zeros(_broadcast_imatrix(imatrix, w, MX_GROUP_SIZE), xg, bits=8, group_size=MX_GROUP_SIZE)
        best = jnp.sum((dq - xg) ** 2 * qw, axis=-1, keepdims=True)
        for t in (0.5, 2.0):  # the shared exponent only changes across powers of two
            el_t, se_t, dq_t = _mx_candidate(xg, amax * t)
            loss = jnp.sum((dq_t - xg) ** 2 * qw, axis=-1, keepdims=True)
            better = loss < best
            best = jnp.where(better, loss, best)
            el, se, dq = jnp.where(better, el_t, el), jnp.where(better, se_t, se), jnp.where(better, dq_t, dq)
    values = el.astype(jnp.float8_e4m3fn).reshape(w.shape)
    scale = (se[..., 0] + 127).astype(jnp.uint8)
    return values, scale, _cast(dq, w.dtype).reshape(w.shape)


# ---------------------------------------------------------------------------------------------------------------------
# static FP8 KV-cache scale
# ---------------------------------------------------------------------------------------------------------------------
def fp8_kv_scale(x: jax.Array, *, per_head: bool) -> jax.Array:
    """auto-round static FP8 KV scale ``max(amax|x| / 448, 1 / (448 * 512))`` f32 (``experimental/utils.py``).

    Args:
      x: keys or values ``[B, T, Hkv, D]`` (qjax layout; auto-round's is ``[B, Hkv, T, D]``).
      per_head: one scale per KV head (``per_head_fp8_qdq``) instead of one per tensor (``per_tensor_fp8_qdq``).

    Returns:
      f32 ``[Hkv]`` per head, ``[1]`` per tensor.
    """
    if per_head:
        if x.ndim != 4:
            raise ValueError(f"per-head FP8 KV scale expects [B, T, Hkv, D], got {tuple(x.shape)}")
        if x.dtype == jnp.float16:  # auto-round's per-head path casts fp16 to bf16 before taking the max
            x = _rnd(x.astype(_F32), jnp.bfloat16)
        amax = jnp.max(jnp.abs(x), axis=(0, 1, 3)).astype(_F32)
    else:
        amax = jnp.max(jnp.abs(x)).astype(_F32).reshape(1)
    return jnp.maximum(_true_div(amax, E4M3_MAX), 1.0 / (E4M3_MAX * 512.0))
