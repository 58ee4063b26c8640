"""Block-size sweep of the Pallas GEMV (M = 1) at the target shape, timed inside the device (issue 4 / issue 8).

``benchmarks/kernels.py`` times one call from the host: at 8192×2048 (8 MiB of INT4) that is dispatch plus
``block_until_ready``, ~100 µs whatever the kernel does. Here every timed program is one jitted ``fori_loop`` of
``--inner`` chained calls (each call's input depends on the previous output, so nothing is hoisted), so the time per
call is the kernel's own plus one tiny fused add. The same loop times XLA's bf16 dot of the same shape and a copy of
1 GiB (read + write), the yardsticks in the same run.

For each scheme: every config of the grid below is compiled (in threads), checked against the reference (max rel.
error), timed (median of ``--repeats``), and the table lists the fastest, ``choose_config``'s choice, and the same
two with the weight read in place from a 40-layer stack (what the model's decode does).

    python benchmarks/gpu/sweep_gemv.py [--schemes int4_g128,int2_g64] [--shape 8192x2048] [--inner 100]
        [--table-out kernels/tiles.json]

``--table-out``: the fastest config per scheme goes into that tile table (:mod:`qjax.kernels.tiles`; replacing an
entry of the same chip, scheme, shape and M bucket), which ``choose_config`` reads on that chip. On the lent GPU
write it under ``$OUT`` and copy it over ``kernels/tiles.json`` with the run's RESULTS rows.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import make_weight, nbytes, timeit  # noqa: E402  (benchmarks/kernels.py)
from qjax.kernels import qmatmul_pallas as qp  # noqa: E402
from qjax.kernels import tiles  # noqa: E402
from qjax.kernels.qmatmul_reference import qmatmul as ref_qmatmul  # noqa: E402


def loop(fn, inner: int):
    """``fn(x, *w) -> y [1, N]`` chained ``inner`` times in one program (x += y[:, :1]·1e-30: a real dependence that
    leaves x's bf16 values unchanged, so the last ``y`` is also the single call's result, checked for accuracy)."""

    def run(x, *w):
        def body(_, carry):
            x, _ = carry
            y = fn(x, *w)
            return x + (y[:, :1] * 1e-30).astype(x.dtype), y
        return jax.lax.fori_loop(0, inner, body, (x, fn(x, *w)))[1]

    return jax.jit(run)


def timed(compiled, args, repeats: int, inner: int) -> float:
    """Seconds per chained call: kernels.py's median of ``repeats`` host-timed programs ÷ ``inner``."""
    return timeit(compiled, *args, repeats=repeats) / inner


