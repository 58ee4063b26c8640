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

    r = _qjax("generate", "--model", tiny_hf[1], "--ids", "5 6 7 8", "--max-new-tokens", "6", "--verbose")
    assert r.returncode == 0, r.stderr
    want = qjax.generate(qjax.load_model(tiny_hf[1]), np.array([[5, 6, 7, 8]]), max_new_tokens=6)[0, 4:]
    assert r.stdout.split() == [str(t) for t in want]
    # --verbose: the compile cache in use, and the steady decode speed apart from the first token's wait
    assert "qjax generate: compile cache " in r.stderr
    assert "first token after " in r.stderr and "tok/s (steady decode)]" in r.stderr, r.stderr


def test_generate_bad_folder_is_a_clear_error(tmp_path):
    r = _qjax("generate", "--model", str(tmp_path / "missing"), "--ids", "1")
    assert r.returncode == 2
    assert "no config.json" in r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["quantize", "--help"], ["serve", "--help"], ["bench", "--help"],
                                  ["generate", "--bogus"], ["quantize", "--output_dir", "x", "--bogus"]])
def test_help_and_flag_errors_import_no_jax(argv):
    """``qjax --help``, a subcommand's help and a flag error answer before the library loads: the child process ends
    with neither jax nor flax in ``sys.modules`` (a misspelled flag names itself under its own subcommand's usage)."""
    code = ("import sys\nfrom qjax.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'optax'}))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "LOADED []", out.stdout[-2000:] + out.stderr[-2000:]
    if "--bogus" in argv:
        assert f"usage: qjax {argv[0]}" in out.stderr and "unrecognized arguments: --bogus" in out.stderr, out.stderr


def test_the_cli_dtype_names_are_the_models():
    from qjax.cli.options import DTYPE_NAMES
    from qjax.model.dtypes import MODEL_DTYPES

    assert DTYPE_NAMES == tuple(MODEL_DTYPES)
