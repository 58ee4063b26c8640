"""The ``qjax`` entry point, run in a subprocess like a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def _qjax(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qjax.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_without_download():
    r = _qjax("demo", "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "logits after the round trip identical: True" in r.stdout
    assert "tokens/s" in r.stdout


def test_generate_with_ids_matches_library(tiny_hf):
    import numpy as np

    import qjax

    r = _qjax("generate", "--model", tiny_hf[1], "--ids", "5 6 7 8", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    want = qjax.generate(qjax.load_model(tiny_hf[1]), np.array([[5, 6, 7, 8]]), max_new_tokens=6)[0, 4:]
    assert r.stdout.split() == [str(t) for t in want]


def test_generate_bad_folder_is_a_clear_error(tmp_path):
    r = _qjax("generate", "--model", str(tmp_path / "missing"), "--ids", "1")
    assert r.returncode == 2
    assert "no config.json" in r.stderr
