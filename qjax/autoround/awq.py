"""AWQ (activation-aware weight quantization) as llm-compressor 0.14's ``AWQModifier`` does it, as pure functions.

One **mapping** is a smooth layer (an RMSNorm, or ``up_proj`` whose output rows feed ``down_proj``) and the balance
layers that read its output. For a per-input-channel scale ``s [K]`` the model is unchanged when the smooth layer's
output is divided by ``s`` and every balance weight multiplied by it; AWQ picks the ``s`` whose quantized balance
weights ``Q(W · s) / s`` best reproduce the parent module's float output on the calibration inputs.

llm-compressor's recipe for ``qwen3_5_moe`` (``build_hybrid_attention_mappings``, docs in :data:`MAPPINGS`):
``input_layernorm`` → the full-attention ``q/k/v_proj`` or the GDN ``in_proj_qkv/z/b/a`` (parent: the mixer);
``post_attention_layernorm`` → every routed expert's ``gate/up_proj``, ``shared_expert_gate``, the shared expert's
``gate/up_proj`` (parent: the MoE block); each ``up_proj`` → its ``down_proj`` (parent: ``down_proj`` alone). It
leaves the router ``mlp.gate`` out (a TODO there: "is a Parameter"), so after smoothing the router reads ``x / s``:
router logits move (the seed-002 bug). qjax multiplies the router's columns by ``s`` too (:func:`balance`), which
keeps every logit equal to float tolerance (:func:`router_check`); the grid search is unaffected either way because
its parent runs on the unsmoothed input.

The search (:func:`search_scales`), per grid point ``(ratio, duo)``: ``s = x̄^ratio / (w̄^(1-ratio) + 1e-4)`` (duo)
or ``x̄^ratio`` clamped at 1e-4, normalised by ``sqrt(max(s) · min(s))``; loss = mean squared error of the parent's
output. ``x̄`` is the mean |activation| per channel over every calibration token that reaches the first balance layer
(with llm-compressor's default ``moe_calibrate_all_experts=True``, all tokens for an expert too); ``w̄`` the mean over
balance rows of ``|W|`` normalised by its quantization group's max (:func:`weight_mean`). llm-compressor computes
``w̄`` in float64, so duo-scaling scales are float64 and the folds ``W · s`` are computed in float64 then stored in
the weight dtype; :func:`grid_scales` and the folds reproduce that on the host (a ``[K]`` vector and one multiply per
weight). There is no clipping search in llm-compressor's AWQ (AutoAWQ's ``apply_clip`` is not ported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qjax.autoround.schemes import Scheme
from qjax.quant import fake_quant

_F32 = np.float32
_F64 = np.float64

# llm-compressor 0.14's dynamic mappings for Qwen3_5Moe* (relative names inside a decoder layer). The GDN projection
# names are detected from the model (qwen3.5: in_proj_qkv/z/b/a); qjax's model has the same four.
MAPPINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (smooth layer, balance layers); the parent is the balance layers' lowest common ancestor
    "full_attention": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "linear_attention": ("input_layernorm", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                                             "linear_attn.in_proj_b", "linear_attn.in_proj_a")),
    "moe": ("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.shared_expert_gate",
                                         "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")),
    "expert_down": ("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",)),
    "shared_down": ("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",)),
}
# what qjax balances on top of llm-compressor's "moe" mapping: the router, so that routing does not move
ROUTER = "mlp.gate"


@dataclasses.dataclass(frozen=True)
class AWQConfig:
    """llm-compressor's ``AWQModifier`` options (same names and defaults)."""

    duo_scaling: bool | str = True  # True | False | "both"
    n_grid: int = 20

    def __post_init__(self):
        if self.duo_scaling not in (True, False, "both"):
            raise ValueError(f"duo_scaling must be True, False or 'both', got {self.duo_scaling!r}")
        if self.n_grid < 2 + (self.duo_scaling is True) or (self.duo_scaling == "both" and self.n_grid < 4):
            raise ValueError(f"n_grid {self.n_grid} is too small for duo_scaling={self.duo_scaling!r}")


