"""Logit lens: each layer's residual stream read out through the final norm and the lm_head.

    report = logit_lens(model, ids)                      # one model
    report = logit_lens(quantized, ids, reference=src)   # and the difference of two

Per layer ``l`` (its output, ``hidden_states[l]``), over every position with a next token:

- **next-token loss**: cross-entropy of the lens' prediction against the actual next token (nats);
- **top-1 = final**: how often the lens' argmax is the model's final prediction;
- **KL to final**: KL(final softmax ‖ lens softmax): how far the layer is from the answer;
- with a ``reference``: **KL to reference lens**, KL(reference lens ‖ model lens) at the same layer — where the two
  models' intermediate predictions part.

``logit_lens_array`` gives the raw ``[L, B, T]`` statistics (for heatmaps). The readout is the model's own
(``norm`` then :meth:`~qjax.model.qwen3_5_moe.Qwen3_5MoeForCausalLM.logits_from_hidden`), computed in one jitted
program per model with the ``[L, B, T, V]`` lens logits reduced on the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.model.probe import Probe
from qjax.research.capture import probed_forward
from qjax.research.routing import check_comparable


@dataclasses.dataclass(frozen=True)
class LensLayer:
    layer: int
    kind: str
    loss: float  # mean next-token cross-entropy of the lens, nats
    top1_final: float  # share of positions whose lens argmax is the final prediction
    kl_final: float  # mean KL(final ‖ lens)
    kl_reference: float | None = None  # mean KL(reference lens ‖ model lens) at this layer


@dataclasses.dataclass(frozen=True)
class LensReport:
    layers: list[LensLayer]
    tokens: int
    final_loss: float
    model: str = "model"
    reference: str | None = None
    kl_final_by_position: list | None = None  # [L][T-1] KL(final ‖ lens) averaged over the rows (the heatmap)

    def to_dict(self) -> dict:
        return {"model": self.model, "reference": self.reference, "tokens": self.tokens, "final_loss": self.final_loss,
                "layers": [dataclasses.asdict(r) for r in self.layers],
                "kl_final_by_position": self.kl_final_by_position}

    def format(self) -> str:
        ref = self.reference is not None
        lines = [f"logit lens of {self.model} on {self.tokens} next-token positions (final loss "
                 f"{self.final_loss:.4f} nats)" + (f", against {self.reference}'s lens" if ref else ""),
                 f"{'layer':>5s} {'type':17s} {'lens loss':>9s} {'top-1=final':>11s} {'KL to final':>11s}"
                 + (f" {'KL to ref lens':>14s}" if ref else "")]
        for r in self.layers:
            lines.append(f"{r.layer:5d} {r.kind:17s} {r.loss:9.4f} {r.top1_final:11.4f} {r.kl_final:11.4e}"
                         + (f" {r.kl_reference:14.4e}" if ref else ""))
        return "\n".join(lines)


def _log_softmax(x):
    return jax.nn.log_softmax(x.astype(jnp.float32) if x.dtype != jnp.float64 else x, axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def _lens(graphdef, state, ids):
    """``[L, B, T-1]`` lens loss, top-1 = final, KL to final; and the lens log-probabilities' source (hidden states)."""
    model = nnx.merge(graphdef, state)
    cap = probed_forward(model, ids, Probe(capture=("hidden_states",)))
    final = _log_softmax(cap.logits[:, :-1])  # [B, T-1, V]
    labels = ids[:, 1:]

    def per_layer(h):
        lp = _log_softmax(model.logits_from_hidden(model.norm(h[:, :-1])))
        loss = -jnp.take_along_axis(lp, labels[..., None], -1)[..., 0]
        top1 = jnp.argmax(lp, -1) == jnp.argmax(final, -1)
        kl = jnp.sum(jnp.exp(final) * (final - lp), -1)
        return loss, top1, kl, lp

    loss, top1, kl, lp = jax.lax.map(per_layer, cap.sites["hidden_states"])
    final_loss = -jnp.take_along_axis(final, labels[..., None], -1)[..., 0]
    return loss, top1, kl, final_loss, lp


@jax.jit
def _pair_kl(lp_ref, lp):
    return jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), -1)  # [L, B, T-1]


def logit_lens_array(model, input_ids, reference=None) -> dict:
    """``{"loss" | "top1_final" | "kl_final" [| "kl_reference"]: [L, B, T-1]}`` and ``"final_loss" [B, T-1]`` for
    ``input_ids [B, T]`` (T ≥ 2)."""
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.shape[1] < 2:
        raise ValueError("the logit lens needs at least 2 tokens per row (a next token to predict)")
    graphdef, state = nnx.split(model)
    loss, top1, kl, final_loss, lp = _lens(graphdef, state, ids)
    out = {"loss": np.asarray(loss), "top1_final": np.asarray(top1), "kl_final": np.asarray(kl),
           "final_loss": np.asarray(final_loss)}
    if reference is not None:
        check_comparable(model, reference)
        rgraph, rstate = nnx.split(reference)
        lp_ref = _lens(rgraph, rstate, ids)[-1]
        out["kl_reference"] = np.asarray(_pair_kl(lp_ref, lp.astype(lp_ref.dtype)))
    return out


def logit_lens(model, input_ids, reference=None, *, batch: int = 8, names=("model", "reference")) -> LensReport:
    """The per-layer means of :func:`logit_lens_array` over ``input_ids [B, T]`` (``batch`` rows per call)."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    parts = [logit_lens_array(model, ids[i:i + batch], reference) for i in range(0, ids.shape[0], batch)]
    joined = {k: np.concatenate([p[k] for p in parts], axis=-2) for k in parts[0]}
    cfg = model.config
    mean = lambda k, i: float(np.mean(joined[k][i], dtype=np.float64))
    layers = [LensLayer(layer=i, kind=cfg.layer_types[i], loss=mean("loss", i), top1_final=mean("top1_final", i),
                        kl_final=mean("kl_final", i),
                        kl_reference=mean("kl_reference", i) if reference is not None else None)
              for i in range(cfg.num_hidden_layers)]
    return LensReport(layers=layers, tokens=int(joined["final_loss"].size),
                      final_loss=float(np.mean(joined["final_loss"], dtype=np.float64)), model=names[0],
                      reference=names[1] if reference is not None else None,
                      kl_final_by_position=np.mean(joined["kl_final"], axis=1, dtype=np.float64).tolist())
