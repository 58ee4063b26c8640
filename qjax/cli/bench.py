"""``qjax bench``: end-to-end speed of a random-weight model of a config + recipe (see :mod:`qjax.runtime.bench`).

    qjax bench                                   the real Qwen3.6-35B-A3B shapes, recipe w2w4 (needs a GPU)
    qjax bench --scale 8 --recipe all --dtype float32 --prefill 1x256 --decode-batches 1,8 --context 64
    qjax bench --recipe w2w4 --recipe 'w2w4,lm_head=int4:g128' --kv-fp8 --profile --json out.json
"""

from __future__ import annotations

import json
import os
import sys

from qjax.cli.options import add_dtype_argument


def register(sub) -> None:
    from qjax.runtime.bench_settings import RECIPES, Settings

    d = Settings()
    p = sub.add_parser("bench", help="prefill/decode speed, TTFT and memory of a random-weight model (no download)",
                       description="Times qjax.generate's own programs on a model built on the device from a config "
                                   "and a recipe with random weights; reports each number against its bandwidth or "
                                   "compute bound and a plain-XLA dequantize-then-matmul baseline.")
    p.add_argument("--config", default=None,
                   help="config.json or checkpoint folder (default: the built-in Qwen3.6-35B-A3B shapes)")
    p.add_argument("--scale", type=int, default=1,
                   help="divide every width by this (8: the CPU-sized config; head counts and experts stay)")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers of the pattern (default: all; "
                                                            "8 with --scale)")
    p.add_argument("--recipe", action="append", default=None, metavar="RECIPE",
                   help=f"a recipe as for qjax inspect (preset or SELECTOR=SCHEME,...), or 'all' "
                        f"({', '.join(RECIPES)}); repeat for several (default: w2w4)")
    p.add_argument("--kv-fp8", action="store_true", help="static FP8 KV cache (adds kv=fp8 to every recipe)")
    add_dtype_argument(p, default="bfloat16")
    p.add_argument("--prefill", default=",".join(f"{b}x{t}" for b, t in d.prefill),
                   help="prefill shapes BATCHxTOKENS,... (empty: none)")
    p.add_argument("--decode-batches", default=",".join(map(str, d.decode_batches)))
    p.add_argument("--context", type=int, default=d.context, help="prompt tokens in the cache before decode")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="decode steps per timed call")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls per measurement (median)")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-XLA dequantize-then-matmul baseline")
    p.add_argument("--profile", action="store_true", help="also a per-op breakdown of the batch-1 decode step")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...", help="run on a device mesh, e.g. tensor=2,expert=2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results (all rows, times and bytes) to this file")
    p.set_defaults(func=cli)


def recipes_of(a) -> list[str]:
    from qjax.runtime.bench_settings import RECIPES

    names = [n for r in (a.recipe or ["w2w4"]) for n in (RECIPES if r == "all" else [r])]
    return [f"{r},kv=fp8" if a.kv_fp8 and "kv=" not in r and r != "mxfp8-experts" else r for r in names]


def cli(a) -> int:
    import jax.numpy as jnp

    from qjax.runtime import bench

    settings = bench.Settings(prefill=bench.parse_shapes(a.prefill),
                              decode_batches=bench.parse_ints(a.decode_batches, "--decode-batches"),
                              context=a.context, new_tokens=a.new_tokens, repeats=a.repeats,
                              baseline=not a.no_baseline, seed=a.seed)
    layers = a.layers if a.layers is not None else (8 if a.scale > 1 else None)
    cfg = bench.load_config(a.config, scale=a.scale, layers=layers)
    results = []
    for recipe in recipes_of(a):
        print(f"== {recipe}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts, "
              f"{a.dtype}", file=sys.stderr)
        try:
            r = bench.bench(cfg, recipe, settings, dtype=jnp.dtype(a.dtype), mesh=a.mesh, profile=a.profile,
                            log=lambda s: print("  " + s, file=sys.stderr, flush=True))
        except MemoryError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        results.append(r)
    first = results[0]
    print(f"{first['device']} · jax {first['jax']} · {first['dtype']} · copy bandwidth "
          f"{first['copy_bandwidth'] / 1e9:.1f} GB/s · median of {settings.repeats}")
    print(bench.format_table(results))
    print()
    print(bench.format_memory(results))
    for r in results:
        if "profile" in r:
            print()
            print(bench.format_profile(r))
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump([json.loads(bench.to_json(r)) for r in results], f, indent=1)
        os.replace(tmp, a.json)  # no half-written file if the run dies
    return 0