def configs(meta, n: int, k: int, interpret: bool):
    per = 32 // meta.bits
    if interpret:  # the CPU smoke test: a few configs
        grid = itertools.product((16, 32), (128, 256), (1, 2), (4,), (3,))
    else:
        grid = itertools.product((16, 32, 64, 128, 256), (128, 256, 512, 1024), (1, 2, 4, 8), (2, 4, 8), (1, 3))
    for bn, bk, split, warps, stages in grid:
        if bk % per or bk > k or n % bn or bn * bk > 65536 or bn * bk < 2048 and not interpret:
            continue
        unit = max(bk, meta.group_size)
        if k % (unit * split) or k // split < unit:
            continue
        yield qp.KernelConfig("gemv", 16, bn, bk, split, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="int4_g128,int2_g64")
    p.add_argument("--shape", default="8192x2048", help="N×K")
    p.add_argument("--inner", type=int, default=100, help="chained calls per timed program")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=40, help="stack depth of the in-place rows")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile threads")
    p.add_argument("--top", type=int, default=12, help="fastest configs listed per scheme")
    p.add_argument("--table-out", default=None, help="write the fastest config per scheme into this tile table")
    a = p.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    n, k = (int(v) for v in a.shape.split("x"))
    key = jax.random.key(0)
    x = jax.random.normal(key, (1, k), jnp.bfloat16)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; N×K {n}×{k}, "
          f"M 1, {a.inner} chained calls per program, median of {a.repeats}" + (" (interpret)" if interpret else ""),
          flush=True)

    # yardsticks: copy of 1 GiB and XLA's bf16 dot of this shape, both in the same loop form
    big = jnp.zeros((1 << 28) if not interpret else (1 << 20), jnp.float32).reshape(4, -1)  # 1 GiB on the GPU
    copy = jax.jit(lambda b: jax.lax.fori_loop(0, 10, lambda _, b: b + 1.0, b)).lower(big).compile()
    bw = 2 * big.nbytes / timed(copy, (big,), a.repeats, 10)
    w_bf16 = jax.random.normal(key, (n, k), jnp.bfloat16)
    dot = loop(lambda x, w: x @ w.T, a.inner).lower(x, w_bf16).compile()
    t_dot = timed(dot, (x, w_bf16), a.repeats, a.inner)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; XLA bf16 dot {n}x{k}: {t_dot * 1e6:.2f} µs "
          f"= {100 * (n * k * 2 + 4 * k) / t_dot / bw:.0f}% of copy", flush=True)
    empty = loop(lambda x: x[:, :8] * 2.0, a.inner).lower(x).compile()
    t_empty = timed(empty, (x,), a.repeats, a.inner)
    print(f"loop overhead (a trivial body): {t_empty * 1e6:.2f} µs per iteration", flush=True)

    rc = 0
    measured = []
    chip = tiles.chip_of(jax.devices()[0].device_kind) or jax.devices()[0].device_kind
    for scheme in a.schemes.split(","):
        packed, scale, _, meta = make_weight(key, scheme, n, k)
        moved = nbytes(packed, scale, x) + n * 2
        want = np.asarray(jax.jit(lambda x, p, s: ref_qmatmul(x, p, s, None, meta))(x, packed, scale), np.float32)
        cfgs = list(configs(meta, n, k, interpret))
        default = qp.choose_config(1, n, k, meta)
        if default not in cfgs:
            cfgs.append(default)

        def build(cfg, stack=1):
            """The looped program of ``cfg``; ``stack > 1``: the weight read in place from a stack of that depth."""
            layer = jnp.int32(stack // 2) if stack > 1 else None
            fn = lambda x, p, s: qp.qmatmul_pallas(x, p, s, None, meta, interpret=interpret, config=cfg,  # noqa
                                                   layer=layer)
            w = (packed, scale)
            args = (x, *(w if stack == 1 else (jnp.broadcast_to(v, (stack, *v.shape)) for v in w)))
            return loop(fn, a.inner).lower(*args).compile(), args

        t0 = time.perf_counter()
        built, failed = {}, {}
        with cf.ThreadPoolExecutor(a.jobs) as pool:
            futs = {pool.submit(build, c): c for c in cfgs}
            for f in cf.as_completed(futs):
                try:
                    built[futs[f]] = f.result()
                except Exception as e:  # a config the compiler refuses (shared memory, registers)
                    failed[futs[f]] = str(e).splitlines()[0][:120]
        print(f"\n{scheme}: {len(built)} configs compiled, {len(failed)} refused, {time.perf_counter() - t0:.0f} s",
              flush=True)
        rows = []
        for cfg, (looped, args) in built.items():
            got = np.asarray(looped(*args), np.float32)
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            t = timed(looped, args, a.repeats, a.inner)
            rows.append((t, cfg, err))
        rows.sort(key=lambda r: r[0])
        bad = [r for r in rows if r[2] > 2e-2]
        if bad:
            rc = 1
            print(f"CHECK FAILED: {len(bad)} configs, e.g. {bad[0][1]} err {bad[0][2]:.2e}")
        print(f"{'bn':>4} {'bk':>5} {'split':>5} {'warps':>5} {'stages':>6} {'µs':>8} {'%copyBW':>8} "
              f"{'max rel err':>11}")
        shown = rows[:a.top] + [r for r in rows if r[1] == default and r not in rows[:a.top]]
        for t, c, err in shown:
            mark = "  ← choose_config" if c == default else ""
            print(f"{c.bn:>4} {c.bk:>5} {c.split_k:>5} {c.num_warps:>5} {c.num_stages:>6} {t * 1e6:>8.2f} "
                  f"{100 * moved / t / bw:>7.1f}% {err:>11.2e}{mark}", flush=True)
        for c, why in list(failed.items())[:3]:
            print(f"refused: {c}: {why}")
        if rows and not bad:
            measured.append((meta, rows[0][1], rows[0][0] * 1e6))
        # the model's decode reads the layer in place from its stack: the best and the default config that way
        for label, cfg in (("fastest", rows[0][1]), ("choose_config", default)):
            try:
                looped, args = build(cfg, a.layers)
                t = timed(looped, args, a.repeats, a.inner)
                print(f"in a {a.layers}-layer stack, {label} {cfg}: {t * 1e6:.2f} µs = "
                      f"{100 * moved / t / bw:.1f}% of copy", flush=True)
            except Exception as e:
                print(f"in a {a.layers}-layer stack, {label}: failed: {str(e).splitlines()[0][:160]}")
    if a.table_out and measured:
        if chip not in tiles.CHIPS:
            print(f"--table-out: {chip!r} is not a chip the table holds ({', '.join(tiles.CHIPS)}); nothing written")
            return rc or 1
        source = (f"benchmarks/gpu/sweep_gemv.py on an {jax.devices()[0].device_kind}, "
                  f"{time.strftime('%Y-%m-%d')}: fastest of the swept configs, {a.inner} chained calls per "
                  f"fori_loop program, median of {a.repeats}")
        n_written = tiles.merge(a.table_out, [tiles.entry(chip, meta, 1, cfg, us, source)
                                              for meta, cfg, us in measured])
        print(f"tile table {a.table_out}: {len(measured)} entries written ({n_written} in all)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
