"""What the full-size decode step compiles to on an H100 / H200, without a GPU: weight copies, launches, CUDA graphs,
host round trips and idle Pallas programs per step — and the CI gate on them.

Two tables, written into ``benchmarks/RESULTS.md`` by a plain run:

1. **Weight copies** (issue 8): the model stores each position of its repeating layer group stacked over the G groups
   and scans over them; a slice of a stack that feeds a kernel is materialised — a copy on every decode step. Per
   recipe: XLA's temporary buffer and the bytes of every dynamic slice of a ``[G, …]`` operand (× G iterations per
   step), beside the bytes the step must read.
2. **Graphs** (the GPU-decode issue: "one replayed graph per step, no idle programs, ≤ 400 launches"): per target
   chip, recipe and XLA mode of :mod:`qjax.runtime.xla_options`, from XLA's thunk dump
   (:func:`qjax.kernels.aot_h200.step_structure`) and the traced program's Pallas calls
   (:func:`qjax.kernels.aot_h200.pallas_calls`): launches, Pallas programs and the idle ones, CUDA graphs, what the
   host issues, host round trips per step and per layer.

``--gate`` (run by ``.ci/aot_h200.sh``): compiles the full-size w2w4 decode loop (``qjax.generate``'s, batch 1, the
default XLA mode and the ``graphs`` mode) for the H100 and the H200 and fails when a number is above its row of
:data:`GATE` — today's
measured values, a ratchet: lower a row when a change improves it, never raise it — printing the distance to the
issue's target (:data:`ISSUE_TARGET`) on every run.

    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/e2e_aot.py [--no-write]          # both tables
    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/e2e_aot.py --recipes w2w4 --no-write
    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/e2e_aot.py --gate                # CI: exit 1 above the table

Needs the jax 0.11.2 + jax-cuda13 environment ``.ci/aot_h200.sh`` builds (``.venv-aot``). The compile targets carry
the lent image's CUDA version (``aot_h200.LENT_CUDA``; ``--cuda file`` keeps the target files' 12.8): XLA's
command-buffer pass decides by it.
"""

from __future__ import annotations

import argparse
import dataclasses
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


# --------------------------------------------------------------------------------------------------------------------
# The gate: ONE table of limits (the full-size w2w4 decode loop, batch 1, the default XLA mode)
# --------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
    launches: int  # kernels + device copies per decode step
    idle_programs: int  # Pallas grid programs per step that exit at once
    layer_syncs: int  # host round trips per layer (predicate copies + waits inside the layer loop, per iteration)
    step_syncs: int  # host round trips per decode step
    host_ops: int  # what the host issues per step: graph launches + thunks outside graphs + host-driven iterations


# The issue's target: one replayed graph per step (or per decode loop: 0), no idle programs, ≤ 400 launches, no host
# round trip per layer or per step.
ISSUE_TARGET = Limits(launches=400, idle_programs=0, layer_syncs=0, step_syncs=0, host_ops=1)
# Today's measured values (2026-12-07, jax 0.11.2, deviceless, CUDA 13 target; benchmarks/RESULTS.md "Graphs"
# section), per (chip, XLA mode): the default mode, and `graphs`, whose whole decode loop is one CUDA graph since the
# decode attention reads K/V in place (no host operation or round trip per step). Lower any row as the work lands;
# never raise one.
GATE: dict[tuple[str, str], Limits] = {
    ("h200", "xla"): Limits(launches=980, idle_programs=0, layer_syncs=0, step_syncs=2, host_ops=40),
    ("h100", "xla"): Limits(launches=980, idle_programs=0, layer_syncs=0, step_syncs=2, host_ops=40),
    ("h200", "graphs"): Limits(launches=980, idle_programs=0, layer_syncs=0, step_syncs=0, host_ops=0),
    # H100: XLA's fusion for this target puts the attention's q_norm into a Triton normalisation fusion that cannot
    # take the layer scan's slice of the [10, 256] q_norm weights inside it; the slice becomes an asynchronous
    # dynamic-slice copy, which keeps the decode loop out of the graph (one graph per step, the loop on the host)
    ("h100", "graphs"): Limits(launches=980, idle_programs=0, layer_syncs=0, step_syncs=1, host_ops=3),
}
GATE_RECIPE = "w2w4"
GATE_MODES = ("graphs",)  # checked besides the default mode


