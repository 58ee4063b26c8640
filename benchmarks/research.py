"""The research instruments on the built-in model (issue 50): the numbers behind their defaults, and what they cost.

    python benchmarks/research.py [--part routing,cost,damage,lens] [--tokens 4096]

- ``routing``: the noise that sets ``qjax compare --routing``'s defaults (qjax.research.routing): a w2w4 RTN build
  against its source, the bfloat16 model against its float32 self, and AWQ-style smoothing scales folded into the
  MoE norms with and without compensating the router (seed 002's incident), on the held-out text; per case the
  worst layer's isolated and end-to-end agreement and isolated KL.
- ``cost``: capture on against a plain forward (batch 8 × 256 tokens, bfloat16, median of 5 after a warm-up): the
  residual stream + router logits, the routing sites, every site.
- ``damage``: qjax.research.damage's per-block ranking of the w2w4 RTN build (ranked on calib.txt), then the
  held-out perplexity of the base build, of the build with the top-2 blocks' experts at INT4 (the suggested
  ``--layer_config``), and of the build with the bottom-2 blocks' experts at INT4 (the same total bits) — whether the
  ranking picks the blocks that matter.
- ``lens``: the logit lens of the built-in model, and of the w2w4 build against it.
- ``autoround``: the seed-000 recipe by AutoRound (200 iters, 128 × 256 calib.txt tokens, the 4-bit group 64 as in
  benchmarks/quality.py): its per-block losses (iteration 0 = RTN, best) beside the damage ranking of its build
  (2,048 held-out tokens).

Prints markdown; writes nothing.
"""

from __future__ import annotations

from qjax import xla_env

xla_env.apply(single_threaded=True)

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx
from qjax.convert.planner import recipe_to_qconfig

import qjax
from qjax.autoround.rtn import quantize_model
from qjax.checkpoint.hub import default_model_dir
from qjax.evaluation.evaluate import load_tokenizer, perplexity, read_texts, tokenize_texts
from qjax.model.probe import SITES, Probe
from qjax.research.capture import probed_forward
from qjax.research.damage import block_damage
from qjax.research.lens import logit_lens
from qjax.research.routing import ROUTING_SITES, compare_routing, fold_smoothing_scales, smoothing_scales

W2W4 = "experts=int2:g64,rest=int4:g64"  # seed 000's recipe with the 4-bit group dividing the built-in model's 64


def _tokens(name: str, n: int) -> np.ndarray:
    d = default_model_dir()
    toks = tokenize_texts(read_texts(f"{d}/{name}"), load_tokenizer(d))
    n = min(n, toks.size) // 256 * 256
    return toks[:n].reshape(-1, 256)


def routing(ids) -> None:
    f32, bf16 = qjax.load_model(default_model_dir(), dtype="float32"), qjax.load_model(default_model_dir())
    scales = smoothing_scales(f32, ids[:4])
    print(f"\n### Routing noise ({ids.size} held-out tokens; AWQ-style scales {scales.min():.2f}–{scales.max():.2f})\n")
    print("| model | reference | worst isolated agreement | max isolated KL | worst end-to-end agreement | flagged |")
    print("|---|---|---|---|---|---|")
    cases = [("w2w4 RTN (bf16)", quantize_model(bf16, recipe_to_qconfig(W2W4)), bf16, "bf16"),
             ("bf16", bf16, f32, "float32"),
             ("folded, router compensated (bf16)", fold_smoothing_scales(bf16, scales, compensate_router=True), bf16,
              "bf16"),
             ("folded, router compensated (f32)", fold_smoothing_scales(f32, scales, compensate_router=True), f32,
              "float32"),
             ("folded, router NOT compensated (bf16)", fold_smoothing_scales(bf16, scales, compensate_router=False),
              bf16, "bf16")]
    for name, model, ref, ref_name in cases:
        r = compare_routing(model, ref, ids)
        print(f"| {name} | {ref_name} | {min(x.isolated_agreement for x in r.layers):.4f} | "
              f"{max(x.isolated_kl for x in r.layers):.2e} | {min(x.agreement for x in r.layers):.4f} | "
              f"{', '.join(map(str, r.flagged)) or 'none'} |")


def cost(ids) -> None:
    model = qjax.load_model(default_model_dir())
    graphdef, state = nnx.split(model)
    batch = jax.numpy.asarray(ids[:8], jax.numpy.int32)

    def program(probe):
        if probe is None:
            fn = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x).logits)
        else:
            fn = jax.jit(lambda s, x: probed_forward(nnx.merge(graphdef, s), x, probe))
        jax.block_until_ready(fn(state, batch))
        return fn

    def once(fn):
        t = time.perf_counter()
        jax.block_until_ready(fn(state, batch))
        return time.perf_counter() - t

    plain = program(None)
    print(f"\n### Capture cost (built-in model, bf16, batch {batch.shape[0]} × {batch.shape[1]}; median of 7, each "
          "timed alternately with a plain forward)\n")
    print("| captured | time | plain forward | ratio |\n|---|---|---|---|")
    for name, sites in (("hidden_states + router_logits", ("hidden_states", "router_logits")),
                        ("routing sites", ROUTING_SITES), ("every site but expert_outputs",
                                                           tuple(s for s in SITES if s != "expert_outputs")),
                        ("every site", tuple(SITES))):
        fn = program(Probe(capture=sites))
        pairs = [(once(plain), once(fn)) for _ in range(7)]
        base, t = statistics.median(p for p, _ in pairs), statistics.median(q for _, q in pairs)
        ratio = statistics.median(q / p for p, q in pairs)
        print(f"| {name} | {t * 1e3:.0f} ms | {base * 1e3:.0f} ms | {ratio:.2f} |")


