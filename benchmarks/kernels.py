"""Dequant-matmul kernels at the real Qwen3.6-35B-A3B layer shapes: reference vs Pallas, against the copy bandwidth.

For every dense shape (N×K: 8192×2048 q_proj/in_proj_qkv, 2048×4096 o_proj/out_proj, 4096×2048 in_proj_z, expert
512×2048 and 2048×512) × M ∈ {1, 8, 64, 512} × scheme (INT2 g64, INT4 g128, INT8 g32, MXFP8), and for the MoE layer
(256 experts, top-8, H 2048, I 512) × tokens ∈ {1, 8, 64, 512}:

- ``ref``: the plain-JAX reference (XLA dequantize + dot; for MoE: XLA dequantize of all experts + ``ragged_dot``,
  the baseline the issue names);
- ``pallas``: the Pallas (Triton) kernel (GPU only; ``--check`` compares it with the reference first);
- ``bf16``: a bf16 matmul of the same shape (dense) / the bf16-weight MoE reference;
- ``dense bf16-stack``: an unquantized projection inside a ``[10, N, K]`` layer stack: XLA's dot on the sliced
  layer (``ref``) vs ``qjax.kernels.matmul`` reading it in place (``pallas``, the path the model's decode takes);
- ``moe bf16-experts``: the unquantized MoE layer: the plain-JAX reference (``ref``) vs the MoE kernels reading
  the BF16 experts directly (``pallas``);
- ``gdn decode step``: one token of a GDN layer's recurrence with its state inside the layer stack: XLA's fusions
  (``ref``) vs the one-kernel step (``pallas``), B ∈ {1, 8, 64};
- bytes moved (packed weights + scales + zero points + activations in/out) ÷ time, and that as a share of the copy
  bandwidth measured in the same run (a jitted copy of a 1 GiB array; read + write counted).

Each time is the median of ``--repeats`` runs after a warm-up, timed from the host (dispatch and
``block_until_ready`` included: ~100 µs on a GPU whatever the kernel does). ``--device-time`` adds the device's own
time per call of the Pallas side (``dev µs``: the profiler's kernel durations over ``--repeats`` calls,
:mod:`device_time`) and its share of the copy bandwidth (``%BW dev``), so an M = 1 GEMV's bandwidth shows instead of
the host floor. Weights are random packed words made on the device.

    python benchmarks/kernels.py [--check] [--device-time] [--repeats 20] [--filter int4] [--impl pallas|…]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from device_time import device_profile
from qjax.kernels import QuantMeta, dense_meta, dequantize, ops
from qjax.kernels.moe_reference import experts_grouped

DENSE_SHAPES = [(8192, 2048), (2048, 4096), (4096, 2048), (512, 2048), (2048, 512)]
MS = [1, 8, 64, 512]
SCHEMES = {"int2_g64": ("int", 2, 64), "int4_g128": ("int", 4, 128), "int8_g32": ("int", 8, 32),
           "mxfp8": ("mxfp8", 8, 32)}
MOE = dict(experts=256, top_k=8, hidden=2048, inter=512)


def make_weight(key, scheme: str, n: int, k: int, lead: tuple[int, ...] = ()):
    fmt, bits, group = SCHEMES[scheme]
    meta = QuantMeta(fmt, bits, group, k, n, True, "group", "uint8" if fmt == "mxfp8" else "bfloat16")
    k1, k2 = jax.random.split(key)
    if fmt == "mxfp8":
        packed = jax.random.normal(k1, (*lead, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jax.random.randint(k2, (*lead, n, k // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    else:
        packed = jax.random.randint(k1, (*lead, n, meta.packed_cols), jnp.iinfo(jnp.int32).min,
                                    jnp.iinfo(jnp.int32).max, jnp.int32)
        scale = (jax.random.uniform(k2, (*lead, n, meta.num_groups), jnp.float32, 0.5, 1.5) * 0.01).astype(
            jnp.bfloat16)
    return packed, scale, None, meta


def nbytes(*arrays) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in arrays if a is not None)


def wanted(args, label: str) -> bool:
    """``--filter``: comma-separated substrings, any of which selects a case (empty: every case)."""
    return not args.filter or any(f and f in label for f in args.filter.split(","))


def timeit(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes/s of a jitted copy of a 1 GiB array (read + write)."""
    n = (1 << 30) // 4 if jax.default_backend() != "cpu" else (1 << 27) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / timeit(f, x, repeats=repeats)


