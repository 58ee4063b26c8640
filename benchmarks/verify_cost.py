"""What the load-time value checks cost (issue 18): ``qjax.load_model(..., verify=True)`` against ``verify=False`` on
the built-in model, and, from shapes, the check's time on the Qwen3.6-35B-A3B checkpoints (BF16 original and the seed
recipes), measured as throughput per safetensors dtype on this machine and applied to each checkpoint's bytes.

    python benchmarks/verify_cost.py            # prints the RESULTS.md section
    python benchmarks/verify_cost.py --write    # and appends it to benchmarks/RESULTS.md

Baseline in the same run: one memcpy of the same bytes (numpy copy), the least any loader does with them; the
check reads them once more in cache-sized pieces.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import numpy as np
from report import ROOT, append, describe

CONFIG = os.path.join(ROOT, "qjax", "assets", "configs", "qwen3_6_35b_a3b.json")
RECIPES = ["bf16", "w2w4", "w8a16-g32", "mxfp8-experts"]
GIB = 2 ** 30


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def builtin_rows(repeats: int) -> list[str]:
    import jax
    from flax import nnx

    import qjax
    from qjax.checkpoint.hub import default_model_dir

    folder = default_model_dir()

    def load(verify):
        return lambda: jax.block_until_ready(jax.tree.leaves(nnx.state(qjax.load_model(folder, verify=verify))))

    on, off = median_time(load(True), repeats), median_time(load(False), repeats)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    return [f"| built-in model ({size / 2**20:.1f} MiB, bf16) | load, verify off | {off * 1e3:.0f} ms | |",
            f"| | load, verify on | {on * 1e3:.0f} ms | {on / off:.3f}× (+{(on - off) * 1e3:.0f} ms) |"]


def throughput(dtype: str, mb: int, repeats: int) -> tuple[float, float]:
    """(check, memcpy) bytes/s on ``mb`` MiB of random bytes of safetensors dtype ``dtype``."""
    from qjax.checkpoint.loading import verify_values

    n = mb << 20
    raw = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    np_dtype = {"BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8, "F32": np.uint32, "F16": np.uint16}[dtype]
    arr = raw.view(np_dtype)
    if dtype == "BF16":
        arr = (arr & 0x3FFF)  # finite values everywhere, so the check runs to the end
    elif dtype == "F32":
        arr = arr & 0x3FFFFFFF
    elif dtype == "F8_E4M3":
        arr = arr & 0x3F
    elif dtype == "U8":
        arr = arr & 0x7F

    class One:  # the minimum of the checkpoint interface verify_values reads
        folder = "bench"

        def dtype(self, key):
            return dtype

        def file_of(self, key):
            return "bench.safetensors"

    key = "x.weight_scale" if dtype == "U8" else "x.weight"
    check = median_time(lambda: verify_values(One(), key, arr), repeats)
    copy = median_time(lambda: arr.copy(), repeats)
    return n / check, n / copy


def checkpoint_rows(repeats: int) -> tuple[list[str], dict]:
    from qjax.convert.planner import ST_ITEMSIZE, recipe_headers

    from qjax.model.config import TextConfig

    rates = {d: throughput(d, 256, repeats) for d in ("BF16", "F8_E4M3", "U8", "F32")}
    per_tensor = per_call(repeats)
    cfg = TextConfig.from_file(CONFIG)
    rows = []
    for recipe in RECIPES:
        headers, _ = recipe_headers(cfg, recipe)
        checked = unchecked = 0
        seconds = copy_seconds = 0.0
        for key, (shape, dt) in headers.items():
            n = int(np.prod(shape)) * ST_ITEMSIZE[dt]
            rate = rates.get(dt)
            if rate is None or (dt == "U8" and not key.endswith(".weight_scale")):
                unchecked += n  # packed INT words, zero points, weight_shape: every bit pattern is valid
                continue
            checked += n
            seconds += n / rate[0] + per_tensor
            copy_seconds += n / rate[1]
        rows.append(f"| {recipe} | {len(headers):,} | {(checked + unchecked) / GIB:.1f} | {checked / GIB:.1f} | "
                    f"{seconds:.1f} s | "
                    f"{copy_seconds:.1f} s | {seconds / copy_seconds:.2f}× |")
    return rows, rates, per_tensor


def per_call(repeats: int) -> float:
    """Seconds of one verify_values call on a tiny tensor: the fixed cost each of a checkpoint's tensors adds (the
    per-expert 35B checkpoints hold ~100k of them)."""
    from qjax.checkpoint.loading import verify_values

    class One:
        folder = "bench"

        def dtype(self, key):
            return "BF16"

        def file_of(self, key):
            return "bench.safetensors"

    arr = np.zeros(64, np.uint16)
    n = 1000
    return median_time(lambda: [verify_values(One(), "x.weight", arr) for _ in range(n)], repeats) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write", action="store_true")
    a = p.parse_args(argv)
    from qjax import xla_env

    xla_env.apply(single_threaded=True)

    rows, rates, per_tensor = checkpoint_rows(a.repeats)
    built = builtin_rows(a.repeats)
    rate_text = ", ".join(f"{d} {r[0] / GIB:.1f} GiB/s (memcpy {r[1] / GIB:.1f})" for d, r in rates.items())
    text = "\n".join([
        "## Load-time value checks: cost (issue 18)",
        "",
        f"- date: {datetime.date.today()}, {describe()}",
        f"- command: `python benchmarks/verify_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- method: {' '.join(__doc__.split(chr(10) + chr(10))[2].split())} Median of {a.repeats} runs.",
        f"- check throughput per dtype (one core, 256 MiB, in memory): {rate_text}; fixed cost per tensor "
        f"{per_tensor * 1e6:.0f} µs (counted below for every checked tensor)",
        "",
        "| model | what | time | verify on ÷ off |",
        "|---|---|---|---|",
        *built,
        "",
        "Qwen3.6-35B-A3B (text model, from shapes: `qjax/assets/configs/qwen3_6_35b_a3b.json`), the check alone at "
        "the throughputs above (data already in memory; a load from disk reads at the disk's rate first):",
        "",
        "| recipe | tensors | checkpoint GiB | checked GiB | check | one memcpy of those bytes | check ÷ memcpy |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if a.write:
        append(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