def gate_check(target: str, got: Limits, mode: str = "xla") -> tuple[bool, list[str]]:
    """(within :data:`GATE`'s row, one line per number: measured, limit, the issue's target and the distance)."""
    limit = GATE[(target, mode)]
    ok, lines = True, []
    for f in dataclasses.fields(Limits):
        v, lim, want = getattr(got, f.name), getattr(limit, f.name), getattr(ISSUE_TARGET, f.name)
        bad = v > lim
        ok &= not bad
        gap = v - want
        lines.append(f"  {f.name:<14} {v:>8,}  limit {lim:>8,}  {'FAIL' if bad else 'ok  '}  issue target ≤ {want:,}"
                     + (f": {gap:,} to go" if gap > 0 else ": met")
                     + (f" (lower the limit to {v:,})" if v < lim else ""))
    return ok, lines


# --------------------------------------------------------------------------------------------------------------------
# Weight copies (table 1)
# --------------------------------------------------------------------------------------------------------------------
SECTION = "## Decode step compiled for H200 without a GPU: weight copies and launches (issue 8)"
GRAPH_SECTION = ("## Decode step compiled for H100 and H200 without a GPU: CUDA graphs, host round trips, idle "
                 "programs (GPU decode)")
NOTES = """- History of this table: at commit de5439f the scan sliced every stacked variable, the routed experts
  included: XLA temp 1,132 MB and every decode step copied all 256 experts of every layer — about 10.9 GB read
  and written per step, 10× what the step needs, which would have held an H200 below ~200 tok/s at batch 1.
  Commit 56f6416 let the expert kernels read layer g's experts inside the [G, E, …] stack (an expert offset),
  commit fa1c639 did the same for every packed dense weight (the qmatmul grid covers all layers' row blocks; other
  layers' programs return at once). That left the BF16 projections of mxfp8-experts and bf16: XLA's dots took
  the four 8192×2048 ones per layer group (in_proj_qkv, q_proj) as sliced copies, 1,342 MB per step; the dense
  Pallas kernel (`qjax.kernels.matmul`, the same layer offset, used up to 128 rows) now reads them in place.
- Counter fix (commit c3e8dc1): the earlier version of this table also counted dynamic slices inside fused
  computations — the GDN states, sliced inside the fusions that read them (read in place, not copied) — and so
  reported 189 MB per step for w2w4 / w8a16 where nothing large is copied.
- The slices left (2026-12-07; 0 MB on 2026-12-01, at commit c3e8dc1): 3 per layer iteration, 1.3 MB, 13 MB per
  step at this context — the full-attention layer's K and V
  cache, `bf16[10,1,2,640,256]` → `[1,1,2,640,256]` (655 KB each), sliced out of the [G, …] cache stack for the
  attention dots (they grow with the context), and one 1 KB row of it. XLA makes the two large ones asynchronous
  copies on a second stream (its `dynamic-slice-copy-fusion-async-wrapper` pass); they are what kept the decode
  loop out of a single CUDA graph (the "CUDA graphs" section below). mxfp8-experts has 1 (its attention reads the
  cache in place). The gated norm's [G, 128] weight copies of 2026-12-01 are gone. Since the decode-attention
  kernels (`qjax.kernels.decode_attention`, 2026-12-07) read the K/V layer in place, the two large slices are gone
  at decode for a BF16 cache as well (this table: 0 MB, 1 slice per iteration, the 1 KB row).
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
  2026-12-07: w2w4 1,350 at HEAD 8b59882 (the same with the step count a constant or an argument; the +42 against
  1,308 came with the commits since c3e8dc1, not traced here), then 1,230 with the fused GDN decode kernel (conv
  step, SiLU, decay, β and the recurrence in one launch) and 1,080 with the routing inside the MoE kernels (one
  token: softmax, top-k and the slot's weight computed by every program; XLA's softmax, sort, copy and select
  between the router and the experts gone: −3 launches per MoE layer and the sort's copies). The H200's Pallas
  programs rose 56,000 → 66,240 with the measured 8192×2048 GEMV tiles (kernels/tiles.json: bn 16 instead of 32).
  Then 1,020: a GEMV of at most 64 KiB of weight is no longer split
  along K (`qmatmul_pallas.SPLIT_MIN_BYTES`: the split's sum was a launch of its own; the GDN layers' 32-row
  `in_proj_a` / `in_proj_b`, −2 per GDN layer).
- What one w2w4 layer still launches (thunk dump of the H200 decode loop, 2026-12-07, after the GDN decode
  kernel and the routing inside the MoE kernels): a GDN layer 23–24 — RMSNorm 2 (XLA does not fuse the norm's
  reduction with its scaling), the `in_proj_a` / `in_proj_b` GEMVs 2 and their split-K sums 2, `in_proj_qkv` 1, the
  GDN decode kernel 1, `in_proj_z` 1, the gated norm 2, `out_proj` 1, residual add + RMSNorm 2, the router GEMV 1
  and its split-K sum 1, the shared expert 4 (gate, up, SiLU·up, down) and its 1-row gate 0–1 (XLA fuses it with a
  neighbour in some layers), the MoE kernels 2, the residual add 1; a full-attention layer ~37 (its q/k/v GEMVs
  and split-K sums, q/k norms and RoPE, the K/V cache writes and the two asynchronous cache-slice copies, the two
  attention dots, softmax 3, the output gate, `o_proj`, then the same MoE tail). Then 980: the decode-attention
  kernels (statistics and values passes over key parts, K/V read in place) replace the two cache-slice copies, the
  two dots, the softmax and the convert (−4 per attention layer, and the copies out of the graph's way: see the
  "CUDA graphs" section). Next candidates, each removing whole launches: the RMSNorm in the next GEMV's prologue
  (−2 per norm), the router's split-K partials summed by the MoE kernels (−1 per layer), the shared expert beside
  the routed experts.
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


# --------------------------------------------------------------------------------------------------------------------
# Compiling one decode program
# --------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    target: str
    cuda: str
    recipe: str
    program: str
    mode: str
    batch: int
    seconds: float = 0.0
    temp: int = 0
    copied: int = 0  # bytes per step sliced out of [G, …] stacks
    slices: int = 0  # such slices per layer iteration
    need: float = 0.0  # bytes per step the decode bound counts
    step: object = None  # aot_h200.StepStructure
    calls: list = dataclasses.field(default_factory=list)  # aot_h200.PallasCall of the program
    error: str | None = None

    def limits(self) -> Limits:
        s = self.step
        return Limits(launches=s.total_launches, idle_programs=s.idle_programs,
                      layer_syncs=-(-s.host_syncs_in_layers // (s.layer_trip_count or 1)), step_syncs=s.host_syncs,
                      host_ops=s.host_ops)


def _serve_program(model, batch: int, slots: int = 1024):
    """(jitted, args, kwargs): the serving engine's decode program (a ``fori_loop`` over a traced step count) for a
    pool of ``batch`` rows with ``slots`` cache slots each."""
    import jax
    import jax.numpy as jnp

    from qjax.runtime.sampling import SamplingArrays
    from qjax.serving.programs import Pool, Programs

    programs = Programs(model, lambda signature: None)
    pool = jax.eval_shape(lambda: Pool(cache=model.init_cache(batch, slots), tokens=jnp.zeros((batch,), jnp.int32),
                                       keys=jnp.zeros((batch, 2), jnp.uint32),
                                       sampling=SamplingArrays.zeros(batch)))
    args = (programs.leaves, pool, jax.ShapeDtypeStruct((batch,), bool), jax.ShapeDtypeStruct((), jnp.int32))
    return programs._decode, args, {"rows": None, "kv_len": slots, "max_steps": 8, "top_k": None}


def compile_row(row: Row, cache: dict) -> Row:
    """Compile ``row``'s program deviceless and fill in what its dump and jaxpr say."""
    import jax
    from qjax.kernels import aot_h200

    from qjax.runtime import bench
    from qjax.runtime.random_model import abstract_recipe_model
    from qjax.runtime.xla_options import decode_compiler_options

    key = ("target", row.target, row.cuda)
    if key not in cache:
        cache[key] = aot_h200.make_target(row.target, cuda=None if row.cuda == "file" else row.cuda)
    target = cache[key]
    if ("model", row.recipe) not in cache:
        cache[("model", row.recipe)] = abstract_recipe_model(bench.load_config(), row.recipe)
    model = cache[("model", row.recipe)]
    rep = target.replicated

    def placed(tree):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep)
                            if hasattr(s, "shape") and hasattr(s, "dtype") else s, tree)

    options = decode_compiler_options(row.mode) or {}
    try:
        with tempfile.TemporaryDirectory(prefix="e2e_aot_") as dump:
            t0 = time.perf_counter()
            with jax.default_device(target.device), jax.sharding.use_abstract_mesh(target.mesh.abstract_mesh):
                if row.program == "serve":
                    jitted, args, kwargs = _serve_program(model, row.batch)
                    traced = jitted.trace(*placed(args), **kwargs)
                else:
                    fn, specs = bench.decode_program(model, batch=row.batch)
                    traced = jax.jit(fn, out_shardings=rep).trace(*placed(specs))
                compiled = traced.lower().compile(compiler_options={"xla_dump_to": dump, **options})
            row.seconds = time.perf_counter() - t0
            row.calls = aot_h200.pallas_calls(traced.jaxpr)
            row.step = aot_h200.dump_structure(dump, row.calls)
        groups = model.config.num_hidden_layers // 4
        per_iter, row.slices = sliced_bytes(compiled.as_text(), groups)
        row.copied = per_iter * groups
        row.temp = compiled.memory_analysis().temp_size_in_bytes
        row.need = bench.decode_bytes(model, row.batch, 512 + 32)["total"]
    except Exception as e:  # noqa: BLE001 - reported in its row
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return row


