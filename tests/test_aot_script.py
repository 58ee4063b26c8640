"""The deviceless H200 AOT check (kernels/aot_h200.py, .ci/aot_h200.sh): the parts that run without the CUDA plugin.

The compile itself needs jax-cuda13-plugin/pjrt and runs in CI via .ci/aot_h200.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qjax.kernels import aot_h200
from qjax.kernels.qmatmul_reference import qmatmul as qmatmul_ref
from qjax.kernels.quant_meta import QuantMeta

pytestmark = pytest.mark.interpret

ROOT = Path(__file__).resolve().parents[1]


def test_target_config_is_the_h200_block():
    text = aot_h200.TARGET_CONFIG.read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert body.lstrip().startswith("gpu_device_info {")
    assert body.count("{") == body.count("}")
    assert re.search(r'^device_description_str: "NVIDIA H200 141GB HBM3e"$', body, re.MULTILINE)
    for field in ("core_count: 132", "shared_memory_per_block_optin: 232448", "major: 9",
                  "feature_extension: ACCELERATED_FEATURES", 'platform_name: "CUDA"'):
        assert field in body, field


def test_extract_target_config_picks_h200_not_mig(tmp_path):
    def block(desc):
        return (f'# header\ngpu_device_info {{\n  core_count: 1\n}}\nplatform_name: "CUDA"\n'
                f'device_description_str: "{desc}"\n')

    blob = b"\0\x7fELF junk\0".join(
        [b"", block("NVIDIA H100 80GB HBM3").encode(), block("NVIDIA H200 MIG 1g.18gb").encode(),
         block("NVIDIA H200 141GB HBM3e").encode(), b"tail"])
    so = tmp_path / "xla_cuda_plugin.so"
    so.write_bytes(blob)
    assert aot_h200.extract_target_config(so) == block("NVIDIA H200 141GB HBM3e")
    with pytest.raises(ValueError, match="B200"):
        aot_h200.extract_target_config(so, device="NVIDIA B200")


@pytest.mark.parametrize("bits,group", [(4, 128), (2, 64)])
def test_selftest_kernel_matches_reference_in_interpret_mode(bits, group):
    m, n, k = 16, 256, 512
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    packed = jnp.asarray(rng.integers(-(2**31), 2**31, (n, k * bits // 32), dtype=np.int64).astype(np.int32))
    scales = jnp.asarray(rng.uniform(0.01, 0.1, (n, k // group)), jnp.bfloat16)
    fn = jax.jit(lambda *a: aot_h200.selftest_qmatmul(*a, bits=bits, group=group, bm=16, bn=128, bk=256,
                                                      interpret=True))
    got = np.asarray(fn(x, packed, scales), np.float32)
    want = np.asarray(qmatmul_ref(x, packed, scales, None, QuantMeta("int", bits, group, k, n)), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_list_self_test_cases(monkeypatch, capsys):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("QJAX_KERNELS", "reference")  # main() only defaults it; keep the session's value intact
    assert aot_h200.main(["--self-test", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("selftest/") for line in lines)
    assert [("must fail" in line) for line in lines] == [False, False, True]
    assert "bm256bn512bk1024_w4s4" in lines[2]


def test_ci_script_syntax():
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "aot_h200.sh")], check=True)


# The shape of XLA:GPU's thunk dump (jax 0.11.2, a decode loop: while → conditional → nested whiles; `condition:` is
# printed in column 0), trimmed to a few thunks of each kind.
_THUNKS = """\
000: kCommandBuffer [source       | next=003 (1)]
    001: kCopy         [source | sink] kCopy
    002: kCustomKernel [source | sink] wrapped_transpose grid: [8, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
003: kWhile         [prev=000 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kConditional   [prev=000 (1) | next=000 (1)]
      false_branch:
        006: kWhile         [prev=000 (1) | next=012 (1)]
condition:
            007: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            008: kAsyncStart    [source       | next=000 (7) ] stream=computation_stream[3], async_id=8
                009: kDynamicSliceFusion [source | sink] params=1, results=1
                    010: kCopy [source | sink] kCopy
            011: kAsyncDone     [source       | sink         ] async_id=8
            000: kCommandBuffer [prev=011 (2) | next=000 (2) ]
                013: kCustomKernel [source | next=014 (1)] qmatmul_gemv_int4 grid: [1, 2560, 1] threads: [128, 1, 1]  shared_memory: 4096 bytes
                014: kCustomKernel [prev=013 (1) | sink] loop_multiply_fusion_8 grid: [64, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
                015: kWhile         [prev=000 (1)  | next=000 (1) ]
condition:
                    016: kCustomKernel [source | sink] loop_compare_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
                  body:
                    017: kCustomKernel [source | sink] input_reduce_fusion grid: [256, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
                018: kCustomKernel [source | sink] qjax_moe_down grid: [8, 32, 1] threads: [128, 1, 1]  shared_memory: 22528 bytes
        012: kCustomKernel  [prev=006 (1) | sink] gemm_fusion_dot_14 grid: [15520, 1, 1] threads: [64, 1, 1]  shared_memory: 512 bytes
      true_branch:
        000: kCommandBuffer [source | sink]
            019: kCopy [source | sink] kCopy
"""


def test_loop_launches_counts_one_outer_iteration():
    """Launches per decode step: nested loops × their HLO trip counts, the costlier branch, no async bookkeeping,
    nothing outside the outermost loop; a nested loop of unknown trip count is an error, not a guess."""
    meta = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n}}\n'
                   for i, name in ((3, "while.1"), (6, "while.2"), (15, "while.3")))
    hlo = ('  %while.1 = (s32[]) while(%t), condition=%c1, body=%b1\n'
           '  %while.2 = (s32[]) while(%u), condition=%c2, body=%b2, backend_config={"known_trip_count":{"n":"10"}}\n'
           '  ROOT %while.3 = (s32[]) while(%v), condition=%c3, body=%b3, '
           'backend_config={"known_trip_count":{"n":"8"},"dynamic_variable_tuple_indices":[]}\n')
    # per layer-scan iteration: compare 1 + slice copy 1 + gemv 1 + multiply 1 + 8 × (compare + reduce) + moe 1
    per_scan = {"xla": 1 + 1 + 16, "copy": 1, "pallas": 2}
    got = aot_h200.loop_launches(_THUNKS, meta, hlo)
    assert got == {"xla": 1 + 10 * per_scan["xla"] + 1, "copy": 10 * per_scan["copy"], "pallas": 10 * per_scan["pallas"]}
    with pytest.raises(ValueError, match=r"while thunk 15 \(while.3\) has no known trip count"):
        aot_h200.loop_launches(_THUNKS, meta, hlo.replace('"n":"8"', '"m":"8"'))


def _meta(pairs) -> str:
    return "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n}}\n'
                   for i, name in pairs)


_HLO = ('  %while.1 = (s32[]) while(%t), condition=%c1, body=%b1\n'
        '  %while.2 = (s32[]) while(%u), condition=%c2, body=%b2, backend_config={"known_trip_count":{"n":"10"}}\n'
        '  ROOT %while.3 = (s32[]) while(%v), condition=%c3, body=%b3, '
        'backend_config={"known_trip_count":{"n":"8"},"dynamic_variable_tuple_indices":[]}\n')


def test_step_structure_host_round_trips_graphs_and_what_stays_outside():
    """The fixture's step: the decode loop (no known trip count) and its conditional run on the host — two round
    trips per step, none in the layer loop (known trip count 10); per layer iteration the host issues the loop
    control, its condition kernel, one async copy (start + done; the copy itself), the GEMM… and one graph."""
    s = aot_h200.step_structure(_THUNKS, _meta(((3, "while.1"), (6, "while.2"), (15, "while.3"))), _HLO)
    assert s.host_syncs == 2 and s.host_syncs_in_layers == 0 and s.host_syncs_per_layer == 0
    assert s.step_trip_count is None and not s.step_loop_in_graph
    assert s.layer_trip_count == 10
    # per layer iteration: loop control 1, condition kernel 1, async start 1 + its copy 1 + done 1, graph 1
    assert s.layer_host_ops == 6
    # per step: the step itself 1, its condition kernel 1, the conditional 1, the layer loop 10 × 6, the GEMM after it
    assert s.host_ops == 1 + 1 + 1 + 60 + 1
    assert s.graphs == 10
    assert s.outside_graphs == {"kAsyncDone": 10, "kAsyncStart": 10, "kConditional": 1, "kCopy": 10,
                                "kCustomKernel": 1 + 10 + 1, "kDynamicSliceFusion": 10, "kWhile": 1}
    assert s.pallas_outside_graphs == 0
    # Pallas programs: gemv [1, 2560, 1] + moe_down [8, 32, 1] per layer iteration
    assert s.pallas_programs == 10 * (2560 + 256) and s.idle_programs == 0
    assert set(s.unmatched_pallas) == {"qmatmul_gemv_int4[1, 2560, 1]", "qjax_moe_down[8, 32, 1]"}
    # with the Pallas calls' work: the stacked-weight GEMV works in one layer's 256 row blocks of 2,560
    work = {("qmatmul_gemv_int4", (1, 2560, 1)): 256, ("qjax_moe_down", (8, 32, 1)): 256}
    s = aot_h200.step_structure(_THUNKS, _meta(((3, "while.1"), (6, "while.2"), (15, "while.3"))), _HLO, work=work)
    assert s.idle_programs == 10 * (2560 - 256) and not s.unmatched_pallas


# XLA:GPU's dump of a decode loop captured whole (xla_gpu_enable_command_buffer with WHILE, min graph size 1): the
# outermost while sits inside the one command buffer
_THUNKS_ONE_GRAPH = """\
000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=003 (2)] kCopy
    003: kWhile [prev=002 (1) | sink        ]
condition:
        004: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        007: kWhile        [prev=005 (2) | sink        ]
condition:
            008: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          body:
            010: kCustomKernel [source       | next=012 (2)] qjax_small grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
            012: kCustomKernel [prev=011 (1) | next=013 (1)] gemm_fusion_dot grid: [512, 1, 1] threads: [64, 1, 1]  shared_memory: 1024 bytes
"""


def test_step_structure_of_a_decode_loop_captured_whole():
    s = aot_h200.step_structure(_THUNKS_ONE_GRAPH, _meta(((3, "while.1"), (7, "while.2"))), _HLO,
                                pallas_names={"qjax_small"})
    assert s.step_loop_in_graph and s.host_ops == 0 and s.graphs == 0 and s.host_syncs == 0
    assert s.launches == {"pallas": 10, "xla": 1 + 10 * 2}  # the outer condition, then 10 × (compare, gemm)
    assert s.layer_trip_count == 10 and s.layer_host_ops == 0 and s.outside_graphs == {}


def test_step_structure_needs_a_while_loop():
    with pytest.raises(ValueError, match="no while loop"):
        aot_h200.step_structure("000: kCommandBuffer [source | sink]\n", "", "")


def _stacked_gemv(layers: int, one_layer_grid: bool):
    """A stand-in for the stacked-weight kernels: layer ``layer`` of an ``[L·N, K]`` stack, written to ``[M, N]``.
    Before: a grid over every layer's row blocks, ``pl.when(program_id(1) // nb == layer)``; after: one layer's."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plgpu

    n, k, bn = 64, 32, 16
    nb = n // bn

    def kernel(layer_ref, w_ref, o_ref):
        if one_layer_grid:
            o_ref[...] = w_ref[pl.ds(layer_ref[0] * n + pl.program_id(1) * bn, bn), :].sum(axis=1)[None, :]
        else:
            @pl.when(pl.program_id(1) // nb == layer_ref[0])
            def _():
                o_ref[...] = w_ref[...].sum(axis=1)[None, :]

    def fn(layer, w):
        grid = (1, nb if one_layer_grid else nb * layers)
        w_spec = (pl.BlockSpec((layers * n, k), lambda i, j: (0, 0)) if one_layer_grid else
                  pl.BlockSpec((bn, k), lambda i, j: (j, 0)))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, n), jnp.float32), grid=grid,
                              in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), w_spec],
                              out_specs=pl.BlockSpec((1, bn), lambda i, j: (i, j % nb)), name="qmatmul_test",
                              compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(layer, w)

    return fn, (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((layers * n, k), jnp.float32))


