"""Deviceless AOT compile of every Pallas kernel variant for an H200 (docs/kernels.md §6, "Level B").

XLA:GPU + its bundled Triton compile each case down to an sm_90a cubin on a machine without a GPU, so
shared-memory / register / resource errors (``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``) fail CI
instead of the first run on the H200.  Run it in the env that ``.ci/aot_h200.sh`` builds (Python ≥ 3.12, jax ==
jaxlib == jax-cuda13-plugin == jax-cuda13-pjrt == 0.11.2, the GPU image's version; no ``nvidia-*`` wheels)::

    JAX_PLATFORMS=cpu python -m qjax.kernels.aot_h200                 # every case; exit 1 if any fails
    JAX_PLATFORMS=cpu python -m qjax.kernels.aot_h200 --filter moe    # names containing "moe"
    JAX_PLATFORMS=cpu python -m qjax.kernels.aot_h200 --list          # names only (no compile, no CUDA plugin)
    JAX_PLATFORMS=cpu python -m qjax.kernels.aot_h200 --self-test     # proves the check can fail (see below)

Cases come from ``lowering_cases() -> list[tuple[name, fn, arg_specs]]`` in each module of :data:`KERNEL_MODULES`
(a module that does not exist yet is skipped with a message; one that exists must import, export
``lowering_cases`` and return ≥ 1 case, and every case must compile).  ``fn`` is called as ``fn(*arg_specs)``
under ``jax.jit``; ``arg_specs`` is a sequence (pytrees allowed) of ``jax.ShapeDtypeStruct``-likes, which are
re-made here with a replicated sharding on the compile-only H200.  Keep kernel tiling/static parameters closed
over in ``fn``.  During tracing the default device is the compile-only H200 and the abstract mesh carries it, so
``jax.experimental.pallas.triton.get_gpu_info()`` reports an H200; ``QJAX_KERNELS`` defaults to ``pallas`` so
calls through :mod:`qjax.kernels.ops` dispatch to the Pallas path (``jax.default_backend()`` is still ``cpu``).

Per case one line: ``name  seconds  smem=<max dynamic shared memory of the compiled kernels> …  OK|FAIL: error``.
The shared-memory figure is read from XLA's thunk dump (``xla_dump_to`` per compile), the rest from
``compiled.memory_analysis()``; both are best-effort and never fail a case.

``--self-test`` compiles the small Pallas-Triton int4 dequant matmul below (docs/kernels.md §5 layout, explicit
``plgpu.CompilerParams``) in two good tilings, which must compile, and one oversized tiling (bm 256 / bn 512 /
bk 1024, 4 stages), which must fail with ``RESOURCE_EXHAUSTED`` shared memory.

The target is ``h200.txtpb`` next to this file (``--target h200``, the default), a
``stream_executor.GpuTargetConfigProto`` text proto taken verbatim from the jax-cuda13-pjrt 0.12.0.1 wheel (the
0.11.2 plugin embeds none but accepts that file): ``python -m qjax.kernels.aot_h200 --extract-target-config
jax_cuda13_pjrt-0.12.0.1-….whl > kernels/h200.txtpb`` regenerates it (see :func:`extract_target_config`);
``--target h100`` takes ``h100.txtpb``, derived from it (its header says which fields differ).

What a compiled decode step runs (``benchmarks/e2e_aot.py``'s decode gate reads it through these functions):
:func:`step_structure` / :func:`dump_structure` read XLA's thunk dump — device launches per step, CUDA graphs
(command buffers) and what stays outside them, host round trips (a while loop without a known trip count, or a
conditional, outside a graph copies its predicate to the host every time) — and :func:`pallas_calls` reads each
``pallas_call`` of the traced program: its grid and the programs of it that can do work (a layer guard's other
programs exit at once: idle).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

KERNEL_MODULES = ("qjax.kernels.qmatmul_pallas", "qjax.kernels.moe_pallas", "qjax.kernels.gdn_pallas",
                  "qjax.kernels.attention_pallas", "qjax.runtime.bench")
TARGETS = {"h200": Path(__file__).with_name("h200.txtpb"), "h100": Path(__file__).with_name("h100.txtpb")}
TARGET_CONFIG = TARGETS["h200"]
# The CUDA stack of the lent GPU image (jax 0.11.2 + jax-cuda13-plugin: CUDA 13 runtime and toolkit, a CUDA 13
# driver). The target files carry XLA's own test machine's (runtime / toolkit 12.8), and XLA:GPU's command-buffer
# pass decides by them: below CUDA 12.9 it leaves dynamic-slice copies out of CUDA graphs, which splits a decode
# step into several graphs that the device would run as one. make_target(cuda=LENT_CUDA) compiles as for the image.
LENT_CUDA = "13.0.0"
PLUGIN_SO = "jax_plugins/xla_cuda13/xla_cuda_plugin.so"  # inside the jax-cuda13-pjrt wheel
_SMEM_ERROR = re.compile(r"RESOURCE_EXHAUSTED.*[Ss]hared memory", re.DOTALL)
_THUNK = re.compile(r"(\S+) grid: \[[^\]]*\] threads: \[[^\]]*\]\s+shared_memory: (\d+) bytes")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any] | None
    arg_specs: Sequence[Any]
    expect_fail: str | None = None  # regex the failure must match (self-test only)
    broken: str | None = None  # a problem found while collecting: reported as FAIL without compiling


# --------------------------------------------------------------------------------------------------------------------
# Self-test kernel: int4/int2 dequant matmul, out = x @ dequant(W)ᵀ (repo layout, kernels/qmatmul_reference.py):
#   x [M, K] bf16; packed [N, K·bits/32] int32, LSB-first, stored value q + 2^(bits−1); scales [N, K/group] bf16.
# --------------------------------------------------------------------------------------------------------------------
def _selftest_kernel(x_ref, w_ref, s_ref, o_ref, *, bits: int, group: int, bk: int):
    bm, k = x_ref.shape
    bn = w_ref.shape[0]
    pack = 32 // bits
    wpc, gpc = bk // pack, bk // group  # packed words / scale groups per K chunk
    shifts = lax.broadcasted_iota(jnp.int32, (bn, wpc, pack), 2) * bits

    def body(c, acc):
        x = x_ref[:, pl.ds(c * bk, bk)]
        w = w_ref[:, pl.ds(c * wpc, wpc)]
        s = s_ref[:, pl.ds(c * gpc, gpc)]
        q = ((w[:, :, None] >> shifts) & ((1 << bits) - 1)) - (1 << (bits - 1))
        q = q.reshape(bn, gpc, group).astype(jnp.float32) * s.astype(jnp.float32)[:, :, None]
        wd = q.reshape(bn, bk).astype(x.dtype)
        return acc + lax.dot_general(x, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def selftest_qmatmul(x, packed, scales, *, bits: int = 4, group: int = 128, bm: int = 16, bn: int = 128,
                     bk: int = 256, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """``x [M, K] @ dequant(packed, scales)ᵀ`` → ``[M, N]`` in x's dtype (all tile sizes powers of two)."""
    m, k = x.shape
    n = packed.shape[0]
    assert m % bm == 0 and n % bn == 0 and k % bk == 0 and bk % group == 0, (x.shape, packed.shape, bm, bn, bk)
    return pl.pallas_call(
        functools.partial(_selftest_kernel, bits=bits, group=group, bk=bk),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, packed.shape[1]), lambda i, j: (j, 0)),
                  pl.BlockSpec((bn, scales.shape[1]), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(x, packed, scales)


def _selftest_specs(m: int, n: int, k: int, bits: int, group: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k * bits // 32), jnp.int32),
            jax.ShapeDtypeStruct((n, k // group), jnp.bfloat16)]


def selftest_cases() -> list[Case]:
    def case(m, n, k, bits, group, bm, bn, bk, warps, stages, expect_fail=None):
        name = f"selftest/int{bits}_g{group}_m{m}n{n}k{k}_bm{bm}bn{bn}bk{bk}_w{warps}s{stages}"
        fn = functools.partial(selftest_qmatmul, bits=bits, group=group, bm=bm, bn=bn, bk=bk, num_warps=warps,
                               num_stages=stages)
        return Case(name, fn, _selftest_specs(m, n, k, bits, group), expect_fail)

    return [
        case(16, 512, 1024, 4, 128, 16, 128, 256, 4, 3),
        case(64, 4096, 4096, 4, 128, 64, 128, 256, 8, 3),
        # 4 stages of a [256, 1024] bf16 x tile + [512, 1024] weights ≫ 232,448 B opt-in shared memory per block
        case(256, 512, 1024, 4, 128, 256, 512, 1024, 4, 4, expect_fail=_SMEM_ERROR.pattern),
    ]


# --------------------------------------------------------------------------------------------------------------------
# Target config
# --------------------------------------------------------------------------------------------------------------------
def extract_target_config(path: str | os.PathLike, device: str = "NVIDIA H200") -> str:
    """The ``GpuTargetConfigProto`` text block for ``device`` embedded in XLA's CUDA plugin.

    ``path``: the jax-cuda13-pjrt wheel (0.12.x; 0.11.x embeds none) or its ``xla_cuda_plugin.so``.  The .so holds
    NUL-terminated text protos (OpenXLA's license comment, then ``gpu_device_info { … }``, ``platform_name``,
    ``device_description_str``); the block whose ``device_description_str`` starts with ``device`` and is not a
    MIG slice is returned verbatim.
    """
    path = Path(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            data = z.read(PLUGIN_SO)
    else:
        data = path.read_bytes()
    found: list[str] = []
    pos = 0
    while (hit := data.find(b"gpu_device_info {", pos)) >= 0:
        start, end = data.rfind(b"\0", 0, hit) + 1, data.find(b"\0", hit)
        end = len(data) if end < 0 else end
        block = data[start:end].decode()
        pos = end
        m = re.search(r'^device_description_str: "([^"]*)"', block, re.MULTILINE)
        desc = m.group(1) if m else ""
        found.append(desc)
        if desc.startswith(device) and "MIG" not in desc:
            return block if block.endswith("\n") else block + "\n"
    raise ValueError(f"no {device!r} target config in {path} (found: {found})")


def _extract_main(path: str) -> int:
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    block = extract_target_config(path)
    sys.stdout.write(
        "# H200 target for deviceless XLA:GPU compiles (stream_executor.GpuTargetConfigProto, text format); used by\n"
        "# kernels/aot_h200.py. Verbatim block with device_description_str \"NVIDIA H200 …\" from\n"
        f"# {Path(path).name} (sha256 {digest}),\n"
        f"# {PLUGIN_SO}. Regenerate: pip download --no-deps -d DIR jax-cuda13-pjrt==0.12.0.1 &&\n"
        "#   python -m qjax.kernels.aot_h200 --extract-target-config DIR/jax_cuda13_pjrt-*.whl > kernels/h200.txtpb\n"
        + block)
    return 0


@dataclasses.dataclass
class Target:
    device: Any
    mesh: jax.sharding.Mesh
    replicated: jax.sharding.NamedSharding


def target_config(config: str | os.PathLike = TARGET_CONFIG, cuda: str | None = None) -> str:
    """The ``GpuTargetConfigProto`` text of a target: a name of :data:`TARGETS` (``"h100"``, ``"h200"``) or a file;
    with ``cuda`` (e.g. :data:`LENT_CUDA`), its driver, runtime and compile-time toolkit versions set to that."""
    text = Path(TARGETS.get(str(config), config)).read_text()
    if cuda is not None:
        for field in ("driver_version", "runtime_version", "compile_time_toolkit_version"):
            text, n = re.subn(rf'^(\s*{field}: )"[^"]*"', rf'\g<1>"{cuda}"', text, flags=re.MULTILINE)
            if n != 1:
                raise ValueError(f"{config}: want one {field}, found {n}")
    return text


def make_target(config: str | os.PathLike = TARGET_CONFIG, *, cuda: str | None = None) -> Target:
    """Compile-only GPU device (no GPU needed) from a ``GpuTargetConfigProto``: a name of :data:`TARGETS` or a
    text file (default: the H200); ``cuda``: see :func:`target_config`."""
    from jax._src import xla_bridge  # private JAX: loaded only by the command that needs it

    topo = xla_bridge.make_pjrt_topology("cuda", "1x1x1", topology="1x1x1", target_config=target_config(config, cuda))
    devices = topo._make_compile_only_devices()
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    return Target(devices[0], mesh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


# --------------------------------------------------------------------------------------------------------------------
# Cases and compile
# --------------------------------------------------------------------------------------------------------------------
def collect_cases(modules: Sequence[str] = KERNEL_MODULES, log=print) -> list[Case]:
    cases: list[Case] = []
    for mod in modules:
        short = mod.rsplit(".", 1)[-1]
        try:
            spec = importlib.util.find_spec(mod)
        except ImportError as e:  # the parent package itself failed to import
            cases.append(Case(f"{short}/<import>", None, (), broken=f"{type(e).__name__}: {e}"))
            continue
        if spec is None:
            log(f"skip  {mod}: module does not exist yet")
            continue
        try:
            got = list(importlib.import_module(mod).lowering_cases())
        except Exception as e:  # noqa: BLE001 - reported as a failed case
            where = "<import>" if mod not in sys.modules else "<lowering_cases>"
            cases.append(Case(f"{short}/{where}", None, (), broken=_err(e)))
            continue
        if not got:
            cases.append(Case(f"{short}/<lowering_cases>", None, (), broken="lowering_cases() returned no cases"))
        for i, item in enumerate(got):
            try:
                name, fn, arg_specs = item
                assert isinstance(name, str) and callable(fn), "want (str name, callable fn, arg_specs)"
                cases.append(Case(f"{short}/{name}", fn, tuple(arg_specs)))
            except Exception as e:  # noqa: BLE001 - reported as a failed case
                cases.append(Case(f"{short}/<case {i}>", None, (), broken=f"malformed case {item!r:.200}: {e}"))
    names = [c.name for c in cases]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        cases.append(Case("<duplicate names>", None, (), broken=", ".join(dups)))
    return cases


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _one_line(msg: str, limit: int = 400) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"


def _kib(b: int) -> str:
    return f"{b / 1024:.0f}KiB" if b >= 1024 else f"{b}B"


def _thunk_sequences(dump: Path) -> list[Path]:
    """The thunk sequences XLA dumped, one per module: the one after its thunk passes where a pass ran (command
    buffers), else the plain one."""
    return sorted(dump.glob("*thunk_sequence_after_thunk_passes.txt")) or sorted(dump.glob("*thunk_sequence.txt"))


def _smem_from_dump(dump: Path) -> str:
    kernels = [(int(s), n) for f in _thunk_sequences(dump) for n, s in _THUNK.findall(f.read_text())]
    if not kernels:
        return "smem=?"
    smem, name = max(kernels)
    return f"smem={smem}B({name}; {len(kernels)} kernels)"


# --------------------------------------------------------------------------------------------------------------------
# What a compiled decode step runs: XLA:GPU's thunk dump (launches, CUDA graphs, host round trips) and the Pallas
# calls' grids (programs that exit at once)
# --------------------------------------------------------------------------------------------------------------------
_THUNK_LINE = re.compile(r"(\d+): (k\w+)\s+\[[^\]]*\]\s*(\S*)")
_THUNK_GRID = re.compile(r"grid: \[(\d+), (\d+), (\d+)\]")
_THUNK_CONTAINERS = {"kDynamicSliceFusion", "kSequential"}  # run their children; nothing of their own
_THUNK_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams"}  # host-side stream bookkeeping, no device launch
PALLAS_PREFIXES = ("qmatmul_", "qjax_")  # qjax's Pallas kernel names (pallas_call(name=…)), when no jaxpr is at hand


@dataclasses.dataclass
class _ThunkNode:
    kind: str  # a thunk kind, or a section ("body", "condition", "true_branch", "branch_0", …)
    id: int = -1
    name: str = ""
    grid: tuple[int, int, int] | None = None  # a kernel's launch grid (blocks)
    children: list = dataclasses.field(default_factory=list)


def _thunk_tree(text: str) -> list[_ThunkNode]:
    """XLA:GPU's ``*thunk_sequence_after_thunk_passes.txt`` dump as a tree, by indentation (a ``condition:`` header
    is printed in column 0: it belongs to the ``kWhile`` just above)."""
    roots: list[_ThunkNode] = []
    stack: list[tuple[int, _ThunkNode]] = []
    last_while = 0
    for line in text.splitlines():
        body = line.strip()
        if not body:
            continue
        indent = len(line) - len(line.lstrip())
        m = _THUNK_LINE.match(body)
        if m is None and not body.endswith(":"):
            continue
        if body == "condition:":
            indent = last_while + 2
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if m is None:
            node = _ThunkNode(body[:-1])
        else:
            g = _THUNK_GRID.search(body)
            node = _ThunkNode(m.group(2), int(m.group(1)), m.group(3),
                              tuple(int(x) for x in g.groups()) if g else None)
        if node.kind == "kWhile":
            last_while = indent
        (stack[-1][1].children if stack else roots).append(node)
        stack.append((indent, node))
    return roots


def _base_name(thunk_name: str) -> str:
    """A kernel's name as the program named it: XLA appends ``__1``, ``__2`` … to repeated kernel names."""
    return re.sub(r"__\d+$", "", thunk_name)


def _trip_counts(metadata: str, hlo: str) -> tuple[dict[int, str], dict[str, int]]:
    """(thunk id → HLO instruction, while instruction → its ``known_trip_count``)."""
    names = {int(i): a for a, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata)}
    trips = {m.group(1): int(m.group(2)) for m in
             re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]* while\([^\n]*"known_trip_count":\{"n":"(\d+)"', hlo,
                         re.MULTILINE)}
    return names, trips


@dataclasses.dataclass
class StepStructure:
    """What one iteration of a program's outermost while loop (a decode step) runs, from XLA:GPU's thunk dump.

    Host round trips (``host_syncs``): XLA's ``WhileThunk`` of a loop without a known trip count copies its
    predicate to the host and waits for the stream on every iteration, and a ``ConditionalThunk`` does the same for
    its branch index on every execution — unless the loop / conditional sits inside a command buffer (a CUDA graph:
    the predicate is evaluated on the device). ``host_ops``: what the host issues per step — one per CUDA-graph
    launch, per thunk outside a graph (kernels, copies, async starts / dones) and per loop iteration or branch that
    the host drives; one graph per step is 1, a decode loop captured whole is 0.
    """

    launches: dict[str, int]  # device launches per step (kernels and copies), by kind: pallas / xla / copy
    pallas_programs: int = 0  # grid programs of the Pallas launches
    idle_programs: int = 0  # of which exit at once (counted where the Pallas calls' work is given)
    unmatched_pallas: tuple[str, ...] = ()  # Pallas launches whose grid no given Pallas call has
    host_syncs: int = 0  # predicate copies to the host + host waits per step
    host_syncs_in_layers: int = 0  # of which inside the layer loop (all its iterations)
    host_ops: int = 0
    graphs: int = 0  # CUDA-graph launches per step
    pallas_outside_graphs: int = 0  # Pallas launches per step that are not inside a CUDA graph
    outside_graphs: dict[str, int] = dataclasses.field(default_factory=dict)  # thunk kinds the host runs per step
    step_trip_count: int | None = None  # the decode loop's known trip count (None: unknown, decided on the device)
    step_loop_in_graph: bool = False  # the decode loop itself runs inside a CUDA graph
    layer_trip_count: int | None = None  # the layer loop's (the loops nested one level inside the step)
    layer_host_ops: int = 0  # host_ops per layer-loop iteration (0: the layer loop runs inside a graph)

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def host_syncs_per_layer(self) -> float:
        return self.host_syncs_in_layers / self.layer_trip_count if self.layer_trip_count else 0.0


class _Acc(dict):
    """Counters of one execution of a thunk sequence (``launch:pallas``, ``host_ops``, ``outside:kCopy``, …)."""

    def add(self, other: dict, times: int = 1) -> None:
        for k, v in other.items():
            self[k] = self.get(k, 0) + v * times

    def bump(self, key: str, n: int = 1) -> None:
        self[key] = self.get(key, 0) + n

    def launches(self) -> int:
        return sum(v for k, v in self.items() if k.startswith("launch:"))


def step_structure(thunks: str, metadata: str, hlo: str,
                   work: dict[tuple[str, tuple[int, int, int]], int] | None = None,
                   pallas_names: set[str] | frozenset[str] = frozenset()) -> StepStructure:
    """:class:`StepStructure` of the outermost while loop in an XLA:GPU dump (``xla_dump_to``): ``thunks`` =
    ``*thunk_sequence_after_thunk_passes.txt`` (or the plain one when no thunk pass changed anything), ``metadata``
    = ``*thunk_metadata.txt`` (thunk id → HLO instruction), ``hlo`` = the optimised HLO (each nested while's
    ``known_trip_count``). ``work``: the programs that do work per Pallas kernel launch, by ``(name, launch grid)``
    (:func:`pallas_work`); ``pallas_names``: the Pallas kernels' names (else :data:`PALLAS_PREFIXES` tell them).

    Launches count what a CUDA graph replays one after another: nested loops × their trip counts, a conditional's
    costliest branch (in a decode loop the step rather than the finished-rows copy); kinds ``pallas`` (qjax's
    kernels), ``copy`` (device copies), ``xla`` (every other kernel: fusions, cuBLAS / Triton GEMMs, sorts). A nested
    loop without a known trip count raises: its cost per step is unknown.
    """
    names, trips = _trip_counts(metadata, hlo)
    work = work or {}
    unmatched: set[str] = set()

    def is_pallas(name: str) -> bool:
        return _base_name(name) in pallas_names or name.startswith(PALLAS_PREFIXES)

    def walk(nodes, in_graph: bool, depth: int, layer: dict) -> _Acc:
        acc = _Acc()
        for node in nodes:
            kind = node.kind
            if not kind.startswith("k"):  # a section: condition / body / branch
                acc.add(walk(node.children, in_graph, depth, layer))
            elif kind == "kWhile":
                name = names.get(node.id)
                if name not in trips:
                    raise ValueError(f"while thunk {node.id} ({name}) has no known trip count in the HLO")
                trip = trips[name]
                one = walk(node.children, in_graph, depth + 1, layer)
                if not in_graph:
                    one.bump("host_ops")  # the host drives each iteration
                if depth == 0:  # a loop directly inside the step: the layer loop
                    layer["trip"] = layer.get("trip", 0) + trip
                    layer["host_ops"] = layer.get("host_ops", 0) + one.get("host_ops", 0)
                    acc.bump("layer_syncs", one.get("syncs", 0) * trip)
                acc.add(one, trip)
            elif kind == "kConditional":
                branches = [walk(b.children, in_graph, depth, layer) for b in node.children]
                acc.add(max(branches, key=_Acc.launches, default=_Acc()))
                if not in_graph:
                    acc.bump("host_ops")
                    acc.bump("syncs")  # ConditionalThunk copies its branch index to the host and waits
                    acc.bump("outside:kConditional")
            elif kind == "kCommandBuffer":
                acc.add(walk(node.children, True, depth, layer))
                if not in_graph:
                    acc.bump("host_ops")
                    acc.bump("graphs")
            elif kind in _THUNK_CONTAINERS or kind == "kAsyncStart":
                acc.add(walk(node.children, in_graph, depth, layer))
                if not in_graph:
                    acc.bump(f"outside:{kind}")
                    acc.bump("host_ops", kind == "kAsyncStart")
            elif kind in _THUNK_NO_LAUNCH:
                if not in_graph:
                    acc.bump("host_ops")
                    acc.bump(f"outside:{kind}")
            else:
                pallas = is_pallas(node.name)
                acc.bump("launch:" + ("pallas" if pallas else "copy" if kind == "kCopy" else "xla"))
                if pallas and node.grid is not None:
                    programs = node.grid[0] * node.grid[1] * node.grid[2]
                    acc.bump("programs", programs)
                    busy = work.get((_base_name(node.name), node.grid))
                    if busy is None:
                        unmatched.add(f"{_base_name(node.name)}{list(node.grid)}")
                    else:
                        acc.bump("idle", programs - busy)
                if not in_graph:
                    acc.bump("host_ops")
                    acc.bump(f"outside:{kind}")
                    acc.bump("pallas_outside", pallas)
        return acc

    def outermost(nodes, in_graph=False):
        for node in nodes:
            if node.kind == "kWhile":
                return node, in_graph
            found = outermost(node.children, in_graph or node.kind == "kCommandBuffer")
            if found:
                return found
        return None

    found = outermost(_thunk_tree(thunks))
    if found is None:
        raise ValueError("no while loop in the thunk sequence")
    loop, loop_in_graph = found
    layer: dict = {}
    acc = walk(loop.children, loop_in_graph, 0, layer)
    trip = trips.get(names.get(loop.id))
    if not loop_in_graph:
        acc.bump("host_ops")  # the step itself: one host-driven iteration of the decode loop
        if trip is None:
            acc.bump("syncs")  # WhileThunk: the predicate to the host, every step
            acc.bump("outside:kWhile")
    return StepStructure(
        launches={k[len("launch:"):]: v for k, v in sorted(acc.items()) if k.startswith("launch:")},
        pallas_programs=acc.get("programs", 0), idle_programs=acc.get("idle", 0),
        unmatched_pallas=tuple(sorted(unmatched)), host_syncs=acc.get("syncs", 0),
        host_syncs_in_layers=acc.get("layer_syncs", 0), host_ops=acc.get("host_ops", 0), graphs=acc.get("graphs", 0),
        pallas_outside_graphs=acc.get("pallas_outside", 0),
        outside_graphs={k[len("outside:"):]: v for k, v in sorted(acc.items()) if k.startswith("outside:")},
        step_trip_count=trip, step_loop_in_graph=loop_in_graph, layer_trip_count=layer.get("trip"),
        layer_host_ops=layer.get("host_ops", 0))


def loop_launches(thunks: str, metadata: str, hlo: str) -> dict[str, int]:
    """Device launches (kernels and copies) per iteration of the program's outermost while loop, by kind
    (:func:`step_structure`'s ``launches``). At batch-1 decode their fixed cost per launch, not bytes, can set the
    time."""
    return step_structure(thunks, metadata, hlo).launches


def dump_files(dump: str | Path) -> tuple[str, str, str]:
    """(thunk sequence, thunk metadata, optimised HLO) of the one module dumped into ``dump``."""
    dump = Path(dump)

    def one(what, files):
        if len(files) != 1:
            raise ValueError(f"{dump}: want one {what}, found {len(files)}")
        return files[0].read_text()
    return (one("thunk sequence", _thunk_sequences(dump)),
            one("thunk metadata", sorted(dump.glob("*thunk_metadata.txt"))),
            one("optimised HLO", sorted(dump.glob("*gpu_after_optimizations.txt"))))


def dump_launches(dump: str | Path) -> dict[str, int]:
    """:func:`loop_launches` of the one module dumped into ``dump``."""
    return loop_launches(*dump_files(dump))


def dump_structure(dump: str | Path, calls: Sequence[PallasCall] = ()) -> StepStructure:
    """:func:`step_structure` of the one module dumped into ``dump``, idle programs counted from ``calls``."""
    return step_structure(*dump_files(dump), work=pallas_work(calls), pallas_names={c.name for c in calls})


@dataclasses.dataclass(frozen=True)
class PallasCall:
    """One ``pallas_call`` of a traced program: its grid and how many of the grid's programs can do work.

    A program does no work (exits at once) when the kernel's top level is a guard — a ``cond`` (``pl.when``) with an
    empty branch and nothing written outside it — that selects the empty branch for it, with every scalar the guard
    reads from a ref taken as 0 (a stacked-weight kernel's ``pl.when(program_id(1) // nb == layer)``: the programs of
    the other layers' row blocks), or when its output block is one another program of the grid writes (a grid wider
    than its blocked outputs). Data-dependent guards (an MoE block with no expert) count as working."""

    name: str
    grid: tuple[int, ...]
    work: int
    why: str = ""

    @property
    def programs(self) -> int:
        return int(np.prod(self.grid, dtype=np.int64))

    @property
    def launch_grid(self) -> tuple[int, int, int]:
        """The CUDA grid XLA launches (Pallas-Triton puts grid axis i on CUDA axis i, up to three axes)."""
        g = tuple(self.grid)
        return (g + (1, 1, 1))[:3] if len(g) <= 3 else (int(np.prod(g[:-2])), g[-2], g[-1])


def _sub_jaxprs(params: dict):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jex_core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex_core.Jaxpr):
                yield x


def _pallas_eqns(jaxpr, out: list) -> list:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn)
        else:
            for sub in _sub_jaxprs(eqn.params):
                _pallas_eqns(sub, out)
    return out


def _is_ref(v) -> bool:
    return hasattr(getattr(v, "aval", None), "inner_aval")


def _writes(eqn) -> bool:
    return any(type(e).__name__ in ("WriteEffect", "AccumEffect") for e in eqn.effects)


def _eval_over_grid(eqns, wanted, grid: tuple[int, ...]) -> list[np.ndarray]:
    """The values of ``wanted`` (vars of a kernel's top level) for every program of ``grid``, computed from the
    kernel's top-level ``eqns``: ``program_id`` / ``num_programs`` from the grid, every read of a ref as 0."""
    need, live = [], set(wanted)
    for eqn in reversed(eqns):  # the backward slice of `wanted`
        if any(v in live for v in eqn.outvars):
            need.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    need.reverse()

    def one(*pid):
        env = {}
        for eqn in need:
            prim = eqn.primitive
            if prim.name == "program_id":
                outs = [pid[eqn.params["axis"]]]
            elif prim.name == "num_programs":
                outs = [jnp.int32(grid[eqn.params["axis"]])]
            elif any(_is_ref(v) for v in eqn.invars):  # a ref read: the runtime value (a layer, an expert) as 0
                outs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            else:
                args = [v.val if isinstance(v, jex_core.Literal) else env[v] for v in eqn.invars]
                outs = prim.bind(*args, **eqn.params)
                outs = outs if prim.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [v.val if isinstance(v, jex_core.Literal) else env[v] for v in wanted]

    ids = [a.ravel() for a in np.meshgrid(*[np.arange(n, dtype=np.int32) for n in grid], indexing="ij")]
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return [np.broadcast_to(np.asarray(x), ids[0].shape) for x in jax.vmap(one)(*map(jnp.asarray, ids))]


def _guard_work(kernel, grid) -> tuple[int, str] | None:
    """Programs past the kernel's top-level guard (see :class:`PallasCall`), or None without such a guard."""
    eqns = kernel.eqns
    conds = [e for e in eqns if e.primitive.name == "cond"
             and any(not b.jaxpr.eqns for b in e.params["branches"])]
    if len(conds) != 1 or any(_writes(e) for e in eqns if e is not conds[0]):
        return None
    cond = conds[0]
    branches = cond.params["branches"]
    (index,) = _eval_over_grid(eqns, [cond.invars[0]], grid)
    chosen = np.clip(index.astype(np.int64), 0, len(branches) - 1)
    empty = [i for i, b in enumerate(branches) if not b.jaxpr.eqns]
    return int(np.sum(~np.isin(chosen, empty))), "guard (pl.when with an empty branch)"


def _block_sizes(bm) -> tuple[int, ...]:
    """A block mapping's block shape as ints (``Blocked(n)`` → n; squeezed / ``None`` dims → 1)."""
    sizes = []
    for b in bm.block_shape:
        b = getattr(b, "block_size", b)
        sizes.append(b if isinstance(b, (int, np.integer)) else 1)
    return tuple(sizes)


def _block_index(index_map, *grid_index):
    return tuple(index_map(*grid_index))


def _output_work(gm, grid) -> tuple[int, str] | None:
    """Distinct output blocks the grid writes (each at most one program's work), or None when no output is blocked
    (the kernel stores by index into whole arrays)."""
    best = None
    ids = [jnp.asarray(a.ravel()) for a in
           np.meshgrid(*[np.arange(n, dtype=np.int32) for n in grid], indexing="ij")]
    for bm in gm.block_mappings[gm.num_inputs:gm.num_inputs + gm.num_outputs]:
        shape = tuple(bm.array_aval.shape)
        sizes = _block_sizes(bm)
        if len(sizes) != len(shape) or all(s >= d for s, d in zip(sizes, shape)):
            continue
        if len(bm.index_map_jaxpr.jaxpr.invars) != len(grid):
            continue
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            idx = jax.vmap(functools.partial(_block_index, jex_core.jaxpr_as_fun(bm.index_map_jaxpr)))(*ids)
        blocks = np.stack([np.broadcast_to(np.asarray(x), ids[0].shape) for x in idx], axis=1)
        n = len(np.unique(blocks, axis=0))
        best = n if best is None else max(best, n)
    return None if best is None else (best, "shared output blocks")


def pallas_calls(jaxpr) -> list[PallasCall]:
    """Every ``pallas_call`` in a traced program (``jax.jit(f).trace(…).jaxpr``, nested jaxprs included), with the
    programs of its grid that can do work (:class:`PallasCall`)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out, seen = [], {}
    for eqn in _pallas_eqns(jaxpr, []):
        gm = eqn.params["grid_mapping"]
        grid = tuple(gm.grid)
        name = str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "pallas_call"))
        if not all(isinstance(n, (int, np.integer)) for n in grid):
            continue  # a dynamic grid: not counted
        key = (name, grid, id(eqn.params["jaxpr"]), id(gm))
        if key not in seen:
            programs = int(np.prod(grid, dtype=np.int64))
            work, why, notes = programs, "", []
            for what, probe, arg in (("guard", _guard_work, eqn.params["jaxpr"]), ("output blocks", _output_work, gm)):
                try:
                    got = probe(arg, grid)
                except Exception as e:  # noqa: BLE001 - an unreadable kernel counts as all working, and says so
                    notes.append(f"{what} not evaluated: {_one_line(_err(e), 120)}")
                    continue
                if got is not None and got[0] < work:
                    work, why = got
            seen[key] = PallasCall(name, grid, work, why or "; ".join(notes))
        out.append(seen[key])
    return out


def pallas_work(calls: Sequence[PallasCall]) -> dict[tuple[str, tuple[int, int, int]], int]:
    """``(name, launch grid) → programs that do work`` for :func:`step_structure` (the fewest where two calls
    share a name and grid)."""
    table: dict[tuple[str, tuple[int, int, int]], int] = {}
    for c in calls:
        key = (c.name, c.launch_grid)
        table[key] = min(table.get(key, c.work), c.work)
    return table


def compile_case(case: Case, target: Target) -> tuple[float, str]:
    """Trace, lower and compile one case for the target; returns (seconds, info).  Raises on any failure."""
    rep = target.replicated

    def respec(a):
        is_array = hasattr(a, "shape") and hasattr(a, "dtype")
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) if is_array else a

    specs = jax.tree.map(respec, tuple(case.arg_specs))
    with tempfile.TemporaryDirectory(prefix="aot_h200_") as dump:
        t0 = time.perf_counter()
        with jax.default_device(target.device), jax.sharding.use_abstract_mesh(target.mesh.abstract_mesh):
            lowered = jax.jit(case.fn, out_shardings=rep).trace(*specs).lower()
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        seconds = time.perf_counter() - t0
        info = [_smem_from_dump(Path(dump))]
    with contextlib.suppress(Exception):  # informational only
        ma = compiled.memory_analysis()
        info.append(f"args={_kib(ma.argument_size_in_bytes)} out={_kib(ma.output_size_in_bytes)} "
                    f"temp={_kib(ma.temp_size_in_bytes)}")
    return seconds, " ".join(info)


def _attempt(case: Case, target: Target, verbose: bool) -> tuple[float, str, str | None]:
    if case.broken:
        return 0.0, "", case.broken
    t0 = time.perf_counter()
    try:
        return (*compile_case(case, target), None)
    except Exception as e:  # noqa: BLE001 - every failure is a reported result
        if verbose:
            traceback.print_exc()
        return time.perf_counter() - t0, "", _err(e)


def run_cases(cases: Sequence[Case], target: Target, *, jobs: int = 1, verbose: bool = False, out=sys.stdout) -> int:
    """Compile every case, one line each (in case order); returns the number that did not behave as expected.

    ``jobs`` > 1 compiles in threads (XLA releases the GIL while compiling; tracing and lowering stay serial).
    """
    bad = 0
    width = max((len(c.name) for c in cases), default=10)
    pool = ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None
    try:
        attempts = (pool.map(lambda c: _attempt(c, target, verbose), cases) if pool else
                    (_attempt(c, target, verbose) for c in cases))
        for case, (seconds, info, err) in zip(cases, attempts):
            if case.broken:
                ok, verdict, when = False, f"FAIL: {_one_line(err)}", f"{'-':>6} "
            elif case.expect_fail is None:
                ok = err is None
                verdict, when = ("OK" if ok else f"FAIL: {_one_line(err)}"), f"{seconds:6.2f}s"
            else:
                ok = err is not None and re.search(case.expect_fail, err, re.DOTALL) is not None
                when = f"{seconds:6.2f}s"
                verdict = (f"OK (failed as expected: {_one_line(err, 200)})" if ok else
                           f"FAIL: expected an error matching /{case.expect_fail}/, got "
                           + ("success" if err is None else _one_line(err)))
            bad += not ok
            print(f"{case.name:<{width}}  {when}  {info + '  ' if info else ''}{verdict}", file=out, flush=True)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return bad


def _filter_warnings() -> None:
    warnings.filterwarnings("ignore", message=r".*Pallas Triton backend is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*Using `pl.pallas_call` for Mosaic GPU kernels is deprecated.*")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qjax.kernels.aot_h200", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the case names and exit (no compile)")
    p.add_argument("--filter", metavar="SUBSTR", default="", help="only cases whose name contains SUBSTR")
    p.add_argument("--self-test", action="store_true",
                   help="compile the built-in self-test kernel instead: good tilings must compile, the oversized "
                        "one must fail with RESOURCE_EXHAUSTED shared memory")
    p.add_argument("--target", choices=sorted(TARGETS), default="h200",
                   help="the GPU to compile for (default: %(default)s): kernels/<target>.txtpb")
    p.add_argument("--target-config", default=None, metavar="TXTPB",
                   help="a GpuTargetConfigProto text file instead of --target's")
    p.add_argument("--extract-target-config", metavar="WHEEL_OR_SO",
                   help="print the H200 target config embedded in a jax-cuda13-pjrt 0.12.x wheel (or its .so)")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                   help="compile N cases at a time in threads (default 1; 0 = one per CPU)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    if args.extract_target_config:
        return _extract_main(args.extract_target_config)
    if "JAX_PLATFORMS" not in os.environ:  # a no-GPU host: keep the CUDA plugin from probing for devices
        with contextlib.suppress(Exception):
            jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("QJAX_KERNELS", "pallas")
    _filter_warnings()

    cases = selftest_cases() if args.self_test else collect_cases()
    cases = [c for c in cases if args.filter in c.name]
    if args.list:
        for c in cases:
            print(c.name + (f"  (must fail: /{c.expect_fail}/)" if c.expect_fail else "")
                  + (f"  (broken: {_one_line(c.broken, 200)})" if c.broken else ""))
        return 0
    if not cases:
        print("no cases to compile" + (f" matching {args.filter!r}" if args.filter else ""))
        return 0

    config = args.target_config or TARGETS[args.target]
    try:
        target = make_target(config)
    except Exception as e:  # noqa: BLE001
        print(f"cannot create the compile-only GPU target from {config}: {_one_line(_err(e))}\n"
              "(needs jax-cuda13-plugin + jax-cuda13-pjrt matching jax; see .ci/aot_h200.sh)", file=sys.stderr)
        return 2
    print(f"jax {jax.__version__}, target {target.device.device_kind} (compile-only), {len(cases)} case(s)",
          flush=True)
    t0 = time.perf_counter()
    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    bad = run_cases(cases, target, jobs=jobs, verbose=args.verbose)
    print(f"{len(cases) - bad}/{len(cases)} as expected in {time.perf_counter() - t0:.1f}s"
          + (f"; {bad} FAILED" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
