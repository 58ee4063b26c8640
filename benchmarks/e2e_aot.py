"""What the full-size decode step compiles to on an H200, without a GPU (issue 8): per recipe, XLA's temporary
buffer and the bytes the compiled step copies out of the stacked layer weights, beside the bytes it must read.

The model stores each position of its repeating layer group stacked over the G groups and scans over them; inside
the scan XLA slices each group's variables out of the stack, and a slice that feeds a kernel (a Pallas custom call
or a dot) is materialised — a copy of those weights on every decode step, which costs bandwidth the bound does not
allow for. This script compiles ``qjax.generate``'s decode loop for the real Qwen3.6-35B-A3B config deviceless for
an H200 (``qjax.kernels.aot_h200``'s target) and sums, from the optimised HLO, the bytes of every dynamic slice of
a ``[G, …]`` operand (× G iterations per step).

    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/e2e_aot.py [--recipes w2w4,...] [--no-write]

Needs the jax 0.11.2 + jax-cuda13 environment ``.ci/aot_h200.sh`` builds (``.venv-aot``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("QJAX_KERNELS", "pallas")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import RESULTS, git_state, write_section  # noqa: E402

SECTION = "## Decode step compiled for H200 without a GPU: weight copies and launches (issue 8)"
NOTES = """- History of this table: at commit de5439f the scan sliced every stacked variable, the routed experts
  included: XLA temp 1,132 MB and every decode step copied all 256 experts of every layer — about 10.9 GB read
  and written per step, 10× what the step needs, which would have held an H200 below ~200 tok/s at batch 1.
  Commit 56f6416 let the expert kernels read layer g's experts inside the [G, E, …] stack (an expert offset),
  commit fa1c639 did the same for every packed dense weight (the qmatmul grid covers all layers' row blocks; other
  layers' programs return at once). That left the BF16 projections of mxfp8-experts and bf16: XLA's dots took
  the four 8192×2048 ones per layer group (in_proj_qkv, q_proj) as sliced copies, 1,342 MB per step; the dense
  Pallas kernel (`qjax.kernels.matmul`, the same layer offset, used up to 128 rows) now reads them in place.
- Counter fix (this commit): the earlier version of this table also counted dynamic slices inside fused
  computations — the GDN states, sliced inside the fusions that read them (read in place, not copied) — and so
  reported 189 MB per step for w2w4 / w8a16 where nothing large is copied. What is left (a few KB per step) is
  small vectors.
- At batch 64 (`--batch 64`, mxfp8-experts) nothing large is copied either; XLA temp is 5.1 GB there (9.1 GB
  before the GDN states were carried and updated in place): the new KV and conv-window stacks the scan writes.
- Launches per step (columns added 2026-12-01): at batch 1 the w2w4 step's 2,211 MB take ~0.5 ms at the
  H200's ~4.3 TB/s (docs/kernels.md: measured copy, not verified here) and the 1,000 tok/s target leaves 1 ms, while a
  CUDA graph still pays a fixed cost per kernel (launch and ramp, of the order of a microsecond; not measured here):
  ~1,300 launches can cost as much as the bytes (docs/kernels.md: "batch 1 is latency-bound"). Changes of 2026-12-01,
  w2w4 1,745 → 1,308: the MoE kernels take one token's k slots as k blocks directly (no alignment kernels: −280);
  the 1-row `shared_expert_gate` goes to XLA's fused dot instead of a pad copy + the dense kernel (−80); the layer
  scan carries its group index instead of slicing an index array (−11: one async copy per iteration, which also
  split the iteration's CUDA graph); one Pallas kernel does a GDN layer's decode recurrence (l2-norms, decay, delta
  update, readout) on its fp32 state read and written inside the [G, …] state stack, which the scan now carries
  (−66; XLA temp 151 → 92 MB, and 9.1 → 5.1 GB at batch 64). bf16 3,145 → 1,468: its unquantized experts run the
  MoE kernels (`fmt="dense"`) instead of the plain-JAX per-slot loop (8 iterations × 4 kernels per layer).
- What one w2w4 GDN layer still launches (thunk dump), about 28: residual add and two RMSNorms 5 (XLA does not fuse
  the norm's reduction with its scaling), five projection GEMVs, conv + SiLU, decay/β, the recurrence kernel, gated
  norm, router 5 (GEMV, softmax, copy + sort for top-k, weight cast), shared expert 4, MoE 3; a full-attention
  layer about 31; per group of 4 layers, the conv-window and KV writes into the cache stacks. Next candidates: the
  RMSNorm folded into the next GEMV's prologue (−2 per norm), top-k inside the MoE kernels (−4 per layer). Three
  async slice copies per iteration remain (the gated norm's [G, 128] weight, which XLA feeds to a Triton
  normalization fusion as a copy); they keep the scan body in several CUDA graphs even with
  `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`.
- The copied-bytes count is parsed from the optimised HLO (dynamic slices of [G, …] operands in the computations
  that launch kernels, not inside fused computations) and is a compile-time estimate: XLA may overlap the copies
  with compute, but every byte is still read and written once per step.
"""

_ITEM = {"s32": 4, "u32": 4, "f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "f8e4m3fn": 1, "pred": 1, "s64": 8}
_SHAPE = r"([a-z0-9]+)\[([0-9,]*)\]"


def _bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _ITEM.get(dtype, 4)


def sliced_bytes(hlo: str, groups: int) -> tuple[int, int]:
    """(bytes sliced out of ``[groups, …]`` operands per scan iteration, number of such slices) in optimised HLO.

    Counts async dynamic-slice fusions (``((T[G,…], s32[]), T[1,…], u32[]) fusion-start``) and dynamic-slice
    fusions / ops of the computations themselves (not inside fused computations) whose result has a leading 1 and
    whose first operand is ``[G, …]``.
    """
    # computations a fusion calls: their instructions run inside that fusion's kernel (a dynamic slice there is
    # read in place, not copied); only the computations that schedule kernels are scanned
    fused = set(re.findall(r" fusion\([^\n]*?calls=(%[\w.\-]+)", hlo))
    total = count = 0
    inside_fused = False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            inside_fused = head.group(1) in fused
            continue
        if inside_fused:
            continue
        m = re.search(r"= \(\(" + _SHAPE + r"\{[^}]*\}, s32\[\]\), " + _SHAPE + r"\{[^}]*\}, u32\[\]\) fusion-start",
                      line)
        if m and m.group(2).split(",")[0] == str(groups) and m.group(4).split(",")[0] == "1":
            total += _bytes(m.group(3), m.group(4))
            count += 1
            continue
        if line.lstrip().startswith("ROOT") or "(%param_" in line:
            continue  # inside a fused computation: the fusion that calls it is counted instead
        m = re.search(r"= " + _SHAPE + r"\{[^}]*\} (dynamic-slice|fusion)\((%[^,)]+)", line)
        if m and ("dynamic-slice(" in line or "dynamic_slice" in line.split("calls=")[-1][:40]) \
                and m.group(2).split(",")[0] == "1" and "fusion-start" not in line:
            operand = re.search(re.escape(m.group(4)) + r" = " + _SHAPE, hlo)
            if operand and operand.group(2).split(",")[0] == str(groups):
                total += _bytes(m.group(1), m.group(2))
                count += 1
    return total, count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="w2w4,w8a16-g32,mxfp8-experts,bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    import jax
    from qjax.kernels import aot_h200

    from qjax.runtime import bench
    from qjax.runtime.random_model import abstract_recipe_model

    cfg = bench.load_config()
    groups = cfg.num_hidden_layers // 4
    target = aot_h200.make_target()
    rep = target.replicated
    rows = []
    for recipe in a.recipes.split(","):
        model = abstract_recipe_model(cfg, recipe)
        fn, specs = bench.decode_program(model, batch=a.batch)
        specs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep)
                             if hasattr(s, "shape") and hasattr(s, "dtype") else s, specs)
        with tempfile.TemporaryDirectory(prefix="e2e_aot_") as dump:
            t0 = time.perf_counter()
            with jax.default_device(target.device), jax.sharding.use_abstract_mesh(target.mesh.abstract_mesh):
                compiled = jax.jit(fn, out_shardings=rep).trace(*specs).lower().compile(
                    compiler_options={"xla_dump_to": dump})
            secs = time.perf_counter() - t0
            launches = aot_h200.dump_launches(dump)
        hlo = compiled.as_text()
        per_iter, n = sliced_bytes(hlo, groups)
        model_bytes = bench.decode_bytes(model, a.batch, 512 + 32)
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append((recipe, secs, temp, per_iter * groups, n, model_bytes, launches))
        print(f"{recipe}: compiled in {secs:.1f} s, temp {temp / 1e6:.0f} MB, sliced per step "
              f"{per_iter * groups / 1e6:.0f} MB in {n} slices/iteration, "
              f"step needs {model_bytes['total'] / 1e6:.0f} MB, launches per step {launches}", flush=True)
    lines = [SECTION, "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__} deviceless, target "
             "NVIDIA H200 (kernels/h200.txtpb); no GPU",
             f"- command: `JAX_PLATFORMS=cpu .venv-aot/bin/python {' '.join(shlex.quote(x) for x in sys.argv)}`",
             f"- qjax: {git_state()}",
             f"- program: qjax.generate's decode `while_loop`, batch {a.batch}, 512-token context, 64 steps; the real "
             "35B-A3B config in bf16; sliced bytes = Σ dynamic slices of [G=10, …] operands in the optimised HLO × 10 "
             "scan iterations (each is a copy: read + write); step needs = bytes the decode bound counts; launches = "
             "kernels and device copies one decode step runs, from the compiled thunk sequence "
             "(`aot_h200.loop_launches`: nested loops × their trip counts, the layer scan's body × 10)",
             "",
             "| recipe | compile s | XLA temp MB | copied per step MB | slices / iteration | step needs MB | "
             "copy traffic (read + write) ÷ needed | launches / step | Pallas | other kernels | device copies |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for recipe, secs, temp, copied, n, need, launches in rows:
        lines.append(f"| {recipe} | {secs:.1f} | {temp / 1e6:.0f} | {copied / 1e6:.0f} | {n} | "
                     f"{need['total'] / 1e6:.0f} | {2 * copied / need['total']:.2f} | {sum(launches.values()):,} | "
                     f"{launches.get('pallas', 0):,} | {launches.get('xla', 0):,} | {launches.get('copy', 0):,} |")
    lines += ["", NOTES.rstrip()]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write:
        write_section(text, RESULTS, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
