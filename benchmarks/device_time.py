"""Device-side time of a jitted call: the profiler's kernel durations, not the host's wall clock.

A host-timed call (``benchmarks/kernels.py``'s ``timeit``: dispatch + ``block_until_ready``) costs ~100 µs on a GPU
whatever the kernel does, so an M = 1 GEMV of 8 MiB (≈ 2 µs of bandwidth) reads as 2 % of the copy bandwidth. Here the
call runs ``calls`` times under ``jax.profiler.trace(create_perfetto_trace=True)`` and the durations of the events the
device ran are summed, per call and per kernel:

- on a GPU, every complete event of a ``/device:…`` process of the trace (CUPTI's kernel and memcpy records, named
  by the kernel: a Pallas call by its ``name=``), i.e. the time the device was busy for the call — launch gaps and
  host work excluded;
- without device records (a CPU, or a GPU image whose profiler cannot load CUPTI), the executed XLA ops' events —
  those carrying ``hlo_op`` / ``hlo_module`` arguments, as XLA:CPU's thunk executor records them — so the same code
  runs (and is tested) on the CPU; the result says which source it used.

    from device_time import device_profile
    prof = device_profile(jitted, args, calls=10)   # prof.per_call (s), prof.by_name {kernel: s per call}
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    per_call: float  # seconds of device work per call (sum over its events)
    by_name: dict  # event name → seconds per call
    source: str  # "device" (GPU records), "ops" (executed XLA ops on the host's threads) or "none"
    calls: int

    def top(self, n: int = 5) -> list[tuple[str, float]]:
        return sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]


def parse_trace(trace, calls: int, module: str | None = None) -> DeviceProfile:
    """:class:`DeviceProfile` of a perfetto / Chrome trace (the parsed ``perfetto_trace.json.gz``: a dict with
    ``traceEvents`` or the event list). ``module``: keep only the ops of this HLO module (host-op source; device
    records carry no module on every XLA version, so they are all kept — profile one program at a time)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    chosen = [e for e in complete if e.get("pid") in device_pids]
    source = "device"
    if not chosen:
        source = "ops"
        chosen = [e for e in complete if "hlo_op" in e.get("args", {})
                  and (module is None or e["args"].get("hlo_module") == module)]
    if not chosen:
        return DeviceProfile(0.0, {}, "none", calls)
    by_name: dict[str, float] = {}
    for e in chosen:  # durations in µs
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e["dur"]) * 1e-6 / calls
    return DeviceProfile(sum(by_name.values()), by_name, source, calls)


def device_profile(fn: Callable, args: Sequence, calls: int = 10) -> DeviceProfile:
    """Run ``fn(*args)`` once to compile, then ``calls`` times under the profiler; the device time per call."""
    jax.block_until_ready(fn(*args))
    module = None
    lower = getattr(fn, "lower", None)
    if lower is not None:  # a jitted function: its HLO module's name filters the host-op events
        found = re.search(r"module @([\w.\-]+)", lower(*args).as_text())  # StableHLO's name = XLA's module name
        module = found.group(1) if found else None
    with tempfile.TemporaryDirectory(prefix="qjax_prof_") as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        found = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            return DeviceProfile(0.0, {}, "none", calls)
        with gzip.open(found[0]) as f:
            trace = json.load(f)
    return parse_trace(trace, calls, module)