def _describe(row: Row) -> str:
    if row.error:
        return f"{row.target} {row.recipe} {row.program} {row.mode}: FAILED {row.error}"
    s = row.step
    return (f"{row.target} (CUDA {row.cuda}) {row.recipe} {row.program} mode={row.mode}: compiled in "
            f"{row.seconds:.1f} s; launches/step {s.total_launches} {s.launches}; Pallas programs {s.pallas_programs:,}"
            f" (idle {s.idle_programs:,}); graphs/step {s.graphs}, host ops/step {s.host_ops}, host syncs/step "
            f"{s.host_syncs} (in the layer loop {s.host_syncs_in_layers}); layer loop ×{s.layer_trip_count}, "
            f"{s.layer_host_ops} host ops/iteration; decode loop trip count "
            f"{s.step_trip_count if s.step_trip_count is not None else 'unknown'}, in a graph: "
            f"{s.step_loop_in_graph}; outside graphs per step {s.outside_graphs}"
            + (f"; unmatched Pallas launches {s.unmatched_pallas}" if s.unmatched_pallas else ""))


# --------------------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------------------
def _header(jax_version: str, argv: list[str], what: str) -> list[str]:
    return [(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax_version}, deviceless, no GPU "
            f"({what})"),
            f"- command: `JAX_PLATFORMS=cpu .venv-aot/bin/python {' '.join(shlex.quote(x) for x in argv)}`",
            f"- qjax: {git_state()}"]


