"""AutoRound at the real shapes on one device (issue 49's device row): one GDN block and one attention block of
Qwen3.6-35B-A3B (hidden 2048, 256 experts top-8, expert width 512), random BF16 weights made on the device, seed
000's recipe (W4 g128, routed experts W2 g64; batch 8 × 2048 tokens), with ``--enable_alg_ext`` on and off.

Each setting runs in its own child process (so each peak is its own): a four-layer model ``[GDN, attention] × 2``
(:func:`qjax.runtime.random_model.random_model`), the calibration streams of ``--nsamples`` random sequences, and
``AutoRound.run`` over the blocks with ``--iters`` iterations; the second block of each kind finds its programs
compiled, and its report gives the steady numbers. Reported per setting: seconds per steady iteration of
each block (BlockReport.iter_seconds: the median over the chunks after the first), the device's peak
memory (``memory_stats()["peak_bytes_in_use"]``) next to the memory plan's estimate for the seed-000 run
(:mod:`qjax.autoround.plan`, 512 samples), and the projected time of the whole seed-000 run: 30 GDN + 10 attention
blocks × (1000 iterations + that block's non-tuning time — stream forwards, imatrix, start and end — scaled from
``--nsamples`` to 512 samples). Target: ≤ 2 hours on one H100, fitting its 80 GB.

    python benchmarks/autoround_blocks_gpu.py [--iters 20 --nsamples 32] [--alg-ext both|on|off]
    python benchmarks/autoround_blocks_gpu.py --tiny     # a CPU check of the script: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

SEED_NSAMPLES, SEED_ITERS, GDN_BLOCKS, ATTENTION_BLOCKS = 512, 1000, 30, 10
RECIPE = dict(bits=4, group_size=128, layer_config={".*experts.*": {"bits": 2, "group_size": 64}})


def config(tiny: bool):
    from qjax.model.config import TextConfig
    from qjax.runtime.bench import load_config, scaled_config

    raw = load_config().to_hf_dict()
    if tiny:  # every width / 8, 8 experts top-2: the same code paths in seconds on a CPU
        raw = scaled_config(raw, width=8, layers=40)
        raw.update(num_experts=8, num_experts_per_tok=2)
    # each kind twice: the second block of a kind finds its programs compiled, so its times are the steady ones
    raw.update(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    return TextConfig.from_dict(raw, source="qwen3_6_35b_a3b, GDN and attention blocks")


def one(a) -> dict:
    """One setting in this process: the JSON row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.autoround.plan import plan_memory
    from qjax.runtime.random_model import random_model

    cfg = config(a.tiny)
    t0 = time.perf_counter()
    model = random_model(cfg, "bf16", dtype=jnp.bfloat16, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    build = time.perf_counter() - t0
    rcfg = AutoRoundConfig(**RECIPE, iters=a.iters, nsamples=a.nsamples, seqlen=a.seqlen, batch_size=a.batch_size,
                           enable_alg_ext=a.alg_ext == "on", chunk=a.chunk)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.nsamples, a.seqlen)).astype(np.int32)
    ar = AutoRound(model, ids, rcfg, progress=False, devices=jax.devices()[:1])
    # the plan of the seed-000 run (512 samples) on this device, for comparison with the measured peak
    seed_ar = AutoRound(model, np.zeros((SEED_NSAMPLES, a.seqlen), np.int32), rcfg, progress=False,
                        devices=jax.devices()[:1])
    plan = plan_memory(seed_ar, device_memory=1 << 50)
    t0 = time.perf_counter()
    ar.run()
    run = time.perf_counter() - t0
    stats = jax.local_devices()[0].memory_stats() or {}
    rows = {}
    for r in ar.reports:  # the last block of each kind wins: its programs were compiled by the first
        tuning = (r.iter_seconds or 0.0) * a.iters + (r.compile_seconds or 0.0)
        rows[r.kind] = {"iter_s": r.iter_seconds, "compile_s": r.compile_seconds, "seconds": r.seconds,
                        "other_s": max(0.0, r.seconds - tuning)}
    scale = SEED_NSAMPLES / a.nsamples
    projected = sum(n * (SEED_ITERS * rows[k]["iter_s"] + scale * rows[k]["other_s"])
                    for k, n in (("linear_attention", GDN_BLOCKS), ("full_attention", ATTENTION_BLOCKS)))
    dev = jax.local_devices()[0]
    return {"device": f"{dev.device_kind} ({dev.platform})", "alg_ext": a.alg_ext, "blocks": rows,
            "peak_bytes": stats.get("peak_bytes_in_use"), "limit_bytes": stats.get("bytes_limit"),
            "plan_peak_bytes": plan.peak, "plan": plan.lines(), "projected_s": projected, "build_s": build,
            "run_s": run, "iters": a.iters, "nsamples": a.nsamples, "seqlen": a.seqlen}


def row(r: dict) -> str:
    g, f = r["blocks"]["linear_attention"], r["blocks"]["full_attention"]
    peak = "n/a (no allocator stats)" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f} GiB"
    return (f"| {datetime.date.today()} | {r['device']} | {r['alg_ext']} | {g['iter_s']:.3f} | {f['iter_s']:.3f} | "
            f"{peak} (plan for 512 samples: {r['plan_peak_bytes'] / 2**30:.1f} GiB) | "
            f"{r['projected_s'] / 3600:.2f} h |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20, help="≥ 2 chunks, so a steady chunk follows the compiled one")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--alg-ext", choices=["on", "off", "both"], default="both")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and data: check the script on a CPU")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one setting, JSON out
    a = ap.parse_args()
    if a.tiny:
        a.iters, a.nsamples, a.seqlen, a.batch_size, a.chunk = 4, 4, 64, 2, 2
    if a.one:
        print("RESULT " + json.dumps(one(a)))
        return
    settings = ["off", "on"] if a.alg_ext == "both" else [a.alg_ext]
    print("| date | device | alg_ext | GDN block s/iter | attention block s/iter | peak device memory | "
          "projected seed-000 run (40 blocks × 1000 iters + calibration) |")
    print("|---|---|---|---|---|---|---|")
    for s in settings:
        args = [sys.executable, os.path.abspath(__file__), "--one", "--alg-ext", s, "--iters", str(a.iters),
                "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--batch-size", str(a.batch_size),
                "--chunk", str(a.chunk)] + (["--tiny"] if a.tiny else [])
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode != 0 or "RESULT " not in p.stdout:
            print(f"| {datetime.date.today()} | alg_ext {s} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]} |")
            continue
        r = json.loads(p.stdout.rsplit("RESULT ", 1)[1])
        print(row(r), flush=True)
        print("\n".join(f"    {ln}" for ln in r["plan"]), file=sys.stderr)
        print(f"    {json.dumps(r['blocks'])}; model built in {r['build_s']:.0f} s, run {r['run_s']:.0f} s",
              file=sys.stderr)


if __name__ == "__main__":
    main()
