"""qjax.research.plots: each report draws its PNGs (matplotlib is the optional ``plot`` extra: skipped without it).
Reports are built by hand: no model runs here."""

from __future__ import annotations

import pytest

from qjax.research.damage import BlockDamage, DamageReport
from qjax.research.lens import LensLayer, LensReport
from qjax.research.routing import LayerRouting, RoutingReport

pytest.importorskip("matplotlib")


def _png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_report_draws(tmp_path):
    from qjax.research.plots import write_plots

    routing = RoutingReport(layers=[LayerRouting(i, "linear_attention", 1 - 0.01 * i, 1e-4 * i, 0.95, 1e-3, 0.05, 0.01,
                                                 0.02, [0.3, 0.2, 0.25, 0.25], [0.25] * 4) for i in range(4)],
                            tokens=128, top_k=2, num_experts=4, min_agreement=0.99)
    damage = DamageReport(blocks=[BlockDamage(i, "full_attention", 0.02, 0.01 / (i + 1), 0.002, 0.008, 0.01)
                                  for i in range(4)], base_kl=0.03, tokens=128)
    lens = LensReport(layers=[LensLayer(i, "linear_attention", 5.0 - i, 0.25 * i, 2.0 / (i + 1)) for i in range(4)],
                      tokens=30, final_loss=2.0, kl_final_by_position=[[1.0 / (i + 1)] * 15 for i in range(4)])
    written = [p for r in (routing, damage, lens) for p in write_plots(r, str(tmp_path / "plots"))]
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["damage.png", "expert_load.png", "logit_lens.png", "routing_agreement.png"]
    assert all(_png(p) for p in written)
    with pytest.raises(TypeError):
        write_plots(object(), str(tmp_path))
