"""Routing of two models on the same tokens, layer by layer (``qjax compare --routing``).

    report = compare_routing(model, reference, ids)        # two loaded models (a quantized one and its source)
    print(report.format()); report.flagged                 # layers whose router disagrees with the reference's

Two views of every layer, over every token:

- **end to end**: each model on its own residual stream (what its users get). Quantization noise accumulates here
  from layer to layer and is expected.
- **isolated**: the model's ``post_attention_layernorm`` and router on the *reference's* residual stream (the
  reference's block outputs patched in at every layer, :mod:`qjax.research.patch`). A quantized build keeps the
  norms and the router in float, so its isolated routing is the reference's bit for bit whatever its experts' bits;
  a norm or router that no longer matches — smoothing scales folded into the norm without compensating the router,
  seed 002's first upload — shows up here at every affected layer, however little it moves the outputs.

Per view: **top-k agreement** |selected ∩ selected'| / k, averaged (1 = the same experts everywhere); **router KL**
KL(softmax(reference logits) ‖ softmax(model logits)) in nats. End to end also: **expert load** (the share of the k
routing slots each expert takes, ``[E]`` per model; **load shift** = ½ Σ_e |a_e − b_e|), **weight drift** ½ Σ_e
|w_e − w'_e| between the sparse routing weight vectors (renormalised top-k weights, 0 elsewhere; in [0, 1]) and
**shared-gate drift** |σ(g) − σ(g')| of the shared expert's gate.

A layer is flagged when its isolated agreement is below ``min_agreement`` or its isolated router KL above
``max_router_kl``. The defaults come from measured noise on the built-in model (4,096 held-out tokens;
benchmarks/routing_noise.py, docs/research.md):

- a w2w4 RTN build (INT2 g64 experts, INT4 g64 rest) against its source: isolated agreement exactly 1, KL 0 (the
  end-to-end agreement drops to 0.943 at the worst layer: quantization noise, accumulated);
- rounding alone — the bfloat16 model against its float32 self, or AWQ-style scales folded *with* the router
  compensated, in bfloat16: isolated agreement ≥ 0.9991, KL ≤ 2.2e-6;
- AWQ-style scales (α = 0.5 over the held-out text's MoE inputs; 0.80–1.88) folded without compensating the router
  and the shared-expert gate: isolated agreement 0.945–0.989, KL 6.3e-4–1.1e-2 at every layer — on a model whose
  activations have no outlier channels; a model with outliers gets larger scales and moves more.

So ``min_agreement`` 0.99 (1 − 10 × the largest rounding disagreement) and ``max_router_kl`` 1e-4 (45 × the largest
rounding KL, 6 × below the smallest incident layer).
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.research.capture import capture
from qjax.research.patch import patch

ROUTING_SITES = ("router_logits", "expert_indices", "expert_weights", "shared_expert_gate")
# the sites that carry the reference's residual stream into the model: the stream after each layer, and the token
# mixer's output (so the MoE block's input, stream + mixer output, is the reference's)
STREAM_SITES = ("hidden_states", "attn_output")
# thresholds on the isolated view, from the measurements in the module docstring
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_MAX_ROUTER_KL = 1e-4


class RoutingError(ValueError):
    """The two models cannot be compared (different layers, experts or vocabularies); the message says why."""


@dataclasses.dataclass(frozen=True)
class LayerRouting:
    layer: int
    kind: str  # "linear_attention" | "full_attention"
    isolated_agreement: float  # mean |top-k ∩ top-k'| / k, the model's router on the reference's residual stream
    isolated_kl: float  # mean KL(reference ‖ model) of the router softmax on the reference's stream, nats
    agreement: float  # end to end: each model on its own stream
    router_kl: float
    weight_drift: float  # mean total variation between the sparse routing weights
    shared_gate_drift: float  # mean |σ(g) − σ(g')|
    load_shift: float  # total variation between the two expert loads
    load: list  # [E] the model's expert load (shares of the routing slots)
    reference_load: list  # [E]


@dataclasses.dataclass(frozen=True)
class RoutingReport:
    layers: list[LayerRouting]
    tokens: int
    top_k: int
    num_experts: int
    min_agreement: float
    max_router_kl: float = DEFAULT_MAX_ROUTER_KL
    model: str = "model"
    reference: str = "reference"

    @property
    def flagged(self) -> list[int]:
        """Layers whose isolated top-k agreement is below ``min_agreement`` or isolated router KL above
        ``max_router_kl``."""
        return [r.layer for r in self.layers if self.is_flagged(r)]

    def is_flagged(self, r: LayerRouting) -> bool:
        return r.isolated_agreement < self.min_agreement or r.isolated_kl > self.max_router_kl

    def to_dict(self) -> dict:
        return {"model": self.model, "reference": self.reference, "tokens": self.tokens, "top_k": self.top_k,
                "num_experts": self.num_experts, "min_agreement": self.min_agreement,
                "max_router_kl": self.max_router_kl, "flagged": self.flagged,
                "layers": [dataclasses.asdict(r) for r in self.layers]}

    def format(self) -> str:
        lines = [f"routing of {self.model} against {self.reference} on {self.tokens} tokens "
                 f"(top-{self.top_k} of {self.num_experts} experts)",
                 "isolated: the model's norm + router on the reference's residual stream; end to end: each model on "
                 "its own",
                 f"{'':23s} {' isolated ':-^20s} {' end to end ':-^64s}",
                 f"{'layer':>5s} {'type':17s} {'agreement':>9s} {'router KL':>10s} {'agreement':>9s} {'router KL':>10s} "
                 f"{'weight drift':>12s} {'gate drift':>10s} {'load shift':>10s} {'max load':>8s}  flag"]
        for r in self.layers:
            flag = "FLAG" if self.is_flagged(r) else ""
            lines.append(f"{r.layer:5d} {r.kind:17s} {r.isolated_agreement:9.4f} {r.isolated_kl:10.2e} "
                         f"{r.agreement:9.4f} {r.router_kl:10.2e} {r.weight_drift:12.4f} {r.shared_gate_drift:10.2e} "
                         f"{r.load_shift:10.4f} {max(r.load):8.3f}  {flag}")
        f = self.flagged
        rule = f"isolated top-{self.top_k} agreement < {self.min_agreement:g} or router KL > {self.max_router_kl:g}"
        lines.append(f"flagged: layers {', '.join(map(str, f))} ({rule}: the model's router does not route the "
                     "reference's hidden states as the reference does)" if f else f"flagged: none ({rule})")
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _sparse(idx: np.ndarray, w: np.ndarray, e: int) -> np.ndarray:
    """``[N, k]`` indices + weights → ``[N, E]`` dense routing weights."""
    out = np.zeros((idx.shape[0], e))
    np.put_along_axis(out, idx, w, axis=1)
    return out


def _flat(a, keep: np.ndarray | None) -> np.ndarray:
    """``[B, T, …]`` → ``[N, …]`` over the real tokens, in float64 (int64 for indices)."""
    a = np.asarray(a)
    a = a.astype(np.int64 if np.issubdtype(a.dtype, np.integer) else np.float64)  # bfloat16 is not kind "f"
    a = a.reshape(-1, *a.shape[2:])
    return a if keep is None else a[keep.reshape(-1)]


def _agreement_kl(idx, logits, idx_r, logits_r) -> tuple[float, float]:
    agree = (idx[:, :, None] == idx_r[:, None, :]).any(-1).sum(-1) / idx.shape[1]
    p_r, p = _softmax(logits_r), _softmax(logits)
    kl = np.sum(p_r * (np.log(np.maximum(p_r, 1e-300)) - np.log(np.maximum(p, 1e-300))), -1)
    return float(agree.mean()), float(kl.mean())


def layer_routing(layer: int, kind: str, mine: dict, ref: dict, isolated: dict,
                  keep: np.ndarray | None = None) -> LayerRouting:
    """Statistics of one layer from the captured :data:`ROUTING_SITES` (``[B, T, …]`` each) of the model on its own
    stream (``mine``), of the reference (``ref``) and of the model on the reference's stream (``isolated``);
    ``keep [B, T]``: the real tokens."""
    logits, idx, w, gate = (_flat(mine[s], keep) for s in ROUTING_SITES)
    logits_r, idx_r, w_r, gate_r = (_flat(ref[s], keep) for s in ROUTING_SITES)
    iso_agree, iso_kl = _agreement_kl(_flat(isolated["expert_indices"], keep),
                                      _flat(isolated["router_logits"], keep), idx_r, logits_r)
    agree, kl = _agreement_kl(idx, logits, idx_r, logits_r)
    n, e = logits.shape
    k = idx.shape[1]
    drift = 0.5 * np.abs(_sparse(idx, w, e) - _sparse(idx_r, w_r, e)).sum(-1)
    sig = lambda g: 1.0 / (1.0 + np.exp(-g[:, 0]))
    load = np.bincount(idx.reshape(-1), minlength=e) / (n * k)
    load_r = np.bincount(idx_r.reshape(-1), minlength=e) / (n * k)
    return LayerRouting(layer=layer, kind=kind, isolated_agreement=iso_agree, isolated_kl=iso_kl, agreement=agree,
                        router_kl=kl, weight_drift=float(drift.mean()),
                        shared_gate_drift=float(np.abs(sig(gate) - sig(gate_r)).mean()),
                        load_shift=float(0.5 * np.abs(load - load_r).sum()), load=load.tolist(),
                        reference_load=load_r.tolist())


def check_comparable(model, reference) -> None:
    a, b = model.config, reference.config
    for field in ("num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size", "hidden_size",
                  "layer_types"):
        if getattr(a, field) != getattr(b, field):
            raise RoutingError(f"the models differ in {field}: {getattr(a, field)} and {getattr(b, field)}")


def compare_routing(model, reference, input_ids, *, attention_mask=None, batch: int = 8,
                    min_agreement: float = DEFAULT_MIN_AGREEMENT, max_router_kl: float = DEFAULT_MAX_ROUTER_KL,
                    names=("model", "reference")) -> RoutingReport:
    """Run ``input_ids [B, T]`` through both models (``batch`` rows per call) and compare their routing per layer:
    three forward passes per batch (the reference; the model; the model on the reference's stream)."""
    check_comparable(model, reference)
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    mask = None if attention_mask is None else np.asarray(attention_mask, bool)
    runs = {"mine": [], "ref": [], "isolated": []}
    for start in range(0, ids.shape[0], batch):
        rows = slice(start, start + batch)
        m = None if mask is None else mask[rows]
        ref = capture(reference, ids[rows], ROUTING_SITES + STREAM_SITES, attention_mask=m).sites
        runs["ref"].append(ref)
        runs["mine"].append(capture(model, ids[rows], ROUTING_SITES, attention_mask=m).sites)
        runs["isolated"].append(patch(model, ids[rows], values={s: ref[s] for s in STREAM_SITES},
                                      capture_sites=ROUTING_SITES, attention_mask=m).sites)
    # [L, B, T, …] per site, batches joined
    runs = {name: {s: np.concatenate([np.asarray(b[s]) for b in got], axis=1) for s in ROUTING_SITES}
            for name, got in runs.items()}
    cfg = model.config
    layers = [layer_routing(i, cfg.layer_types[i], *({s: v[i] for s, v in runs[n].items()}
                                                     for n in ("mine", "ref", "isolated")), mask)
              for i in range(cfg.num_hidden_layers)]
    tokens = int(ids.size if mask is None else mask.sum())
    return RoutingReport(layers=layers, tokens=tokens, top_k=cfg.num_experts_per_tok, num_experts=cfg.num_experts,
                         min_agreement=min_agreement, max_router_kl=max_router_kl, model=names[0],
                         reference=names[1])


# ---------------------------------------------------------------------------------------------------------------------
# the failure this instrument is for, reproducible on any model
# ---------------------------------------------------------------------------------------------------------------------
def smoothing_scales(model, input_ids, alpha: float = 0.5) -> np.ndarray:
    """AWQ-style per-channel smoothing scales of every MoE block's input, ``[L, H]``: ``mean |x_c| ** alpha`` over the
    tokens, normalised to a geometric mean of 1 (AWQ's ``s / sqrt(max · min)``, here over all channels)."""
    x = np.abs(np.asarray(capture(model, input_ids, ("mlp_input",)).sites["mlp_input"], np.float64))
    s = np.maximum(x.mean(axis=(1, 2)), 1e-6) ** alpha  # [L, H]
    return s / np.exp(np.log(s).mean(-1, keepdims=True))


def fold_smoothing_scales(model, scales: np.ndarray, *, compensate_router: bool):
    """``model`` with ``scales [L, H]`` folded into each ``post_attention_layernorm`` (its output × s) and divided
    out of the routed experts' and the shared expert's gate/up inputs — the same function, as AWQ smoothing leaves
    it — and, only when ``compensate_router``, out of the router (``mlp.gate``) and ``mlp.shared_expert_gate`` too.
    ``compensate_router=False`` is seed 002's first upload: the router sees ``x · s`` and routes differently.
    Dense (unquantized) models only; a new model, the given one unchanged."""
    model = nnx.clone(model)
    period = len(model.layer_kinds)
    for j, layer in enumerate(model.groups.layers):
        s = jnp.asarray(scales[j::period], jnp.float32)  # [G, H]: layer g·p + j
        norm = layer.post_attention_layernorm.weight
        norm[...] = ((1 + norm[...].astype(jnp.float32)) * s - 1).astype(norm.dtype)

        def divide(param, s=s):
            lead = param[...].ndim - 2  # [G, (E,) out, in]: the input axis is last
            div = s.reshape(s.shape[0], *(1,) * lead, s.shape[1])
            param[...] = (param[...].astype(jnp.float32) / div).astype(param.dtype)

        mlp = layer.mlp
        if not isinstance(mlp.experts.gate_up_proj, nnx.Param):
            raise RoutingError("fold_smoothing_scales needs a dense model (fold, then quantize)")
        divide(mlp.experts.gate_up_proj)
        divide(mlp.shared_expert.gate_proj.weight)
        divide(mlp.shared_expert.up_proj.weight)
        if compensate_router:
            divide(mlp.gate.weight)
            divide(mlp.shared_expert_gate.weight)
    return model