def grid(cfg: AWQConfig) -> list[tuple[float, bool]]:
    """The ``(ratio, duo)`` points in llm-compressor's order (``_get_grid_search_params``): ``True`` adds the
    identity ``(0, False)`` first, then ``n_grid - 1`` duo points; ``"both"`` interleaves ``n_grid // 2`` ratios
    without and with duo; ``False`` has ``n_grid`` plain points."""
    if cfg.duo_scaling == "both":
        n = cfg.n_grid // 2
        return [(i / (n - 1), duo) for i in range(n) for duo in (False, True)]
    if cfg.duo_scaling is False:
        return [(i / (cfg.n_grid - 1), False) for i in range(cfg.n_grid)]
    return [(0.0, False)] + [(i / (cfg.n_grid - 2), True) for i in range(cfg.n_grid - 1)]


def activation_mean(x_abs_sum: np.ndarray, count: int) -> np.ndarray:
    """``x̄ [K]`` float32 from the per-channel sum of ``|x|`` (float32, accumulated per batch as llm-compressor's
    hook does: ``x.abs().float().sum(0)``) and the token count."""
    return (np.asarray(x_abs_sum, _F32) / _F32(count)).astype(_F32)


def abs_sum(x: jax.Array) -> jax.Array:
    """One batch's contribution to :func:`activation_mean`: ``Σ_tokens |x|`` f32 ``[K]`` of ``x [..., K]``."""
    return jnp.sum(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)


def weight_mean(weights: Sequence[np.ndarray], schemes: Sequence[Scheme | None]) -> np.ndarray:
    """``w̄ [K]`` float64: llm-compressor's ``_compute_layer_means`` over the balance layers.

    ``weights[i]``: ``[*lead, N, K]`` (a leading expert axis counts its rows like separate layers); a layer whose
    scheme is None (not quantized, e.g. ``shared_expert_gate`` under the usual ignore list) is skipped, as
    llm-compressor skips a layer without a quantization scheme. Per quantization group: ``|W| / (max|W| + 1e-6)`` in
    the weight dtype, then summed over rows in float64 and divided by the total row count.
    """
    total, rows = None, 0
    for w, scheme in zip(weights, schemes):
        if scheme is None or not scheme.quantized:
            continue
        w = np.asarray(w, _F32)
        w2 = w.reshape(-1, w.shape[-1])
        gs = w2.shape[-1] if scheme.group_size == -1 else scheme.group_size
        a = np.abs(w2.reshape(-1, gs))
        a = (a / (a.max(axis=1, keepdims=True) + _F32(1e-6))).astype(_F32).reshape(w2.shape)
        s = a.sum(axis=0, dtype=_F64)
        total = s if total is None else total + s
        rows += w2.shape[0]
    if total is None:
        raise ValueError("weight_mean: no quantized balance layer")
    return total / rows