def copies_section(rows: list[Row], jax_version: str, argv: list[str]) -> str:
    lines = [SECTION, "", *_header(jax_version, argv, "target NVIDIA H200, kernels/h200.txtpb"),
             ("- program: qjax.generate's decode `while_loop` (the step count an argument, as qjax.generate runs it), "
             "batch 1, 512-token context, 64 steps; the real 35B-A3B config in bf16; sliced bytes = Σ dynamic slices "
             "of [G=10, …] operands in the optimised HLO × 10 scan iterations (each is a copy: read + write); step "
             "needs = bytes the decode bound counts; launches = kernels and device copies one decode step runs, from "
             "the compiled thunk sequence (`aot_h200.step_structure`: nested loops × their trip counts)"),
             "", ("| recipe | compile s | XLA temp MB | copied per step MB | slices / iteration | step needs MB | "
             "copy traffic (read + write) ÷ needed | launches / step | Pallas | other kernels | device copies |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.recipe} | failed: {r.error[:120]} |" + " |" * 9)
            continue
        ln = r.step.launches
        lines.append(f"| {r.recipe} | {r.seconds:.1f} | {r.temp / 1e6:.0f} | {r.copied / 1e6:.1f} | {r.slices} | "
                     f"{r.need / 1e6:.0f} | {2 * r.copied / r.need:.3f} | {r.step.total_launches:,} | "
                     f"{ln.get('pallas', 0):,} | {ln.get('xla', 0):,} | {ln.get('copy', 0):,} |")
    return "\n".join([*lines, "", NOTES.rstrip()]) + "\n"


GRAPH_NOTES = """- Columns: launches = kernels + device copies per step (nested loops × trip counts); Pallas programs = grid
  programs of the Pallas launches, idle = those that exit at once (`aot_h200.pallas_calls`: a top-level `pl.when`
  guard evaluated over the grid with the layer read as 0, or a grid wider than its blocked outputs); graphs = CUDA
  graph (command buffer) launches per step; host ops = what the host issues per step (graph launches, thunks outside
  graphs, host-driven loop iterations and branches: 1 = one graph per step, 0 = the decode loop captured whole);
  syncs = host round trips per step (a `WhileThunk` without a known trip count or a `ConditionalThunk` outside a
  graph copies its predicate to the host and waits, XLA `while_thunk.cc` / `conditional_thunk.cc`), in the layer
  loop per layer; layer ops = host ops per layer-loop iteration; outside graphs = thunk kinds the host runs per step.
- Modes (`qjax/runtime/xla_options.py`): `xla` XLA's defaults (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN,
  CONDITIONAL, DYNAMIC_SLICE_FUSION; min graph size 5); `off` no graphs; `graphs` + WHILE, loops unrolled inside
  graphs, min graph size 1; `unrolled` `graphs` + `WHILE_LOOP_UNROLLING_FULL_UNROLL` (the layer loop unrolled in HLO).
- CUDA: the targets' driver / runtime / toolkit versions. `13.0.0` is the lent image's stack (jax-cuda13); `file`
  keeps XLA's embedded test-machine values (runtime and toolkit 12.8), under which XLA's command-buffer pass leaves
  dynamic-slice copies (they need CUDA ≥ 12.9 in a graph) and everything that contains them outside graphs.
- Programs: `generate` = qjax.generate's decode `while_loop` (what `qjax bench` times; the gate's program),
  `serve` = the serving engine's decode program (a `fori_loop` over a traced step count; 1 row, 1,024 slots).
"""


def graph_section(rows: list[Row], jax_version: str, argv: list[str], findings: str = "") -> str:
    lines = [GRAPH_SECTION, "",
             *_header(jax_version, argv, "targets kernels/h200.txtpb, kernels/h100.txtpb"),
             ("- program: the full-size decode loop (real 35B-A3B config, bf16 activations), batch 1, 512-token "
             "context; every number per decode step (one iteration of the decode loop)"),
             (f"- gate (`--gate`, CI): {GATE_RECIPE}, generate, the default mode and `graphs`, CUDA 13.0.0, both "
             f"chips; limits (H200) {dataclasses.asdict(GATE[('h200', 'xla')])}, `graphs` "
             f"{dataclasses.asdict(GATE[('h200', 'graphs')])}; the issue's target "
             f"{dataclasses.asdict(ISSUE_TARGET)}"),
             "", ("| chip | CUDA | recipe | program | mode | compile s | launches | Pallas | Pallas programs | idle | "
             "graphs | host ops | syncs (layer) | layer ops | decode loop | outside graphs |"),
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.target} | {r.cuda} | {r.recipe} | {r.program} | {r.mode} | failed: {r.error[:150]} |"
                         + " |" * 10)
            continue
        s = r.step
        loop = ("in a graph" if s.step_loop_in_graph else
                f"host, {'×' + str(s.step_trip_count) if s.step_trip_count else 'trip count unknown'}")
        outside = ", ".join(f"{k.removeprefix('k')} {v}" for k, v in s.outside_graphs.items()) or "—"
        lines.append(f"| {r.target} | {r.cuda} | {r.recipe} | {r.program} | {r.mode} | {r.seconds:.1f} | "
                     f"{s.total_launches:,} | {s.launches.get('pallas', 0)} | {s.pallas_programs:,} | "
                     f"{s.idle_programs:,} | {s.graphs} | {s.host_ops} | {s.host_syncs} ({s.host_syncs_per_layer:g}) | "
                     f"{s.layer_host_ops} | {loop} | {outside} |")
    lines += ["", GRAPH_NOTES.rstrip()]
    if findings:
        lines += ["", findings.rstrip()]
    return "\n".join(lines) + "\n"


