"""Where a quantized model's damage is: each block's share of its divergence from the source, measured by patching.

    report = block_damage(quantized, source, ids)
    print(report.format()); report.layer_config(bits=4, group_size=64, top=2)   # a ready --layer_config

For every decoder block ``l`` (its two contributions to the residual stream, ``attn_output`` and ``mlp_output``,
:data:`qjax.research.patch.BLOCK_SITES`), on the same tokens:

- **repair**: the quantized model with block ``l``'s outputs replaced by the source's (from the source's own run):
  KL(source ‖ repaired), and the **gain** = KL(source ‖ quantized) − KL(source ‖ repaired): how much of the final
  divergence that block's error is responsible for, downstream amplification included. Also split: the token mixer
  alone (``attn gain``) and the MoE block alone (``mlp gain``);
- **damage**: the source with block ``l``'s outputs replaced by the quantized model's: KL(source ‖ damaged), the
  block's error on its own.

KL is the mean over tokens of KL(softmax(source logits) ‖ softmax(other logits)), nats. Blocks are ranked by repair
gain; :meth:`DamageReport.layer_config` turns the top of the ranking into ``qjax quantize --layer_config`` entries
(the part — experts or attention — that gains more gets the bits). Every patch is the same compiled program (the
masks are inputs): 2 + 4·L forward passes per batch.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from qjax.model.config import LINEAR
from qjax.model.probe import Probe
from qjax.research.capture import run
from qjax.research.patch import BLOCK_SITES, layer_mask, patch_inputs
from qjax.research.routing import check_comparable


@dataclasses.dataclass(frozen=True)
class BlockDamage:
    layer: int
    kind: str
    repair_kl: float  # KL(source ‖ quantized with the source's block l)
    gain: float  # base KL − repair KL
    attn_gain: float  # the token mixer's output alone repaired
    mlp_gain: float  # the MoE block's output alone repaired
    damage_kl: float  # KL(source ‖ source with the quantized block l)


@dataclasses.dataclass(frozen=True)
class DamageReport:
    blocks: list[BlockDamage]
    base_kl: float  # KL(source ‖ quantized)
    tokens: int
    model: str = "model"
    source: str = "source"

    @property
    def ranked(self) -> list[BlockDamage]:
        """Blocks by repair gain, largest first."""
        return sorted(self.blocks, key=lambda b: -b.gain)

    def layer_config(self, bits: int = 4, group_size: int = 128, top: int = 2, attn_bits: int = 8) -> dict:
        """``--layer_config`` entries giving the ``top`` blocks of the ranking more bits: the routed experts
        (``bits``, ``group_size``) where the MoE output gains more, else the token mixer's projections
        (``attn_bits``)."""
        out = {}
        for b in self.ranked[:top]:
            if b.mlp_gain >= b.attn_gain:
                out[f"model.layers.{b.layer}.mlp.experts"] = {"bits": bits, "group_size": group_size}
            else:
                mixer = "linear_attn" if b.kind == LINEAR else "self_attn"
                out[f"model.layers.{b.layer}.{mixer}"] = {"bits": attn_bits, "group_size": group_size}
        return out

    def to_dict(self, **layer_config) -> dict:
        return {"model": self.model, "source": self.source, "tokens": self.tokens, "base_kl": self.base_kl,
                "ranking": [b.layer for b in self.ranked], "blocks": [dataclasses.asdict(b) for b in self.blocks],
                "layer_config": self.layer_config(**layer_config)}

    def format(self, **layer_config) -> str:
        lines = [f"damage of {self.model} against {self.source} on {self.tokens} tokens: KL(source ‖ model) "
                 f"{self.base_kl:.4e} nats",
                 f"{'rank':>4s} {'layer':>5s} {'type':17s} {'repair KL':>10s} {'gain':>10s} {'share':>6s} "
                 f"{'attn gain':>10s} {'mlp gain':>10s} {'damage KL':>10s}"]
        for rank, b in enumerate(self.ranked, 1):
            share = b.gain / self.base_kl if self.base_kl > 0 else 0.0
            lines.append(f"{rank:4d} {b.layer:5d} {b.kind:17s} {b.repair_kl:10.3e} {b.gain:10.3e} {share:6.1%} "
                         f"{b.attn_gain:10.3e} {b.mlp_gain:10.3e} {b.damage_kl:10.3e}")
        lines.append("suggested --layer_config: " + json.dumps(self.layer_config(**layer_config)))
        return "\n".join(lines)


def mean_kl(p_logits, q_logits, keep: np.ndarray | None = None) -> tuple[float, int]:
    """(sum over tokens of KL(softmax(p) ‖ softmax(q)), tokens) for ``[B, T, V]`` logits, in float64."""
    p = np.asarray(p_logits, np.float64)
    q = np.asarray(q_logits, np.float64)
    lp = p - p.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = np.sum(np.exp(lp) * (lp - lq), -1)  # [B, T]
    if keep is not None:
        kl = kl[keep]
    return float(kl.sum()), int(kl.size)


def block_damage(model, source, input_ids, *, attention_mask=None, batch: int = 8,
                 names=("model", "source")) -> DamageReport:
    """Rank ``model`` 's blocks (a quantized build of ``source``) by their share of KL(source ‖ model) on
    ``input_ids [B, T]``."""
    check_comparable(model, source)
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    mask = None if attention_mask is None else np.asarray(attention_mask, bool)
    n = model.config.num_hidden_layers
    capture = Probe(capture=BLOCK_SITES)
    swap = Probe(patch=BLOCK_SITES)
    sums = {k: np.zeros(n) for k in ("repair", "attn", "mlp", "damage")}
    base, tokens = 0.0, 0
    none = layer_mask([], n)
    for start in range(0, ids.shape[0], batch):
        rows = slice(start, start + batch)
        m = None if mask is None else mask[rows]
        src = run(source, ids[rows], capture, attention_mask=m)
        mine = run(model, ids[rows], capture, attention_mask=m)
        kl, count = mean_kl(src.logits, mine.logits, m)
        base, tokens = base + kl, tokens + count
        for layer in range(n):
            at = layer_mask([layer], n)
            for key, masks in (("repair", (at, at)), ("attn", (at, none)), ("mlp", (none, at))):
                inputs = patch_inputs(src.sites, dict(zip(BLOCK_SITES, masks)))
                sums[key][layer] += mean_kl(src.logits, run(model, ids[rows], swap, inputs, m).logits, m)[0]
            inputs = patch_inputs(mine.sites, {s: at for s in BLOCK_SITES})
            sums["damage"][layer] += mean_kl(src.logits, run(source, ids[rows], swap, inputs, m).logits, m)[0]
    base /= tokens
    avg = {k: v / tokens for k, v in sums.items()}
    cfg = model.config
    blocks = [BlockDamage(layer=i, kind=cfg.layer_types[i], repair_kl=float(avg["repair"][i]),
                          gain=float(base - avg["repair"][i]), attn_gain=float(base - avg["attn"][i]),
                          mlp_gain=float(base - avg["mlp"][i]), damage_kl=float(avg["damage"][i])) for i in range(n)]
    return DamageReport(blocks=blocks, base_kl=float(base), tokens=tokens, model=names[0], source=names[1])