def damage(calib, heldout) -> None:
    bf16 = qjax.load_model(default_model_dir())
    base_qc = recipe_to_qconfig(W2W4)
    q = quantize_model(bf16, base_qc)
    t = time.perf_counter()
    report = block_damage(q, bf16, calib, names=("w2w4 RTN", "built-in"))
    print(f"\n### Damage per block (w2w4 RTN, ranked on {report.tokens} calib.txt tokens, "
          f"{time.perf_counter() - t:.0f} s)\n\n```\n{report.format(bits=4, group_size=64)}\n```\n")
    ranked = [b.layer for b in report.ranked]
    n = bf16.config.num_hidden_layers

    def promoted(layers):
        rx = lambda ls: r"re:.*layers\.(" + "|".join(map(str, ls)) + r")\.mlp\.experts\.\d+\.(gate|up|down)_proj$"
        groups = {"up": {"format": "pack-quantized", "targets": [rx(layers)], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}
        rest = [i for i in range(n) if i not in layers]
        groups["experts"] = {"format": "pack-quantized", "targets": [rx(rest)], "weights": {
            "num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}
        other = next(g for g in base_qc["config_groups"].values() if g["targets"] == ["Linear"])
        groups["rest"] = other
        return quantize_model(bf16, {**base_qc, "config_groups": groups})

    print(f"| build | held-out perplexity ({heldout.size} tokens) |\n|---|---|")
    print(f"| bf16 | {perplexity(bf16, heldout.reshape(-1)):.3f} |")
    print(f"| w2w4 RTN | {perplexity(q, heldout.reshape(-1)):.3f} |")
    for name, layers in (("top-2 ranked", ranked[:2]), ("bottom-2 ranked", ranked[-2:])):
        print(f"| w2w4 RTN + INT4 experts in layers {layers} ({name}) | "
              f"{perplexity(promoted(layers), heldout.reshape(-1)):.3f} |")


def lens(ids) -> None:
    bf16 = qjax.load_model(default_model_dir())
    q = quantize_model(bf16, recipe_to_qconfig(W2W4))
    print(f"\n### Logit lens\n\n```\n{logit_lens(bf16, ids, names=('built-in',)).format()}\n\n"
          f"{logit_lens(q, ids, reference=bf16, names=('w2w4 RTN', 'built-in')).format()}\n```")


def autoround(heldout) -> None:
    from qjax.autoround.driver import AutoRound, AutoRoundConfig

    bf16 = qjax.load_model(default_model_dir())
    cfg = AutoRoundConfig(bits=4, group_size=64, layer_config={".*experts.*": {"bits": 2, "group_size": 64}},
                          iters=200, nsamples=128, seqlen=256, batch_size=8)
    ar = AutoRound(bf16, _tokens("calib.txt", 128 * 256), cfg)
    t = time.perf_counter()
    ar.run()
    tuned = time.perf_counter() - t
    report = block_damage(ar.quantized_model(), bf16, heldout[:8], names=("w2w4 AutoRound", "built-in"))
    rank = {b.layer: r for r, b in enumerate(report.ranked, 1)}
    print(f"\n### AutoRound per-block loss beside the damage ranking (seed-000 recipe, tuned in {tuned:.0f} s; damage "
          f"on {report.tokens} held-out tokens, KL(source ‖ model) {report.base_kl:.3e})\n")
    print("| layer | type | AutoRound loss iter 0 (RTN) | best loss | damage rank | repair gain | share | mlp gain | "
          "attn gain |\n|---|---|---|---|---|---|---|---|---|")
    for r in ar.reports:
        if r.index >= len(report.blocks):
            continue
        b = report.blocks[r.index]
        print(f"| {r.index} | {r.kind} | {r.init_loss:.3e} | {r.best_loss:.3e} | {rank[r.index]} | {b.gain:.3e} | "
              f"{b.gain / report.base_kl:.1%} | {b.mlp_gain:.3e} | {b.attn_gain:.3e} |")
    print(f"\nsuggested --layer_config: {report.layer_config(bits=4, group_size=64)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="routing,cost,damage,lens")
    p.add_argument("--tokens", type=int, default=4096)
    a = p.parse_args()
    parts = a.part.split(",")
    heldout = _tokens("heldout.txt", a.tokens)
    if "routing" in parts:
        routing(heldout)
    if "cost" in parts:
        cost(heldout)
    if "damage" in parts:
        damage(_tokens("calib.txt", 2048), _tokens("heldout.txt", 10 ** 9))
    if "lens" in parts:
        lens(heldout[:8])
    if "autoround" in parts:
        autoround(heldout)


if __name__ == "__main__":
    main()
