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

The target is ``h200.txtpb`` next to this file, a ``stream_executor.GpuTargetConfigProto`` text proto taken
verbatim from the jax-cuda13-pjrt 0.12.0.1 wheel (the 0.11.2 plugin embeds none but accepts that file):
``python -m qjax.kernels.aot_h200 --extract-target-config jax_cuda13_pjrt-0.12.0.1-….whl > kernels/h200.txtpb``
regenerates it (see :func:`extract_target_config`).
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

KERNEL_MODULES = ("qjax.kernels.qmatmul_pallas", "qjax.kernels.moe_pallas", "qjax.kernels.gdn_pallas",
                  "qjax.runtime.bench")
TARGET_CONFIG = Path(__file__).with_name("h200.txtpb")
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


def make_target(config: str | os.PathLike = TARGET_CONFIG) -> Target:
    """Compile-only H200 device (no GPU needed) from a ``GpuTargetConfigProto`` text file."""
    from jax._src import xla_bridge  # private JAX: loaded only by the command that needs it

    topo = xla_bridge.make_pjrt_topology("cuda", "1x1x1", topology="1x1x1", target_config=Path(config).read_text())
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


_THUNK_LINE = re.compile(r"(\d+): (k\w+)\s+\[[^\]]*\]\s*(\S*)")
_THUNK_CONTAINERS = {"kWhile", "kConditional", "kCommandBuffer", "kAsyncStart", "kDynamicSliceFusion", "kSequential"}
_THUNK_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams"}


@dataclasses.dataclass
class _ThunkNode:
    kind: str  # a thunk kind, or a section ("body", "condition", "true_branch", "branch_0", …)
    id: int = -1
    name: str = ""
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
        node = _ThunkNode(body[:-1]) if m is None else _ThunkNode(m.group(2), int(m.group(1)), m.group(3))
        if node.kind == "kWhile":
            last_while = indent
        (stack[-1][1].children if stack else roots).append(node)
        stack.append((indent, node))
    return roots


def loop_launches(thunks: str, metadata: str, hlo: str) -> dict[str, int]:
    """Device launches (kernels and copies) per iteration of the program's outermost while loop, by kind.

    From an XLA:GPU dump (``xla_dump_to``): ``thunks`` = ``*thunk_sequence_after_thunk_passes.txt``, ``metadata`` =
    ``*thunk_metadata.txt`` (thunk id → HLO instruction), ``hlo`` = the optimised HLO (each nested while's
    ``known_trip_count``: the layer scan's G, a loop over the k routed slots, …). A conditional counts its costliest
    branch (in a decode loop, the step rather than the finished-rows copy). Kinds: ``pallas`` (qjax's kernels),
    ``copy`` (device copies), ``xla`` (every other kernel: fusions, cuBLAS / Triton GEMMs, sorts). These are what a
    CUDA graph replays one after another; at batch-1 decode their fixed cost per launch, not bytes, can set the time.
    A nested loop without a known trip count raises.
    """
    names = {int(i): a for a, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata)}
    trips = {m.group(1): int(m.group(2)) for m in
             re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]* while\([^\n]*"known_trip_count":\{"n":"(\d+)"', hlo,
                         re.MULTILINE)}

    def count(nodes) -> dict[str, int]:
        out: dict[str, int] = {}

        def add(d, times=1):
            for key, v in d.items():
                out[key] = out.get(key, 0) + v * times
        for node in nodes:
            if node.kind == "kWhile":
                name = names.get(node.id)
                if name not in trips:
                    raise ValueError(f"while thunk {node.id} ({name}) has no known trip count in the HLO")
                add(count(node.children), trips[name])
            elif node.kind == "kConditional":
                add(max((count(b.children) for b in node.children), key=lambda d: sum(d.values()), default={}))
            elif node.kind in _THUNK_CONTAINERS or not node.kind.startswith("k"):
                add(count(node.children))
            elif node.kind not in _THUNK_NO_LAUNCH:
                kind = ("pallas" if node.name.startswith(("qmatmul_", "qjax_")) else
                        "copy" if node.kind == "kCopy" else "xla")
                out[kind] = out.get(kind, 0) + 1
        return out

    loops = [n for n in _thunk_tree(thunks) if n.kind == "kWhile"]
    if not loops:
        raise ValueError("no while loop in the thunk sequence")
    return count(loops[0].children)


def dump_launches(dump: str | Path) -> dict[str, int]:
    """:func:`loop_launches` of the one module dumped into ``dump``."""
    dump = Path(dump)

    def one(what, files):
        if len(files) != 1:
            raise ValueError(f"{dump}: want one {what}, found {len(files)}")
        return files[0].read_text()
    return loop_launches(one("thunk sequence", _thunk_sequences(dump)),
                         one("thunk metadata", sorted(dump.glob("*thunk_metadata.txt"))),
                         one("optimised HLO", sorted(dump.glob("*gpu_after_optimizations.txt"))))


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
    p.add_argument("--target-config", default=str(TARGET_CONFIG), metavar="TXTPB",
                   help="GpuTargetConfigProto text file (default: %(default)s)")
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

    try:
        target = make_target(args.target_config)
    except Exception as e:  # noqa: BLE001
        print(f"cannot create the compile-only H200 target from {args.target_config}: {_one_line(_err(e))}\n"
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
