"""llm-compressor oracle for qjax's AWQ and GPTQ (issue 51): build its venv, run it, refresh the test fixtures.

    python benchmarks/llmc_oracle.py                 # build the venv if needed, run every case, write the fixtures
    python benchmarks/llmc_oracle.py --runs awq_w8g32,gptq_w4g32_static
    python benchmarks/llmc_oracle.py --only_model_runs  # only the whole-model GPTQ checkpoint(s), see MODEL_RUN

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


# Whole-model runs (``--model_runs``): a worker run's GPTQ recipe on the whole model, its compressed checkpoint kept
# as ``<run>_model.safetensors`` (``model.layers.*`` packed weights, scales, zero points) for tests/test_gptq.py's
# end-to-end comparison with ``qjax quantize --algorithm gptq``. ``in_proj_a`` / ``in_proj_b`` ([4, 64] on the tiny
# model) are ignored as well: qjax leaves a layer whose out_features is not a multiple of 32 in float (auto-round's
# rule) and llm-compressor would quantize them, which changes the quantized stream every later layer calibrates on.
# Run in the worker's venv; the worker module is loaded by path (its folder on sys.path would let benchmarks/kernels.py
# shadow the ``kernels`` package transformers probes).
MODEL_RUN = r"""
import importlib.util, json, os, sys
from safetensors.torch import save_file
spec = importlib.util.spec_from_file_location("llmc_oracle_worker", sys.argv[1])
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
import torch
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # as the worker's main
out, runs = sys.argv[2], sys.argv[3].split(",")
torch.set_num_threads(max(1, os.cpu_count() or 1))
src = os.path.join(out, "_source")
w.make_model().save_pretrained(src)
ignore = w.IGNORE + ["re:.*linear_attn.in_proj_a$", "re:.*linear_attn.in_proj_b$"]
for name in runs:
    algo, wargs, opts, calib_all = w.RUNS[name]
    assert algo == "gptq", name
    model = w.make_model(src)
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": wargs}}, ignore=ignore, **opts)
    seconds = w.timed_oneshot(model, recipe, w.calibration_ids(), calib_all)
    folder = os.path.join(out, f"_{name}_model")
    saved = w.saved_checkpoint(model, folder)
    save_file({k: v.contiguous() for k, v in saved.items() if k.startswith("model.layers.") and "weight_" in k},
              os.path.join(out, f"{name}_model.safetensors"))
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    json.dump({"run": name, "ignore": ignore, "moe_calibrate_all_experts": calib_all, "seconds": seconds,
               "quantization_config": qc}, open(os.path.join(out, f"{name}_model.json"), "w"), indent=1, default=str)
    print(f"[model run] {name}: {seconds:.1f} s", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/qjax-llmc-oracle"))
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable,
                    help="interpreter for the venv (3.11: the local torch wheel is cp311)")
    ap.add_argument("--wheels", default="/opt/wheels", help="folder holding the torch 2.13.0+cpu wheel")
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all, see the worker's RUNS)")
    ap.add_argument("--model_runs", default="gptq_w4g32_static",
                    help="GPTQ runs also done on the whole model, their checkpoint kept (see MODEL_RUN; '' for none)")
    ap.add_argument("--only_model_runs", action="store_true", help="skip the worker's runs (the rest unchanged)")
    ap.add_argument("--out", default=FIXTURES)
    args = ap.parse_args()
    build = ensure_venv(args.venv, args.python, args.wheels)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # run outside the repository: its kernels/ folder would shadow the `kernels` package transformers probes
        if not args.only_model_runs:
            subprocess.run([venv_python(args.venv), "-P", WORKER, tmp, args.runs], check=True, cwd=tmp)
        if args.model_runs:
            subprocess.run([venv_python(args.venv), "-P", "-c", MODEL_RUN, WORKER, tmp, args.model_runs], check=True,
                           cwd=tmp)
        os.makedirs(args.out, exist_ok=True)
        for f in sorted(os.listdir(tmp)):
            if not f.startswith("_"):  # _source / _<run>_ckpt / _<run>_model: scratch checkpoints, tensors recorded
                shutil.copy(os.path.join(tmp, f), os.path.join(args.out, f))
    print(f"[oracle] venv {'built in %.0f s' % build if build else 'found'}; runs {time.perf_counter() - t0:.0f} s; "
          f"fixtures in {args.out}")


if __name__ == "__main__":
    main()
