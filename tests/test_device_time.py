"""benchmarks/device_time.py: device-side time of a call from the profiler's trace (GPU records, else the executed
XLA ops), and benchmarks/kernels.py's ``--filter`` alternatives."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def device_time():
    return _load("device_time")


def _event(pid, name, dur, **args):
    return {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur, "name": name, "args": args}


def test_device_records_win_over_host_ops(device_time):
    """A GPU trace: only the ``/device:…`` processes' events count (kernels and copies, per call, by name); the host's
    op events (launch-side records with ``hlo_op``) and everything else are left out."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    events = meta + [_event(1, "qmatmul_gemv_int4", 50.0, hlo_op="custom-call.1", hlo_module="jit_f"),
                     _event(1, "PjitFunction(f)", 120.0),
                     *[_event(7, "qmatmul_gemv_int4", 3.0) for _ in range(4)],
                     *[_event(7, "loop_reduce_fusion", 1.0) for _ in range(4)]]
    prof = device_time.parse_trace({"traceEvents": events}, calls=4)
    assert prof.source == "device"
    assert prof.per_call == pytest.approx(4e-6)
    assert prof.by_name == pytest.approx({"qmatmul_gemv_int4": 3e-6, "loop_reduce_fusion": 1e-6})
    assert prof.top(1)[0][0] == "qmatmul_gemv_int4"


def test_host_ops_of_one_module_without_device_records(device_time):
    """No device process (a CPU, or no CUPTI): the executed ops of the profiled module; none at all → ``none``."""
    events = [_event(1, "fusion", 10.0, hlo_op="fusion", hlo_module="jit_f"),
              _event(1, "fusion", 30.0, hlo_op="fusion", hlo_module="jit_g"),
              _event(1, "ParseArguments", 5.0)]
    prof = device_time.parse_trace(events, calls=2, module="jit_f")
    assert prof.source == "ops" and prof.per_call == pytest.approx(5e-6)
    assert device_time.parse_trace(events[2:], calls=2).source == "none"


def test_profiles_a_jitted_call_on_this_backend(device_time):
    """The real profiler round trip (CPU here): the jitted function's ops, nothing else, time per call > 0."""
    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    a = jnp.ones((128, 128), jnp.float32)
    prof = device_time.device_profile(f, (a, a), calls=3)
    assert prof.source in ("ops", "device") and prof.calls == 3
    assert prof.per_call > 0 and all(v > 0 for v in prof.by_name.values())
    assert not any(name.startswith(("Pjit", "Parse", "$")) for name in prof.by_name)


def test_kernel_filter_alternatives():
    kernels = _load("kernels")

    class Args:
        filter = "dense int4_g128 8192x2048,moe int2_g64"

    assert kernels.wanted(Args, "dense int4_g128 8192x2048") and kernels.wanted(Args, "moe int2_g64")
    assert not kernels.wanted(Args, "dense int4_g128 2048x4096") and not kernels.wanted(Args, "gdn decode")
    Args.filter = ""
    assert kernels.wanted(Args, "gdn decode")