def grid_scales(x_mean: np.ndarray, w_mean: np.ndarray | None, ratio: float, duo: bool) -> np.ndarray:
    """The scales of one grid point, ``[K]`` (float64 for a duo point, float32 otherwise, like llm-compressor's
    float32 ``x̄`` meeting its float64 ``w̄``); inf/nan (all-zero channels) become 1."""
    x = np.asarray(x_mean, _F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if duo:
            s = (np.power(x.astype(_F64), _F64(_F32(ratio))).astype(_F32) / (np.power(w_mean, 1 - ratio) + 1e-4)).astype(_F64)
            s = np.maximum(s, 1e-4)
            s = s / np.sqrt(s.max() * s.min())
        else:
            s = np.maximum(np.power(x.astype(_F64), _F64(_F32(ratio))).astype(_F32), _F32(1e-4))
            s = (s / np.sqrt(s.max() * s.min())).astype(_F32)
    s = np.where(np.isfinite(s), s, s.dtype.type(1))
    return s


def scaled_qdq(w: jax.Array, scales: jax.Array, scheme: Scheme) -> jax.Array:
    """``Q(W · s) / s`` f32 ``[*lead, N, K]``: what the grid search puts in the parent for a balance weight (RTN
    with min/max qparams of the scaled weight, compressed-tensors' arithmetic). ``W · s`` and ``/ s`` are computed in
    the scales' dtype and rounded to f32, as llm-compressor does: pass float64 scales under ``jax.enable_x64`` to
    reproduce its duo-scaling losses exactly (float32 scales differ by an ulp, which flips a few codes)."""
    sd = scales.dtype
    ws = (w.astype(sd) * scales).astype(jnp.float32)
    q = fake_quant.rtn(ws, bits=scheme.bits, symmetric=scheme.sym, group_size=scheme.group_size)
    return (q.astype(sd) / scales).astype(jnp.float32)


def mse(reference: jax.Array, output: jax.Array) -> jax.Array:
    """llm-compressor's ``_compute_loss``: ``Σ (a - b)² / numel`` over all batches, f32 scalar."""
    d = reference.astype(jnp.float32) - output.astype(jnp.float32)
    return jnp.sum(d * d) / d.size


@dataclasses.dataclass(frozen=True)
class SearchResult:
    scales: np.ndarray  # [K] the chosen grid point's scales (float64 or float32, see grid_scales)
    losses: list[float]  # one per grid point, grid order
    best: int  # index into grid(cfg)
    ratio: float
    duo: bool


def candidate_scales(x_mean: np.ndarray, w_mean: np.ndarray | None, cfg: AWQConfig = AWQConfig()) -> list[np.ndarray]:
    """Every grid point's :func:`grid_scales` ``[K]``, grid order (each in its own dtype: float64 duo, float32
    plain). Stack them (``np.stack(..., dtype=…)``) for one batched loss call: a float32 point cast to float64 and a
    float64 one cast to float32 lose nothing the loss would see (float32 → float64 is exact; float64 arithmetic on
    float32 operands rounded to float32 is float32 arithmetic, as ``+ − × /`` round correctly twice)."""
    if cfg.duo_scaling is not False and w_mean is None:
        raise ValueError("search_scales: duo scaling needs w_mean")
    return [grid_scales(x_mean, w_mean, ratio, duo) for ratio, duo in grid(cfg)]


def choose(candidates: Sequence[np.ndarray], losses, cfg: AWQConfig = AWQConfig()) -> SearchResult:
    """The grid point llm-compressor keeps from ``losses [G]`` (one float32 value per candidate, grid order): the
    first with the strictly smallest finite loss (its ``loss < best_error``, starting from inf)."""
    points = grid(cfg)
    values = [float(v) for v in np.asarray(losses).reshape(-1)]
    if len(values) != len(points):
        raise ValueError(f"AWQ grid search: {len(values)} losses for {len(points)} grid points")
    best, best_loss = -1, float("inf")
    for i, value in enumerate(values):
        if value < best_loss:  # NaN and inf never win
            best, best_loss = i, value
    if best < 0:
        raise FloatingPointError("AWQ grid search: no finite loss (NaN in the parent's forward?)")
    return SearchResult(candidates[best], values, best, *points[best])


def search_scales(x_mean: np.ndarray, w_mean: np.ndarray | None, losses: Callable[[np.ndarray], np.ndarray],
                  cfg: AWQConfig = AWQConfig(), dtype=_F32) -> SearchResult:
    """Grid search of one mapping: every grid point's loss from one call, then :func:`choose`.

    Args:
      x_mean: ``[K]`` :func:`activation_mean`.
      w_mean: ``[K]`` :func:`weight_mean` (needed when ``cfg.duo_scaling`` is not False).
      losses: the grid's scales ``[G, K]`` (:func:`candidate_scales` stacked in ``dtype``) → ``[G]`` float32: the
        parent's output MSE with every quantized balance weight replaced by :func:`scaled_qdq`, per grid point (the
        caller's closure over the cached parent inputs and float outputs: one jitted program called per point,
        every call dispatched before any loss is read back).
      dtype: the stacked scales' dtype: float32 (qjax's block loop), or float64 under ``jax.enable_x64`` to
        reproduce llm-compressor's float64 duo-scaling losses (:func:`scaled_qdq`).
    """
    candidates = candidate_scales(x_mean, w_mean, cfg)
    return choose(candidates, losses(np.stack(candidates).astype(dtype)), cfg)


# ---------------------------------------------------------------------------------------------------------------------
# folding the chosen scales into the model
# ---------------------------------------------------------------------------------------------------------------------
def balance(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A balance weight ``[*lead, N, K]`` times ``s`` along K, computed in the scales' precision (float64 for
    llm-compressor's duo scales) and stored in ``w``'s dtype. Also the router / shared-expert-gate compensation."""
    w = np.asarray(w)
    return (w.astype(np.result_type(w.dtype, scales.dtype)) * scales).astype(w.dtype)


def smooth_zero_centred_norm(weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A qwen3_5_moe RMSNorm offset ``w [K]`` (output ``· (1 + w)``) after dividing its output by ``s``:
    ``(1 + w) / s - 1``, with llm-compressor's roundings (``CalibrationOffsetNorm``: ``1 + w`` in the weight dtype,
    divided in place, ``- 1`` back in float32, stored in the weight dtype)."""
    weight = np.asarray(weight)
    dt = weight.dtype
    offset = (_F32(1) + weight.astype(_F32)).astype(dt)
    divided = (offset.astype(np.result_type(dt, scales.dtype)) / scales).astype(dt)
    return (divided.astype(_F32) - _F32(1)).astype(dt)


def smooth_rows(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A Linear smooth layer ``[*lead, N, K]`` (``up_proj`` before ``down_proj``): its output rows divided by ``s
    [N]``; llm-compressor divides the last ``len(s)`` rows (all of them here)."""
    w = np.asarray(w)
    return (w.astype(np.result_type(w.dtype, scales.dtype)) / scales[:, None]).astype(w.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# the router check
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RouterCheck:
    """max |after − before| and that over max |before| for the router logits and the shared-expert-gate output."""

    logits_abs: float
    logits_rel: float
    shared_gate_abs: float
    shared_gate_rel: float

    def passes(self, rel_tol: float) -> bool:
        return self.logits_rel <= rel_tol and self.shared_gate_rel <= rel_tol


def zero_centred_rms_norm(h: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """qwen3_5_moe's RMSNorm on f32 ``h [..., K]``: ``rms(h) · (1 + w)``."""
    h = h.astype(jnp.float32)
    y = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return y * (1.0 + weight.astype(jnp.float32))


@jax.jit
def _router_outputs(h, norm, gate, shared_gate, eps):
    x = zero_centred_rms_norm(h, norm, eps)
    return x @ gate.astype(jnp.float32).T, x @ shared_gate.astype(jnp.float32).T


def router_check(h: jax.Array, eps: float, before: dict, after: dict) -> RouterCheck:
    """Router logits and shared-expert-gate pre-activations of one layer before vs after smoothing.

    ``h [T, K]``: the residual stream entering ``post_attention_layernorm`` (calibration tokens). ``before`` /
    ``after``: ``{"post_attention_layernorm": [K], "mlp.gate": [E, K], "mlp.shared_expert_gate": [1, K]}``.
    """
    lb, sb = _router_outputs(h, before["post_attention_layernorm"], before[ROUTER], before["mlp.shared_expert_gate"],
                             eps)
    la, sa = _router_outputs(h, after["post_attention_layernorm"], after[ROUTER], after["mlp.shared_expert_gate"],
                             eps)
    dl, ds = float(jnp.max(jnp.abs(la - lb))), float(jnp.max(jnp.abs(sa - sb)))
    return RouterCheck(dl, dl / max(float(jnp.max(jnp.abs(lb))), 1e-30), ds,
                       ds / max(float(jnp.max(jnp.abs(sb))), 1e-30))