@pytest.mark.parametrize("one_layer_grid", [False, True])
def test_pallas_calls_count_the_programs_of_other_layers_as_idle(one_layer_grid):
    """Today's stacked-weight kernels (a grid over all 10 layers, the others' programs guarded off) leave 9 of 10
    programs idle; with the grid one layer wide none is. Found inside a scan, as in the model."""
    fn, specs = _stacked_gemv(10, one_layer_grid)

    def program(layer, w):
        return jax.lax.scan(lambda c, _: (c + fn(layer, w), None), jnp.zeros((1, 64), jnp.float32), None,
                            length=3)[0]

    calls = aot_h200.pallas_calls(jax.make_jaxpr(program)(*specs))
    (call,) = set(calls)
    assert call.name == "qmatmul_test" and call.launch_grid == ((1, 4, 1) if one_layer_grid else (1, 40, 1))
    assert call.work == 4 and (call.programs - call.work) == (0 if one_layer_grid else 36)
    assert ("guard" in call.why) != one_layer_grid
    assert aot_h200.pallas_work(calls) == {("qmatmul_test", call.launch_grid): 4}


def test_pallas_calls_count_programs_that_share_an_output_block():
    """Without a guard, a grid wider than its blocked output (program j writes block j % 4) still has only 4
    programs' worth of work."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 64), jnp.float32), grid=(2, 16),
                              in_specs=[pl.BlockSpec((4, 16), lambda i, j: (i, j % 4))],
                              out_specs=pl.BlockSpec((4, 16), lambda i, j: (i, j % 4)), name="qjax_wide",
                              compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x)

    (call,) = aot_h200.pallas_calls(jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((8, 64), jnp.float32)))
    assert (call.programs, call.work, call.why) == (32, 8, "shared output blocks")


def test_target_configs_h100_is_h200_with_its_memory():
    h200, h100 = (aot_h200.TARGETS[t].read_text() for t in ("h200", "h100"))

    def fields(text):
        return {line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")}

    assert fields(h200) - fields(h100) == {
        "memory_bandwidth: 4800000000000", "device_memory_size: 151397597184", 'name: "NVIDIA H200 141GB HBM3e"',
        'device_description_str: "NVIDIA H200 141GB HBM3e"',
        ('model_str: "sm_9.0a with 151397597184B RAM, 132 cores, 1980000KHz clock, 3750000KHz mem clock, '
         '52428800B L2$"')}
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in h100 and "core_count: 132" in h100
    text = aot_h200.target_config("h100", cuda=aot_h200.LENT_CUDA)
    for field in ("driver_version", "runtime_version", "compile_time_toolkit_version"):
        assert f'{field}: "{aot_h200.LENT_CUDA}"' in text
    assert aot_h200.target_config("h200") == h200


def _e2e_aot(monkeypatch):
    """benchmarks/e2e_aot.py as a module (its env defaults kept out of the session)."""
    import importlib.util

    monkeypatch.setenv("QJAX_KERNELS", os.environ.get("QJAX_KERNELS", "reference"))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("e2e_aot_under_test", ROOT / "benchmarks" / "e2e_aot.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def test_gate_table_fails_above_a_limit_and_prints_the_distance_to_the_issue_target(monkeypatch):
    m = _e2e_aot(monkeypatch)
    assert {chip for chip, _ in m.GATE} == set(aot_h200.TARGETS)
    assert {mode for _, mode in m.GATE} == {"xla", *m.GATE_MODES}  # the default mode and the graph modes checked
    target = m.ISSUE_TARGET
    assert (target.launches, target.idle_programs, target.layer_syncs, target.step_syncs) == (400, 0, 0, 0)
    for key, limit in m.GATE.items():  # a ratchet's rows are never better than the target they are lowered to
        # (host ops: one graph per step is the target; the decode loop inside one graph, 0, is better still)
        assert all(getattr(limit, f) >= getattr(target, f) for f in vars(limit) if f != "host_ops"), key
    limit = m.GATE[("h200", "xla")]
    ok, lines = m.gate_check("h200", limit)
    assert ok and len(lines) == 5 and f"{limit.launches - 400:,} to go" in lines[0] and "FAIL" not in "".join(lines)
    worse = m.Limits(**{**vars(limit), "launches": limit.launches + 1})
    ok, lines = m.gate_check("h200", worse)
    assert not ok and "FAIL" in lines[0]
    better = m.Limits(**{**vars(limit), "host_ops": 1, "step_syncs": 0})
    ok, lines = m.gate_check("h200", better)
    assert ok and any("lower the limit to 0" in x for x in lines) and any(": met" in x for x in lines)


def test_decode_xla_options(monkeypatch):
    from qjax.runtime import xla_options as xo

    monkeypatch.delenv(xo.ENV, raising=False)
    assert xo.decode_mode() == xo.DEFAULT_MODE == "xla" and xo.decode_compiler_options() is None
    graphs = xo.decode_compiler_options("graphs")
    assert graphs["xla_gpu_enable_command_buffer"].split(",")[-1] == "WHILE" and "+" not in str(graphs)
    assert graphs["xla_gpu_graph_min_graph_size"] == 1 and graphs["xla_gpu_command_buffer_unroll_loops"] is True
    assert xo.decode_compiler_options("off") == {"xla_gpu_enable_command_buffer": ""}
    monkeypatch.setenv(xo.ENV, "unrolled")
    assert xo.decode_mode() == "unrolled" and xo.decode_mode("off") == "off"
    monkeypatch.setenv(xo.ENV, "fast")
    with pytest.raises(ValueError, match="not one of"):
        xo.decode_mode()
    # XLA:CPU accepts (and ignores) every mode's GPU options: a CPU process may pass them
    for mode in xo.MODES:
        f = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2, x),
                    compiler_options=xo.decode_compiler_options(mode))
        np.testing.assert_array_equal(np.asarray(f(jnp.ones(3))), 8.0)


def test_decode_loop_for_gives_one_program_per_mode():
    from qjax.runtime import generate

    assert generate.decode_loop_for("graphs") is generate.decode_loop_for("graphs")
    assert generate.decode_loop_for("graphs") is not generate.decode_loop_for("off")
    assert generate.decode_loop is generate.decode_loop_for()


def test_gpu_scripts_syntax():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu" / "run.sh")], check=True)
