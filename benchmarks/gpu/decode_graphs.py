"""On the lent GPU: the decode programs' XLA modes side by side (qjax/runtime/xla_options.py), in one process.

For the full-size random-weight model of each recipe, batch 1 (and ``--batches``), 512-token context: qjax.generate's
decode loop compiled once per mode (``xla``, ``off``, ``graphs``, ``unrolled``), timed interleaved (wall time per
step, no profiler: XLA turns CUDA graphs off under it), the greedy tokens of every mode checked against ``xla``'s,
and each mode's compiled thunk structure on the real device (``aot_h200.step_structure``: graphs, host ops, host
round trips per step). Also dumps the device's own ``GpuTargetConfigProto`` (its driver / runtime / toolkit versions
decide what XLA puts into graphs; the deviceless gate assumes ``aot_h200.LENT_CUDA``).

    python3 benchmarks/gpu/decode_graphs.py --out DIR [--recipes w2w4] [--modes xla,off,graphs,unrolled]
    python3 benchmarks/gpu/decode_graphs.py --table DIR          # DIR/decode.md from DIR/decode_graphs.json + e2e.json
    python3 benchmarks/gpu/decode_graphs.py --dry-run            # the plan, no device work (checks the imports)

Writes DIR/decode_graphs.json, DIR/decode_graphs.md (one row per recipe × batch × mode, the chip named in each),
DIR/best_mode.txt (the fastest mode at batch 1 whose tokens match ``xla``'s) and DIR/gpu_target_config.pbtxt.
Run by ``benchmarks/gpu/run.sh decode``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
import traceback


def device_target_config(out: str | None) -> dict[str, str]:
    """The device's ``GpuTargetConfigProto`` (XLA dumps it with every compile): its CUDA versions, and a copy in
    ``out``."""
    import jax
    import jax.numpy as jnp

    with tempfile.TemporaryDirectory() as dump:
        jax.jit(lambda x: x + 1).lower(jnp.zeros(4)).compile(compiler_options={"xla_dump_to": dump})
        files = glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt"))
        text = ""
        if files:
            with open(files[0], encoding="utf-8") as f:
                text = f.read()
    if out and text:
        with open(os.path.join(out, "gpu_target_config.pbtxt"), "w", encoding="utf-8") as f:
            f.write(text)
    found = {}
    for field in ("name", "driver_version", "runtime_version", "compile_time_toolkit_version", "core_count"):
        for line in text.splitlines():
            if line.strip().startswith(field + ":"):
                found[field] = line.split(":", 1)[1].strip().strip('"')
                break
    return found


def structure(loop, args, kwargs, mode: str) -> dict:
    """The compiled thunk structure of ``loop`` (a jitted decode loop) on this device."""
    from qjax.kernels import aot_h200

    from qjax.runtime.xla_options import decode_compiler_options

    with tempfile.TemporaryDirectory() as dump:
        traced = loop.trace(*args, **kwargs)
        traced.lower().compile(compiler_options={"xla_dump_to": dump, **(decode_compiler_options(mode) or {})})
        calls = aot_h200.pallas_calls(traced.jaxpr)
        s = aot_h200.dump_structure(dump, calls)
    return {"launches": s.total_launches, "graphs": s.graphs, "host_ops": s.host_ops, "host_syncs": s.host_syncs,
            "idle_programs": s.idle_programs, "layer_host_ops": s.layer_host_ops,
            "outside_graphs": s.outside_graphs, "decode_loop_in_graph": s.step_loop_in_graph}


def run(a) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from qjax.runtime import bench
    from qjax.runtime.generate import decode_loop_for

    chip = jax.devices()[0].device_kind
    os.makedirs(a.out, exist_ok=True)
    versions = device_target_config(a.out)
    print(f"chip {chip}; jax {jax.__version__}; device target config {versions}", flush=True)
    settings = bench.Settings(prefill=(), decode_batches=tuple(a.batches), context=a.context,
                              new_tokens=a.new_tokens, repeats=a.repeats, baseline=False)
    rows, rc = [], 0
    for recipe in a.recipes:
        t0 = time.perf_counter()
        model = bench.random_model(bench.load_config(scale=a.scale, layers=a.layers), recipe, seed=0,
                                   dtype=jnp.dtype(a.dtype))
        graphdef, state = nnx.split(model)
        print(f"{recipe}: random model built in {time.perf_counter() - t0:.0f} s", flush=True)
        for b in a.batches:
            logits, cache = bench._warm_cache(model, settings, b)
            n = a.new_tokens

            def contender(mode, logits=logits, cache=cache, graphdef=graphdef, state=state, n=n):
                return (lambda: (logits, bench._copy_tree(cache)),
                        lambda args: bench._decode(graphdef, state, *args, n, graphs=mode))
            try:
                res = bench.time_interleaved({m: contender(m) for m in a.modes}, a.repeats)
            except Exception as e:  # noqa: BLE001 - a failed mode fails the run, the table says which
                traceback.print_exc()
                rows.append({"chip": chip, "recipe": recipe, "batch": b, "mode": ",".join(a.modes),
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
                rc = 1
                continue
            ref = np.asarray(res[a.modes[0]]["out"])[:, :n + 1]
            for mode in a.modes:
                r = res[mode]
                toks = np.asarray(r["out"])[:, :n + 1]
                row = {"chip": chip, "recipe": recipe, "batch": b, "mode": mode, "ms_per_step": 1e3 * r["s"] / n,
                       "tok_s": b * n / r["s"], "compile_s": r["compile_s"],
                       "tokens_match": float(np.mean(toks == ref))}
                if b == a.batches[0] and not a.no_structure:
                    try:
                        loop = decode_loop_for(mode)
                        row.update(structure(loop, (graphdef, state, bench._copy_tree(cache), logits,
                                                    jax.random.key(0), bench._greedy(), n + 1), {}, mode))
                    except Exception as e:  # noqa: BLE001 - the timing stands without it
                        row["structure_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                rc |= row["tokens_match"] < 1.0
    ok = [r for r in rows if "error" not in r and r["batch"] == a.batches[0] and r["tokens_match"] == 1.0]
    best = min(ok, key=lambda r: r["ms_per_step"])["mode"] if ok else "xla"
    with open(os.path.join(a.out, "best_mode.txt"), "w", encoding="utf-8") as f:
        f.write(best + "\n")
    with open(os.path.join(a.out, "decode_graphs.json"), "w", encoding="utf-8") as f:
        json.dump({"chip": chip, "jax": jax.__version__, "target_config": versions, "rows": rows, "best": best}, f,
                  indent=1)
    table(a.out)
    print(f"best mode at batch {a.batches[0]}: {best}", flush=True)
    return int(rc)


def table(folder: str) -> str:
    """DIR/decode.md: the graph-mode rows (decode_graphs.json) and the e2e rows (e2e.json, when there), the chip
    named in every row."""
    lines = []
    path = os.path.join(folder, "decode_graphs.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            g = json.load(f)
        lines += [(f"Decode graph modes (jax {g['jax']}; device target config {g['target_config']}; best: "
                  f"{g['best']})"), "",
                  ("| chip | recipe | batch | mode | ms / step | tok/s | compile s | tokens = xla's | graphs | host ops "
                  "| host syncs | launches | idle programs | outside graphs |"),
                  "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in g["rows"]:
            if "error" in r:
                lines.append(f"| {r['chip']} | {r['recipe']} | {r['batch']} | {r['mode']} | failed: {r['error']} |"
                             + " |" * 9)
                continue
            lines.append(f"| {r['chip']} | {r['recipe']} | {r['batch']} | {r['mode']} | {r['ms_per_step']:.3f} | "
                         f"{r['tok_s']:.1f} | {r['compile_s']:.1f} | {r['tokens_match']:.3f} | {r.get('graphs', '')} |"
                         f" {r.get('host_ops', '')} | {r.get('host_syncs', '')} | {r.get('launches', '')} | "
                         f"{r.get('idle_programs', '')} | {r.get('outside_graphs', r.get('structure_error', ''))} |")
    path = os.path.join(folder, "e2e.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        lines += ["", "Full size, qjax bench (benchmarks/e2e.py --full)", "",
                  "| chip | recipe | measurement | batch | tokens | tok/s | ms / call | compile s |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for res in results:
            for row in res.get("rows", []):
                lines.append(f"| {res.get('device', '?')} | {res.get('recipe')} | {row.get('kind')} | "
                             f"{row.get('batch')} | {row.get('tokens')} | {row.get('tok_s', 0):.1f} | "
                             f"{1e3 * row.get('s', 0):.1f} | {row.get('compile_s', 0):.1f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(folder, "decode.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return text


def main(argv=None) -> int:
    from qjax.runtime.xla_options import MODES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--recipes", default="w2w4")
    p.add_argument("--modes", default=",".join(MODES), help="XLA modes to compare; the first is the reference")
    p.add_argument("--batches", default="1")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=int, default=1, help="a 1/N-width config (a CPU smoke test); default full size")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (a CPU smoke test)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-structure", action="store_true", help="skip the thunk dumps (one extra compile per mode)")
    p.add_argument("--table", metavar="DIR", help="only write DIR/decode.md from the JSON files there")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check the imports; no device work")
    a = p.parse_args(argv)
    if a.table:
        table(a.table)
        return 0
    a.recipes = [r for r in a.recipes.split(",") if r]
    a.modes = [m for m in a.modes.split(",") if m]
    a.batches = [int(b) for b in a.batches.split(",") if b]
    unknown = [m for m in a.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {sorted(MODES)}")
    if a.dry_run:
        from qjax.kernels import aot_h200  # noqa: F401 - the imports the device run needs

        from qjax.runtime import bench  # noqa: F401
        for mode in a.modes:
            print(f"{mode}: {dataclasses.asdict(MODES[mode])} -> compiler_options {MODES[mode].compiler_options()}")
        print(f"plan: recipes {a.recipes}, batches {a.batches}, context {a.context}, {a.new_tokens} steps, "
              f"{a.repeats} timed calls per mode, interleaved; out {a.out}")
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
