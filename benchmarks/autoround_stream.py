"""Peak host memory of a streamed ``qjax quantize`` on a checkpoint with the real structure, scaled down (issue 49).

The checkpoint (built once per run, seeded, into a temporary folder): Qwen3.6-35B-A3B's config with its 40 layers
(30 GDN + 10 attention, the real [lin, lin, lin, full] pattern), 256 routed experts top-8, the MTP head and a vision
tower present (a composite folder, text under ``model.language_model.``, experts fused as the official BF16 release
stores them), at narrow widths (hidden 384, expert and shared widths 64, head dims 32, vocabulary 1/8): ~1.6 GB of
BF16, nearly all of it routed experts, as in the real model.

The command is seed 000's (``auto_round --bits 4 --group_size 128 --layer_config {.*experts.*:{bits:2,group_size:64}}
--enable_alg_ext --enable_torch_compile --iters 1000 --nsamples 512 --format auto_round,llm_compressor``) with
iters and samples reduced (``--iters``, ``--nsamples``, ``--seqlen``), run as ``qjax quantize`` in a child process,
calibration ids from a seeded JSONL file. Measured: the child's peak resident size (``ru_maxrss`` of ``wait4``; the
checkpoint is built in a process of its own, since a child's ``ru_maxrss`` starts at the size of the process it was
forked from), against the target: 40 % of the checkpoint's size plus the three cached calibration streams
(``3 × nsamples × seqlen × hidden × 2`` bytes). Prints a markdown table row: date, machine, command, median peak
over ``--runs``, ratio to the limit (≤ 1 meets the target).

    python benchmarks/autoround_stream.py [--iters 2 --nsamples 8 --seqlen 512] [--runs 1] [--keep DIR]
        [--layers 8 --trace FILE --compile_cache DIR|off]   # profiling: fewer layers, RSS over time with the log
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_name  # noqa: E402

RECIPE = ["--bits", "4", "--group_size", "128", "--layer_config", "{.*experts.*:{bits:2,group_size:64}}",
          "--enable_alg_ext", "--enable_torch_compile", "--format", "auto_round,llm_compressor"]


def scaled_config(layers: int = 40):
    """The real config at narrow widths, every layer (or the first ``layers`` of the pattern), expert count and top-k
    kept (see the module docstring)."""
    from qjax.model.config import TextConfig
    from qjax.runtime.bench import load_config, scaled_config as scale

    raw = scale(load_config().to_hf_dict(), width=8, layers=layers)
    raw.update(hidden_size=384, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return TextConfig.from_dict(raw, source="qwen3_6_35b_a3b scaled (benchmarks/autoround_stream.py)")


def build_checkpoint(folder: str, seed: int = 0, layers: int = 40) -> int:
    """The seeded BF16 checkpoint in ``folder``; returns its size in bytes (the safetensors files)."""
    import jax.numpy as jnp

    from qjax.convert import save_pretrained
    from qjax.model.config import VisionConfig
    from qjax.model.qwen3_5_moe import init_model

    cfg = scaled_config(layers)
    v = cfg.vocab_size
    vision = VisionConfig(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16,
                          num_position_embeddings=64, out_hidden_size=cfg.hidden_size, image_token_id=v - 8,
                          video_token_id=v - 7, vision_start_token_id=v - 6, vision_end_token_id=v - 5)
    model = init_model(cfg, dtype=jnp.bfloat16, seed=seed, with_mtp=True, vision=vision)
    save_pretrained(model, folder, fused_experts=True)
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def write_calibration(path: str, vocab: int, nsamples: int, seqlen: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(nsamples):
            f.write(json.dumps({"input_ids": rng.integers(0, vocab - 16, seqlen + 1).tolist()}) + "\n")


def peak_rss(cmd: list[str], env: dict, trace: str | None = None) -> tuple[int, float, str]:
    """(peak resident bytes of the child, seconds, the tail of its stderr). ``trace``: a file where the child's
    resident size is written every 0.2 s (``t rss anon … file …``, MiB) and each line of its log as it comes (``t # line``), to see
    which phase the memory belongs to."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if trace else err, env=env)
        if trace:
            _trace(p, t0, trace, err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-3000:]
    if p.returncode != 0:
        raise SystemExit(f"qjax quantize failed ({p.returncode}):\n{tail}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0, tail


def _trace(p: subprocess.Popen, t0: float, path: str, err) -> None:
    """Sample ``p``'s VmRSS (and its anonymous and file-backed parts, MiB) every 0.2 s and copy its stderr lines (progress bars split at their carriage returns)
    into ``path`` with the seconds since ``t0``, until its stderr closes; its stderr also goes to ``err``."""
    lines: list[tuple[float, str]] = []

    def read():
        for raw in p.stderr:
            err.write(raw)
            for part in raw.decode(errors="replace").replace("\r", "\n").splitlines():
                if part.strip():
                    lines.append((time.perf_counter() - t0, part.strip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with open(path, "w", encoding="utf-8") as f:
        while reader.is_alive():
            try:
                with open(f"/proc/{p.pid}/status", encoding="ascii") as st:
                    kb = {x.split(":")[0]: int(x.split()[1]) for x in st if x.startswith(("VmRSS:", "RssAnon:",
                                                                                        "RssFile:"))}
            except OSError:
                kb = {}  # exited
            while lines:
                t, line = lines.pop(0)
                f.write(f"{t:.2f} # {line}\n")
            f.write(f"{time.perf_counter() - t0:.2f} {kb.get('VmRSS', 0) / 1024:.0f} anon "
                    f"{kb.get('RssAnon', 0) / 1024:.0f} file {kb.get('RssFile', 0) / 1024:.0f}\n")
            f.flush()
            time.sleep(0.2)
        for t, line in lines:
            f.write(f"{t:.2f} # {line}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--keep", default=None, help="build (or reuse) the checkpoint in this folder, and keep it")
    ap.add_argument("--layers", type=int, default=40, help="the first N layers of the pattern (a smaller variant "
                    "for profiling; the target is stated for 40)")
    ap.add_argument("--trace", default=None, help="write the child's resident size every 0.2 s and its log lines, "
                    "timestamped, to this file (runs without --quiet; the last run's trace)")
    ap.add_argument("--compile_cache", default=None, help="the child's --compile_cache (DIR or off; default: the "
                    "command's own)")
    ap.add_argument("--build_only", default=None, help=argparse.SUPPRESS)  # the checkpoint's own process
    a = ap.parse_args()
    if a.build_only:
        build_checkpoint(a.build_only, layers=a.layers)
        return
    tmp = tempfile.mkdtemp(prefix="qjax-autoround-stream-")
    try:
        folder = a.keep or os.path.join(tmp, "model")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            t0 = time.perf_counter()
            # in a process of its own: a child's ru_maxrss starts at the resident size of the process it was forked
            # from (Linux records the old address space's high-water mark at exec), and building holds the whole
            # model — built here, it was the measured "peak" (4.1 GiB against 3.0 GiB sampled in the child)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--build_only", folder, "--layers",
                            str(a.layers)], check=True)
            print(f"built {folder} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        cfg = scaled_config(a.layers)
        calib = os.path.join(tmp, "calib.jsonl")
        write_calibration(calib, cfg.vocab_size, a.nsamples, a.seqlen)
        streams = 3 * a.nsamples * a.seqlen * cfg.hidden_size * 2
        limit = 0.4 * size + streams
        peaks, secs = [], []
        for r in range(a.runs):
            out = os.path.join(tmp, f"out{r}")
            args = ["--model", folder, "--dataset", calib, "--output_dir", out, *RECIPE, "--iters", str(a.iters),
                    "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen)]
            args += [] if a.trace else ["--quiet"]
            args += ["--compile_cache", a.compile_cache] if a.compile_cache else []
            peak, sec, tail = peak_rss([sys.executable, "-m", "qjax.cli", "quantize", *args], dict(os.environ),
                                       a.trace)
            peaks.append(peak)
            secs.append(sec)
            print(f"run {r + 1}: peak RSS {peak / 2**20:,.0f} MiB, {sec:.0f} s", file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)
        peak = statistics.median(peaks)
        shown = " ".join(shlex.quote(x) for x in ["qjax", "quantize", "--model", "<scaled>", *RECIPE, "--iters",
                                                  str(a.iters), "--nsamples", str(a.nsamples), "--seqlen",
                                                  str(a.seqlen)])
        print(f"checkpoint {size / 2**30:.2f} GiB ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-"
              f"{cfg.num_experts_per_tok}, MTP + vision); streams {streams / 2**20:.1f} MiB; limit 0.4 × checkpoint "
              f"+ streams = {limit / 2**20:,.0f} MiB")
        print("| date | machine | command | peak RSS (median of runs) | ratio to the limit |")
        print("|---|---|---|---|---|")
        print(f"| {datetime.date.today()} | {os.cpu_count()} cores, {cpu_name()} | `{shown}` | "
              f"{peak / 2**20:,.0f} MiB ({len(peaks)} run(s), {statistics.median(secs):.0f} s) | "
              f"{peak / limit:.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