GRAPH_FINDINGS = """Reading it (deviceless facts, jax 0.11.2; each from a dump of `xla_dump_to`; 2026-12-07):
- Trip counts: the layer scan has one (`known_trip_count` n=10 in the optimised HLO's `while` backend config). The
  token loops do not: qjax.generate's decode `while_loop` (step count an argument, EOS test) and the serving
  engine's `fori_loop(0, steps)` over a traced `steps` have no `known_trip_count`, so their `WhileThunk` copies the
  predicate to the host and waits every step (1 round trip per step), and the generate loop's `lax.cond` (the last
  token's forward skipped) is a `ConditionalThunk` on the host: a second one (2 per step in `xla` mode). The old
  `decode_program` passed the step count as a constant and so compiled a loop of known trip count 65 that
  qjax.generate never runs; it now takes it as an argument.
- XLA's default command kinds on jax 0.11.2 (the dumped module config): FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN,
  CONDITIONAL, DYNAMIC_SLICE_FUSION; `xla_gpu_graph_min_graph_size` 5; `xla_gpu_command_buffer_unroll_loops` false;
  `xla_gpu_command_buffer_update_mode` ALWAYS_UPDATE. WHILE is opt-in.
- Pallas kernels are captured: Pallas-Triton calls (`__gpu$xla.gpu.triton`, api_version TYPED_FFI on 0.11.2) become
  `kCustomKernel` thunks, which XLA puts into graphs as FUSION (e.g. `qmatmul_gemv_int4 grid: [1, 256, 1]` inside
  `kCommandBuffer` in every mode with graphs). `legacy_command_buffer_custom_call_targets` no longer exists
  (`No such compile option`; a reserved field of DebugOptions): no workaround is needed.
- compiler_options take whole values: `xla_gpu_enable_command_buffer="+WHILE,+CONDITIONAL"` is refused (`'+WHILE' is
  not a valid enum value`); the list must be spelled out (qjax/runtime/xla_options.py).
- What breaks capture: the full-attention layer's K and V cache slices (`bf16[10,1,2,640,256]` → `[1,…]`, dynamic
  slices of the [G, …] cache stack at the layer index) become `kDynamicSliceFusion` copies wrapped in
  `kAsyncStart` / `kAsyncDone` (XLA pass `dynamic-slice-copy-fusion-async-wrapper`; its only switch,
  `xla_gpu_experimental_dynamic_slice_fusion_verify_offsets`, adds host-checked offsets). With the target files'
  CUDA 12.8 a dynamic-slice copy cannot go into a graph (XLA wants CUDA ≥ 12.9 for it, and the same program with
  the versions set to 13.0 captures them): 32 graphs and 190 host ops per step; WHILE captures no loop there
  (`graphs` only cuts the ungraphed kernels into more, smaller graphs: 54 graphs, 137 host ops). With CUDA 13 (the
  lent image) the copies are captured: `xla` 12 graphs per step
  (one per layer iteration), `graphs` one per step, but the decode loop itself stays on the host even so — XLA
  refuses a WHILE command whose body holds a loop-dependent dynamic-slice copy unless it unrolls that loop, which
  it cannot for a loop of unknown trip count (log: "WhileThunk is not convertible to command buffers because its
  body contains loop-dependent DynamicSliceFusionV2Thunk"). `unrolled` (the layer loop unrolled in the HLO: static
  slice offsets) lets the whole decode loop into one graph: 0 host ops, 0 round trips per step, both chips.
  Without unrolling the same happens when nothing reads the cache by a bare slice: mxfp8-experts (its FP8 KV cache
  is dequantized by an ordinary fusion, which reads the layer inside the stack) compiles in `graphs` mode to the
  whole decode loop in one graph — 0 host ops, 0 round trips per step, H200, 34 s of compile against 31–62 s
  unrolled (`--recipes mxfp8-experts --graph-recipes mxfp8-experts --modes graphs,off --targets h200`, 2026-12-07).
  The decode-attention kernels that now read the BF16 K/V layer in place (the layer offset in the pointer, as the
  other kernels do) give w2w4 the same on the H200: in `graphs` mode the whole decode loop is one graph, 0 host ops
  and 0 round trips per step, no unrolling — checked by the gate (`GATE`'s `graphs` rows). On the H100 one slice is
  left: XLA puts the attention's q_norm into a Triton normalisation fusion there, which cannot take the layer
  scan's slice of the `[10, 256]` q_norm weights inside it, so that slice is an asynchronous copy and the loop stays
  on the host (one graph per step, 3 host ops, 1 round trip).
- Minimum graph size: XLA counts a while loop as one command, so with the default 5 a loop alone is never captured
  (log: "kWhile is not lowered to command buffer because command size is less than the min graph size"); the
  graph modes set 1.
- Idle Pallas programs: at HEAD (8b59882) the stacked-weight GEMVs' grids cover all 10 layers' row blocks behind
  `pl.when(program_id(1) // nb == layer)`: 420,800 programs per w2w4 step, 361,440 of them idle (both chips); the
  one-layer grids in the working tree (the kernel change in progress) launch 59,360, none idle.
- Not settled without the device: whether the device's CUDA stack is ≥ 12.9 as assumed (`run.sh decode` dumps its
  target config), the wall time of each mode, and whether WHILE graphs run correctly (`run.sh decode` checks the
  tokens of every mode against `xla`'s). Deviceless sorts also differ from the device's: XLA lacks CUB's scratch
  sizes without a GPU and compiles a fallback sort (a warning at compile).
- On the device: **waiting for a device.** One call of `bash benchmarks/gpu/run.sh decode` (< 9 min on an H100 or
  H200: kernel correctness, the four modes timed interleaved with their tokens checked and their thunk structure
  dumped on the device, then full-size prefill and decode B=1/8/64 of w2w4 and w8a16-g32 in the fastest mode;
  `$OUT/decode.md` names the chip in every row) decides `DEFAULT_MODE` in qjax/runtime/xla_options.py.
"""