def measure(row: dict, ref, pal, call: tuple, moved: int, args, bw: float, rows: list) -> None:
    """Time ``ref`` and (unless ``--impl reference``) ``pal`` on ``call``; with ``--check`` their max relative
    difference first; both as shares of the copy bandwidth for ``moved`` bytes. Appends and prints the row."""
    row["ref"] = timeit(ref, *call, repeats=args.repeats)
    if args.impl != "reference":
        if args.check:
            a, b = np.asarray(pal(*call), np.float32), np.asarray(ref(*call), np.float32)
            row["err"] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        row["pallas"] = timeit(pal, *call, repeats=args.repeats)
        if args.device_time:
            prof = device_profile(pal, call, calls=args.repeats)
            if prof.source != "none":
                row["dev"], row["dev_source"] = prof.per_call, prof.source
    record(row, moved, bw, rows)


def record(row: dict, moved: int, bw: float, rows: list) -> None:
    """Bandwidth shares of the timed row (``moved`` bytes), then append and print it."""
    if "pallas" in row:
        row["bw"] = moved / row["pallas"] / bw
    if row.get("dev"):
        row["dev_bw"] = moved / row["dev"] / bw
    row["ref_bw"] = moved / row["ref"] / bw
    rows.append(row)
    print(fmt_row(row), flush=True)


def dense_cases(args, bw, rows):
    key = jax.random.key(0)
    for (n, k) in DENSE_SHAPES:
        for scheme in SCHEMES:
            if not wanted(args, f"dense {scheme} {n}x{k}"):
                continue
            packed, scale, zero, meta = make_weight(key, scheme, n, k)
            w_bf16 = dequantize(packed, scale, zero, meta, jnp.bfloat16)
            for m in MS:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                ref = jax.jit(lambda x, p, s: ops.qmatmul(x, p, s, None, meta, impl="reference"))
                pal = jax.jit(lambda x, p, s: ops.qmatmul(x, p, s, None, meta, impl=args.impl))
                bf = jax.jit(lambda x, w: x @ w.T)
                row = dict(case=f"dense {scheme} {n}x{k}", m=m)
                row["bf16"] = timeit(bf, x, w_bf16, repeats=args.repeats)
                measure(row, ref, pal, (x, packed, scale), nbytes(packed, scale, x) + m * n * 2, args, bw, rows)


