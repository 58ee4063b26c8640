"""The deviceless H200 AOT check (kernels/aot_h200.py, .ci/aot_h200.sh): the parts that run without the CUDA plugin.

The compile itself needs jax-cuda13-plugin/pjrt and runs in CI via .ci/aot_h200.sh.
"""

from __future__ import annotations

import re
import subprocess
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