# --------------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------------
def run_gate(targets: list[str], cuda: str) -> int:
    from qjax.runtime.xla_options import decode_mode

    modes = tuple(dict.fromkeys((decode_mode(), *GATE_MODES)))
    print(f"decode gate: {GATE_RECIPE} decode loop (qjax.generate), batch 1, modes {', '.join(modes)}, CUDA {cuda}; "
          "limits = today's values (benchmarks/e2e_aot.py GATE), issue target ≤ 400 launches, 0 idle, 0 round trips",
          flush=True)
    cache: dict = {}
    bad = 0
    for target in targets:
        for mode in modes:
            row = compile_row(Row(target, cuda, GATE_RECIPE, "generate", mode, 1), cache)
            print(_describe(row), flush=True)
            if row.error:
                bad += 1
                continue
            if row.step.unmatched_pallas:
                print(f"  warning: Pallas launches not found in the traced program: {row.step.unmatched_pallas}")
            ok, lines = gate_check(target, row.limits(), mode)
            print("\n".join(lines), flush=True)
            print(f"{target} {mode}: {'OK' if ok else 'FAILED (a number above its limit: see above)'}", flush=True)
            bad += not ok
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="w2w4,w8a16-g32,mxfp8-experts,bf16", help="table 1's recipes")
    p.add_argument("--graph-recipes", default=None,
                   help="table 2's recipes (default: those of --recipes among w2w4, w8a16-g32)")
    p.add_argument("--targets", default="h200,h100", help="table 2's chips (and the gate's)")
    p.add_argument("--modes", default="xla,off,graphs,unrolled", help="table 2's XLA modes (qjax.runtime.xla_options)")
    p.add_argument("--cuda", default=None, help="the targets' CUDA version (default: aot_h200.LENT_CUDA; 'file': "
                                                "the target files' own)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-graphs", action="store_true", help="table 1 only")
    p.add_argument("--no-extra", action="store_true",
                   help="table 2 without its extra rows (the serving program; the targets' own CUDA version)")
    p.add_argument("--gate", action="store_true", help="the CI gate (see the module doc); writes nothing")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    import jax
    from qjax.kernels import aot_h200

    cuda = a.cuda or aot_h200.LENT_CUDA
    targets = [t for t in a.targets.split(",") if t]
    if a.gate:
        return run_gate(targets, cuda)

    cache: dict = {}
    done: dict[tuple, Row] = {}

    def get(target, cuda_, recipe, program, mode) -> Row:
        key = (target, cuda_, recipe, program, mode)
        if key not in done:
            done[key] = compile_row(Row(target, cuda_, recipe, program, mode, a.batch), cache)
            print(_describe(done[key]), flush=True)
        return done[key]

    copies = [get("h200", cuda, r, "generate", "xla") for r in a.recipes.split(",") if r]
    texts = [copies_section(copies, jax.__version__, sys.argv)]
    if not a.no_graphs:
        modes = [m for m in a.modes.split(",") if m]
        recipes = ([r for r in a.graph_recipes.split(",") if r] if a.graph_recipes is not None else
                   [r for r in a.recipes.split(",") if r in ("w2w4", "w8a16-g32")])
        rows = [get(t, cuda, r, "generate", m) for t in targets for r in recipes for m in modes]
        if not a.no_extra and recipes:
            first = targets[0]
            rows += [get(first, cuda, recipes[0], "serve", m) for m in ("xla", "graphs")]
            rows += [get(first, "file", recipes[0], "generate", m) for m in ("xla", "graphs")]
        texts.append(graph_section(rows, jax.__version__, sys.argv, GRAPH_FINDINGS))
    for text in texts:
        print(text)
    if not a.no_write:
        write_section(texts[0], RESULTS, SECTION)
        if len(texts) > 1:
            write_section(texts[1], RESULTS, GRAPH_SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