def dense_stack_cases(args, bw, rows, layers: int = 10):
    """An unquantized BF16 projection as the model's layer scan holds it: a ``[10, N, K]`` stack and a traced layer
    index. ``ref`` slices the layer for XLA's dot (what the model did before ``kernels.matmul``), ``pallas`` reads
    it in place; ``bf16`` is the plain dot on an unstacked weight (no slice) for scale."""
    for (n, k) in DENSE_SHAPES:
        if not wanted(args, f"dense bf16-stack {n}x{k}"):
            continue
        w = jax.random.normal(jax.random.key(n + k), (layers, n, k), jnp.bfloat16)
        g = jnp.int32(layers // 2)
        for m in MS:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            ref = jax.jit(lambda x, w, g: ops.matmul(x, w, impl="reference", layer=g))
            pal = jax.jit(lambda x, w, g: ops.matmul(x, w, impl=args.impl, layer=g))
            bf = jax.jit(lambda x, w: x @ w.T)
            row = dict(case=f"dense bf16-stack {n}x{k}", m=m)
            row["bf16"] = timeit(bf, x, w[0], repeats=args.repeats)
            measure(row, ref, pal, (x, w, g), n * k * 2 + nbytes(x) + m * n * 2, args, bw, rows)


def moe_cases(args, bw, rows):
    e, k_top, h, inter = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    for scheme in SCHEMES:
        if not wanted(args, f"moe {scheme}"):
            continue
        gu = make_weight(jax.random.key(1), scheme, 2 * inter, h, (e,))
        dn = make_weight(jax.random.key(2), scheme, h, inter, (e,))
        for n in MS:
            x = jax.random.normal(jax.random.key(n), (n, h), jnp.bfloat16)
            logits = jax.random.normal(jax.random.key(n + 1), (n, e), jnp.float32)
            w, idx = jax.lax.top_k(jax.nn.softmax(logits), k_top)
            w = (w / w.sum(-1, keepdims=True)).astype(jnp.bfloat16)

            def baseline(x, idx, w, gp, gs, dp, ds):
                # XLA's dequantize + ragged_dot (what the Pallas MoE kernel must beat by 3×)
                gw = dequantize(gp, gs, None, gu[3], x.dtype)
                dw = dequantize(dp, ds, None, dn[3], x.dtype)
                return experts_grouped(x, idx, w, lambda s: gw, lambda s: dw, e)

            base = jax.jit(baseline)
            args_ = (x, idx.astype(jnp.int32), w, gu[0], gu[1], dn[0], dn[1])
            active = min(e, n * k_top)
            moved = (nbytes(gu[0], gu[1]) + nbytes(dn[0], dn[1])) * active // e + nbytes(x) * 2
            pal = jax.jit(lambda x, idx, w, gp, gs, dp, ds: ops.moe_experts(
                x, idx, w, (gp, gs, None, gu[3]), (dp, ds, None, dn[3]), impl=args.impl))
            measure(dict(case=f"moe {scheme} E{e} top{k_top}", m=n), base, pal, args_, moved, args, bw, rows)


def moe_dense_cases(args, bw, rows):
    """The unquantized (BF16 original) model's MoE layer: ``ref`` is the plain-JAX reference the model used before
    the kernels took dense experts (a per-slot loop at decode, expert-aligned blocks at prefill), ``pallas`` the
    MoE kernels with ``fmt="dense"`` tiles."""
    if not wanted(args, "moe bf16-experts"):
        return
    e, k_top, h, inter = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    gu = jax.random.normal(jax.random.key(1), (e, 2 * inter, h), jnp.bfloat16) * 0.03
    dn = jax.random.normal(jax.random.key(2), (e, h, inter), jnp.bfloat16) * 0.03
    gm, dm = dense_meta(2 * inter, h, jnp.bfloat16), dense_meta(h, inter, jnp.bfloat16)
    for n in MS:
        x = jax.random.normal(jax.random.key(n), (n, h), jnp.bfloat16)
        logits = jax.random.normal(jax.random.key(n + 1), (n, e), jnp.float32)
        w, idx = jax.lax.top_k(jax.nn.softmax(logits), k_top)
        w = (w / w.sum(-1, keepdims=True)).astype(jnp.bfloat16)
        ref = jax.jit(lambda x, idx, w, gu, dn: ops.moe_experts(x, idx, w, (gu, None, None, gm), (dn, None, None, dm),
                                                                impl="reference"))
        pal = jax.jit(lambda x, idx, w, gu, dn: ops.moe_experts(x, idx, w, (gu, None, None, gm), (dn, None, None, dm),
                                                                impl=args.impl))
        active = min(e, n * k_top)
        moved = (nbytes(gu) + nbytes(dn)) * active // e + nbytes(x) * 2
        measure(dict(case=f"moe bf16-experts E{e} top{k_top}", m=n), ref, pal,
                (x, idx.astype(jnp.int32), w, gu, dn), moved, args, bw, rows)


def gdn_cases(args, bw, rows, layers: int = 10):
    """The GDN decode step of Qwen3.6-35B-A3B (16 qk / 32 value heads, Dk = Dv = 128) with its fp32 state inside a
    ``[10, B, 32, 128, 128]`` stack, as the layer scan holds it: ``ref`` is the plain-JAX recurrence (XLA's fusions,
    the layer sliced and updated back), ``pallas`` the one-kernel step reading and writing the layer in place. The
    stack is donated and threaded through the calls, as the scan's carry is, so neither times a copy of the stack."""
    if not wanted(args, "gdn decode"):
        return
    for b in (1, 8, 64):
        key = jax.random.key(b)
        q, k = (jax.random.normal(jax.random.fold_in(key, i), (b, 16, 128), jnp.bfloat16) for i in range(2))
        v = jax.random.normal(jax.random.fold_in(key, 2), (b, 32, 128), jnp.bfloat16)
        g = -jax.random.uniform(jax.random.fold_in(key, 3), (b, 32), jnp.float32)
        beta = jax.random.uniform(jax.random.fold_in(key, 4), (b, 32), jnp.float32).astype(jnp.bfloat16)
        layer = jnp.int32(layers // 2)

        def make(impl):
            return jax.jit(lambda s, q, k, v, g, beta, layer: ops.gated_delta_step(q, k, v, g, beta, s, impl=impl,
                                                                                  layer=layer), donate_argnums=0)

        def per_call(step, n=20):
            s = jax.random.normal(jax.random.key(0), (layers, b, 32, 128, 128), jnp.float32)
            o, s = step(s, q, k, v, g, beta, layer)  # warm-up (compiles)
            times = []
            for _ in range(max(3, args.repeats // 4)):
                jax.block_until_ready(s)
                t = time.perf_counter()
                for _ in range(n):
                    o, s = step(s, q, k, v, g, beta, layer)
                jax.block_until_ready((o, s))
                times.append((time.perf_counter() - t) / n)
            return statistics.median(times)

        ref, pal = make("reference"), make(args.impl)
        row = dict(case="gdn decode step (in stack)", m=b)
        row["ref"] = per_call(ref)
        moved = 2 * b * 32 * 128 * 128 * 4 + 2 * (q.nbytes + k.nbytes + v.nbytes)  # this layer's state read + write
        if args.impl != "reference":
            row["pallas"] = per_call(pal)
            if args.check:  # same state and inputs on both sides: one call each from a fresh stack
                s0 = jax.random.normal(jax.random.key(1), (layers, b, 32, 128, 128), jnp.float32)
                a = np.asarray(pal(s0.copy(), q, k, v, g, beta, layer)[0], np.float32)
                c = np.asarray(ref(s0.copy(), q, k, v, g, beta, layer)[0], np.float32)
                row["err"] = float(np.abs(a - c).max() / max(np.abs(c).max(), 1e-30))
        record(row, moved, bw, rows)


HEADER = (f"{'case':<28} {'M':>4} {'ref µs':>9} {'pallas µs':>10} {'bf16 µs':>9} {'pallas/ref':>10} "
          f"{'%copyBW':>8} {'dev µs':>8} {'%BW dev':>8} {'max rel err':>12}")


def fmt_row(r) -> str:
    pal, nan = r.get("pallas"), float("nan")
    return (f"{r['case']:<28} {r['m']:>4} {r['ref'] * 1e6:>9.1f} "
            f"{(pal * 1e6 if pal else nan):>10.1f} {r.get('bf16', nan) * 1e6:>9.1f} "
            f"{(r['ref'] / pal if pal else nan):>9.2f}× "
            f"{100 * r.get('bw', r['ref_bw']):>7.1f}% {r.get('dev', nan) * 1e6:>8.1f} "
            f"{100 * r.get('dev_bw', nan):>7.1f}% {r.get('err', nan):>12.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--filter", default="", help="comma-separated substrings of the case names (any matches)")
    p.add_argument("--check", action="store_true", help="compare Pallas with the reference before timing")
    p.add_argument("--impl", default=None, choices=["pallas", "interpret", "reference"],
                   help="default: pallas on GPU, reference elsewhere")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--skip-gdn", action="store_true")
    p.add_argument("--device-time", action="store_true",
                   help="also the Pallas side's device time per call (profiler kernel durations: dev µs, %%BW dev)")
    args = p.parse_args(argv)
    if args.impl is None:
        args.impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    bw = copy_bandwidth(args.repeats)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s, impl {args.impl}; %copyBW is the Pallas kernel's (or ref's), host-"
          f"timed{'; dev µs: device time per call (profiler)' if args.device_time else ''}")
    print(HEADER)
    rows: list[dict] = []
    if not args.skip_dense:
        dense_cases(args, bw, rows)
        dense_stack_cases(args, bw, rows)
    if not args.skip_moe:
        moe_cases(args, bw, rows)
        moe_dense_cases(args, bw, rows)
    if not args.skip_gdn:
        gdn_cases(args, bw, rows)
    bad = [r for r in rows if r.get("err", 0) > 2e-2]
    if bad:
        print(f"CHECK FAILED for {len(bad)} cases: " + ", ".join(f"{r['case']} M={r['m']}" for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
