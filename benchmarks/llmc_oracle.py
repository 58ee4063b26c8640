"""llm-compressor oracle for qjax's AWQ and GPTQ (issue 51): build its venv, run it, refresh the test fixtures.

    python benchmarks/llmc_oracle.py                 # build the venv if needed, run every case, write the fixtures
    python benchmarks/llmc_oracle.py --runs awq_w8g32,gptq_w4g32_static

llmcompressor 0.14.0.1 pins transformers ≤ 5.17, auto-round ≤ 0.15 and compressed-tensors 0.19, which clash with
qjax's venv, so it lives in ``--venv`` (default ``~/.cache/qjax-llmc-oracle``), built once (~2 min) from the local
CPU torch 2.13.0 wheel (``/opt/wheels``, or the PyTorch CPU index) first and then llmcompressor under a constraint
that holds torch at that build, so no CUDA torch is pulled. The worker (``benchmarks/llmc_oracle_worker.py``, run in
that venv, never importing qjax) builds a tiny float32 ``qwen3_5_moe``, runs ``oneshot`` with each recipe on 4 × 16
random tokens and records what AWQ / GPTQ saw and chose into ``tests/fixtures/llmc_oracle/`` (~5 MB), which
``tests/test_awq.py`` and ``tests/test_gptq.py`` read. About a minute for all runs on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

LLMC = "llmcompressor==0.14.0.1"
TORCH = "torch==2.13.0+cpu"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "llmc_oracle")
WORKER = os.path.join(ROOT, "benchmarks", "llmc_oracle_worker.py")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def installed(venv: str) -> bool:
    probe = ("import importlib.metadata as m; v = m.version('llmcompressor'), m.version('torch');"
             f"raise SystemExit(0 if v == ({LLMC.split('==')[1]!r}, {TORCH.split('==')[1]!r}) else 1)")
    py = venv_python(venv)
    return os.path.exists(py) and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0


def ensure_venv(venv: str, python: str, wheels: str) -> float:
    """Build the venv unless it already holds the pinned versions; returns the seconds spent (0: found)."""
    if installed(venv):
        return 0.0
    t0 = time.perf_counter()
    if not os.path.exists(venv_python(venv)):
        subprocess.run([python, "-m", "venv", venv], check=True)
    py = venv_python(venv)

    def pip(*args: str) -> None:
        print("[venv] pip install " + " ".join(args), flush=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *args], check=True)

    # the CPU build first: from the local wheel folder when there is one, else from PyTorch's CPU index
    source = ["--find-links", wheels] if os.path.isdir(wheels) else ["--extra-index-url", CPU_INDEX]
    pip("--upgrade", "pip")
    pip(*source, TORCH)
    # llmcompressor requires torch>=2.10,<=2.14: without the constraint pip could swap in PyPI's CUDA build
    constraints = os.path.join(venv, "torch-constraint.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.write(TORCH + "\n")
    pip(*source, "-c", constraints, LLMC)
    if not installed(venv):
        raise SystemExit(f"[venv] {venv}: installed, but not {LLMC} with {TORCH}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/qjax-llmc-oracle"))
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable,
                    help="interpreter for the venv (3.11: the local torch wheel is cp311)")
    ap.add_argument("--wheels", default="/opt/wheels", help="folder holding the torch 2.13.0+cpu wheel")
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all, see the worker's RUNS)")
    ap.add_argument("--out", default=FIXTURES)
    args = ap.parse_args()
    build = ensure_venv(args.venv, args.python, args.wheels)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # run outside the repository: its kernels/ folder would shadow the `kernels` package transformers probes
        subprocess.run([venv_python(args.venv), "-P", WORKER, tmp, args.runs], check=True, cwd=tmp)
        os.makedirs(args.out, exist_ok=True)
        for f in sorted(os.listdir(tmp)):
            if not f.startswith("_"):  # _source / _<run>_ckpt: scratch checkpoints, their tensors are recorded
                shutil.copy(os.path.join(tmp, f), os.path.join(args.out, f))
    print(f"[oracle] venv {'built in %.0f s' % build if build else 'found'}; runs {time.perf_counter() - t0:.0f} s; "
          f"fixtures in {args.out}")


if __name__ == "__main__":
    main()
