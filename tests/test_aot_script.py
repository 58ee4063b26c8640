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
from qjax.kernels.reference import QuantMeta
from qjax.kernels.reference import qmatmul as qmatmul_ref

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
