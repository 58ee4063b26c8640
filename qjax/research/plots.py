"""PNG pictures of the research reports, for where people look rather than read (``qjax compare … --plot DIR``).

    write_plots(report, "plots/")     # a RoutingReport, DamageReport or LensReport → the PNG paths written

- routing: ``routing_agreement.png`` (isolated and end-to-end top-k agreement per layer, the threshold drawn) and
  ``expert_load.png`` (each layer's expert load, model beside reference);
- damage: ``damage.png`` (each block's repair gain, split into the token mixer and the MoE block, in rank order);
- lens: ``logit_lens.png`` (KL(final ‖ lens) by layer and position, and the lens loss per layer).

matplotlib is optional (the ``plot`` extra): imported when a picture is drawn, with the Agg backend (no display).
"""

from __future__ import annotations

import os

import numpy as np

from qjax.research.damage import DamageReport
from qjax.research.lens import LensReport
from qjax.research.routing import RoutingReport


class PlotError(ValueError):
    """Pictures cannot be drawn (matplotlib missing); the message says what to install."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib (pip install 'qjax[plot]' or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def _save(fig, folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    fig.clf()
    return path


def routing_plots(report: RoutingReport, folder: str) -> list[str]:
    plt = _pyplot()
    layers = [r.layer for r in report.layers]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(layers, [r.isolated_agreement for r in report.layers], "o-", label="isolated (reference's stream)")
    ax.plot(layers, [r.agreement for r in report.layers], "s--", label="end to end")
    ax.axhline(report.min_agreement, color="red", lw=1, label=f"--min-agreement {report.min_agreement:g}")
    for f in report.flagged:
        ax.axvspan(f - 0.4, f + 0.4, color="red", alpha=0.1)
    ax.set(xlabel="layer", ylabel=f"top-{report.top_k} agreement", title=f"routing of {report.model}")
    ax.legend(fontsize=8)
    paths = [_save(fig, folder, "routing_agreement.png")]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    vmax = max(max(r.load + r.reference_load) for r in report.layers)
    for ax, key, title in ((axes[0], "load", report.model), (axes[1], "reference_load", report.reference)):
        img = ax.imshow(np.array([getattr(r, key) for r in report.layers]), aspect="auto", vmin=0, vmax=vmax,
                        cmap="viridis")
        ax.set(xlabel="expert", title=os.path.basename(str(title).rstrip("/")) or str(title))
    axes[0].set_ylabel("layer")
    fig.colorbar(img, ax=axes, label="share of routing slots")
    paths.append(_save(fig, folder, "expert_load.png"))
    plt.close("all")
    return paths


def damage_plot(report: DamageReport, folder: str) -> list[str]:
    plt = _pyplot()
    ranked = report.ranked
    x = np.arange(len(ranked))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(x - 0.2, [b.gain for b in ranked], 0.4, label="whole block")
    ax.bar(x + 0.2, [b.mlp_gain for b in ranked], 0.4, label="MoE block alone")
    ax.plot(x + 0.2, [b.attn_gain for b in ranked], "k_", ms=14, label="token mixer alone")
    ax.set_xticks(x, [str(b.layer) for b in ranked])
    ax.set(xlabel="layer (by rank)", ylabel="KL reduction when repaired (nats)",
           title=f"damage of {report.model}: KL {report.base_kl:.3g}")
    ax.legend(fontsize=8)
    paths = [_save(fig, folder, "damage.png")]
    plt.close("all")
    return paths


def lens_plot(report: LensReport, folder: str) -> list[str]:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [3, 1]})
    heat = np.array(report.kl_final_by_position)
    img = axes[0].imshow(np.log10(np.maximum(heat, 1e-6)), aspect="auto", cmap="magma_r")
    axes[0].set(xlabel="position", ylabel="layer", title="log10 KL(final ‖ lens)")
    fig.colorbar(img, ax=axes[0])
    axes[1].plot([r.loss for r in report.layers], [r.layer for r in report.layers], "o-")
    axes[1].axvline(report.final_loss, color="gray", lw=1)
    axes[1].invert_yaxis()
    axes[1].set(xlabel="lens loss (nats)", title="next-token loss")
    paths = [_save(fig, folder, "logit_lens.png")]
    plt.close("all")
    return paths


def write_plots(report, folder: str) -> list[str]:
    """The pictures of ``report`` written into ``folder`` (made if missing); their paths."""
    os.makedirs(folder, exist_ok=True)
    if isinstance(report, RoutingReport):
        return routing_plots(report, folder)
    if isinstance(report, DamageReport):
        return damage_plot(report, folder)
    if isinstance(report, LensReport):
        return lens_plot(report, folder)
    raise TypeError(f"no pictures for a {type(report).__name__}")
