"""CPU MoE blocked path: block-size layouts compared — compile time and run time of one MoE layer.

The reference's prefill path (``qjax.kernels.moe_reference.experts_blocked``) cuts each expert's routed rows into
expert-aligned blocks of a few sizes, one ``lax.scan`` per size. More sizes pad less, but each size is one more scan
to compile. This compares, at the ``mid`` config's MoE shapes (H 512, I 256, 32 experts, top-4, fp32) and several
token counts: the default two sizes (large, large/4), three sizes (large, large/2, large/4; the layout before
2026-12-05) and one size (large). Compile = the first call (trace, lower, compile, run) of a fresh jit; run = median
of interleaved timed calls after it. All in one process, so the contenders share the machine's state.

    python benchmarks/moe_blocks.py [--tokens 128,256,512,2048] [--repeats 60] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cpu_speed  # noqa: E402
from qjax.kernels.moe_reference import as_weight_fn, block_sizes, experts_blocked, experts_gather  # noqa: E402

SECTION = "## MoE blocked path on CPU: block sizes, compile and run time (issue 24)"
_MID = cpu_speed.config_dict("mid")  # the mid config's MoE layer
H, I, E, K = (_MID[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"))


def layouts(slots: int) -> dict[str, tuple[int, ...]]:
    default = block_sizes(slots, E)
    large = default[0]
    return {"two (default)": default,
            "three": tuple(b for b in (large, large // 2, large // 4) if b >= 8),
            "one": (large,)}


def measure(n: int, repeats: int) -> list[tuple[str, tuple[int, ...], float, float, float]]:
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(n, H)), jnp.float32)
    idx = jnp.asarray(np.argsort(-rng.normal(size=(n, E)), 1)[:, :K], jnp.int32)
    w = jnp.asarray(rng.random((n, K)), jnp.float32)
    gu = as_weight_fn(jnp.asarray(rng.normal(size=(E, 2 * I, H)) / np.sqrt(H), jnp.float32))
    dn = as_weight_fn(jnp.asarray(rng.normal(size=(E, H, I)) / np.sqrt(I), jnp.float32))
    want = np.asarray(experts_gather(x, idx, w, gu, dn, E))
    fns, out = {}, {}
    for name, sizes in layouts(n * K).items():
        fn = jax.jit(lambda x, idx, w, sizes=sizes: experts_blocked(x, idx, w, gu, dn, E, sizes))
        t = time.perf_counter()
        got = np.asarray(jax.block_until_ready(fn(x, idx, w)))
        out[name] = [sizes, time.perf_counter() - t, [], float(np.max(np.abs(got - want)))]
        fns[name] = fn
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(x, idx, w))
            out[name][2].append(time.perf_counter() - t)
    return [(name, sizes, comp, statistics.median(ts), err) for name, (sizes, comp, ts, err) in out.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,256,512,2048", help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=60, help="interleaved timed calls per layout")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    args = ap.parse_args(argv)
    meta = cpu_speed.machine_meta(argparse.Namespace(repeats=args.repeats, slow_s=0.0, prompt=0))
    lines = [SECTION, "",
             f"- date: {meta['date']}",
             f"- machine: {meta['cpu']}, {meta['cores']} cores; jax {meta['jax']} on {meta['backend']}",
             f"- command: `{meta['command']}`; qjax {meta['git']}",
             f"- method: {__doc__.split(chr(10) + chr(10))[1].replace(chr(10), ' ')}",
             "",
             "| tokens | slots / expert | layout | sizes | compile (s) | run (ms) | run / default | max abs Δ vs gather |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    for n in (int(t) for t in args.tokens.split(",")):
        rows = measure(n, args.repeats)
        base = rows[0][3]
        for name, sizes, comp, run, err in rows:
            lines.append(f"| {n} | {n * K // E} | {name} | {'/'.join(map(str, sizes))} | {comp:.2f} | "
                         f"{run * 1e3:.2f} | {run / base:.2f}× | {err:.1e} |")
        print("\n".join(lines[-len(rows):]), flush=True)
    text = "\n".join(lines) + "\n"
    if not args.no_write:
        cpu_speed.write_section(text, section=SECTION)
        print(f"wrote {cpu_speed.RESULTS}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
