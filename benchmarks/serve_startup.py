"""Server start-up (issue 48): how long ``qjax serve`` takes from launch to the port bound and to ready (``/health``
200), cold (an empty compile cache) and warm (the same cache again), and where a cold start goes program by program.

    python benchmarks/serve_startup.py                       # every case below, 3 runs each → RESULTS.md
    python benchmarks/serve_startup.py --cases builtin,mesh --runs 1 --no-write
    python benchmarks/serve.py --startup                     # the same

Cases (each a real ``qjax serve`` process, as a user starts it; nothing downloaded):

- ``builtin`` — ``qjax serve`` with no model: the built-in model, default flags;
- ``w2w4`` — its seed-000-style export (``qjax quantize --iters 0 --disable_opt_rtn``, INT2 g64 experts + INT4 g128
  rest), made once in a temporary folder;
- ``mtp`` — the built-in model with ``--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'``;
- ``images`` — a tiny composite model with a random vision tower (tests/oracles' ``write_vl_checkpoint``: needs the
  test extras' torch), ``--limit-mm-per-prompt '{"image": 2}'``;
- ``mesh`` — the built-in model with seed 003's flags ``--tensor-parallel-size 2 --data-parallel-size 2
  --enable-expert-parallel`` on 4 emulated CPU devices.

Measured from ``Popen``: ``bound`` = the "listening on" line (the port accepts connections from then on), ``ready`` =
the first ``/health`` 200 (polled every 0.1 s). Per program, the server's own stderr line: seconds, split into trace,
lowering and XLA compile (JAX's compile events) — in a warm run, the compile cache's load. Cold = a fresh
``--compile-cache`` folder; warm = a second start on that folder. Median of ``--runs`` (each cold run its own fresh
folder). Targets on this 2-core host: built-in ready ≤ 60 s cold, ≤ 10 s warm; mesh ≤ 180 s cold.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import requests
from cpu_speed import RESULTS, write_section
from report import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Server start-up: time to ready, cold and warm (issue 48)"
CASES = ("builtin", "w2w4", "mtp", "images", "mesh")
TARGETS = {"builtin": (60.0, 10.0), "mesh": (180.0, None)}  # (cold, warm) seconds to ready
PROGRAM = re.compile(r"compiled (\d+)/(\d+) (.*) in ([\d.]+) s \(trace ([\d.]+), lower ([\d.]+), "
                     r"(XLA|from the compile cache) ([\d.]+) s\)")
MESH_FLAGS = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--enable-expert-parallel"]


def case_args(name: str, tmp: str) -> tuple[list[str], dict[str, str]]:
    """``qjax serve`` arguments and extra environment of a case (its model made here when it needs one)."""
    if name == "builtin":
        return [], {}
    if name == "mtp":
        return ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'], {}
    if name == "mesh":
        flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
        return MESH_FLAGS, {"XLA_FLAGS": flags}
    if name == "w2w4":
        out = os.path.join(tmp, "w2w4")
        if not os.path.isdir(out):
            subprocess.run([sys.executable, "-m", "qjax.cli", "quantize", "--iters", "0", "--disable_opt_rtn",
                            "--bits", "4", "--group_size", "128", "--layer_config",
                            '{".*experts.*": {"bits": 2, "group_size": 64}}', "--output_dir", out, "--quiet"],
                           check=True, capture_output=True, text=True)
        return [out], {}
    if name == "images":
        out = os.path.join(tmp, "vl")
        if not os.path.isdir(out):
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from oracles.hf import write_vl_checkpoint  # the test extras' torch builds it

            write_vl_checkpoint(out)
        return [out, "--limit-mm-per-prompt", '{"image": 2, "video": 0}'], {}
    raise SystemExit(f"unknown case {name!r} (known: {', '.join(CASES)})")


def start_once(args: list[str], env: dict[str, str], cache: str, timeout: float) -> dict:
    """One ``qjax serve`` start: seconds to bound and to ready, the programs' lines; the server is then stopped."""
    cmd = [sys.executable, "-m", "qjax.cli", "serve", *args, "--port", "0", "--compile-cache", cache]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        url = None
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].strip()
                break
        if url is None:
            raise RuntimeError("qjax serve did not start: " + "".join(err)[-2000:])
        bound = time.perf_counter() - t0
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        while True:
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"not ready after {timeout:.0f} s")
            if proc.poll() is not None:
                raise RuntimeError("qjax serve exited: " + "".join(err)[-2000:])
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        ready = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    programs = []
    for line in err:
        m = PROGRAM.search(line)
        if m:
            programs.append(dict(what=m.group(3), seconds=float(m.group(4)), trace=float(m.group(5)),
                                 lower=float(m.group(6)), xla=float(m.group(8)), cached=m.group(7) != "XLA"))
    return dict(bound=bound, ready=ready, programs=programs)


def run_case(name: str, tmp: str, runs: int, timeout: float) -> dict:
    args, env = case_args(name, tmp)
    cold, warm = [], []
    for r in range(runs):
        cache = tempfile.mkdtemp(prefix=f"cache-{name}-{r}-", dir=tmp)
        try:
            cold.append(start_once(args, env, cache, timeout))
            warm.append(start_once(args, env, cache, timeout))
        except RuntimeError as e:  # a start that fails is a row of the table too (its last error line)
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:] or [str(e)]
            print(f"{name} run {r + 1}: failed: {last[0][:300]}", flush=True)
            return dict(name=name, args=args, env=env, cold=[], warm=[], failed=last[0][:300])
        print(f"{name} run {r + 1}: cold bound {cold[-1]['bound']:.1f} s ready {cold[-1]['ready']:.1f} s, "
              f"warm ready {warm[-1]['ready']:.1f} s ({len(cold[-1]['programs'])} programs)", flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    return dict(name=name, args=args, env=env, cold=cold, warm=warm)


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def section(results: list[dict], argv: list[str]) -> str:
    lines = [SECTION, "",
             "| case | flags | runs | programs | cold: port bound (s) | cold: ready (s) | warm: ready (s) | of which "
             "compiling, cold / warm (s) | target (cold / warm) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if r.get("failed"):
            flags = " ".join(a if " " not in a else f"'{a}'" for a in r["args"]).replace("|", "\\|")
            lines.append(f"| {r['name']} | `{flags}` | 1 | - | - | failed | - | - | {r['failed']} |")
            continue
        n = len(r["cold"][0]["programs"])
        comp_cold = statistics.median(sum(p["seconds"] for p in c["programs"]) for c in r["cold"])
        comp_warm = statistics.median(sum(p["seconds"] for p in w["programs"]) for w in r["warm"])
        cold, warm = _med(r["cold"], "ready"), _med(r["warm"], "ready")
        target = TARGETS.get(r["name"])
        if target is None:
            verdict = "-"
        else:
            parts = [f"≤ {target[0]:.0f} s cold: {'met' if cold <= target[0] else 'missed'}"]
            if target[1] is not None:
                parts.append(f"≤ {target[1]:.0f} s warm: {'met' if warm <= target[1] else 'missed'}")
            verdict = "; ".join(parts)
        flags = " ".join(a if " " not in a else f"'{a}'" for a in r["args"]).replace("|", "\\|")
        flags = re.sub(r"/tmp\S*/(w2w4|vl)", r"<\1 export>", flags) or "(none)"
        lines.append(f"| {r['name']} | `{flags}` | {len(r['cold'])} | {n} | {_med(r['cold'], 'bound'):.1f} | "
                     f"{cold:.1f} | {warm:.1f} | "
                     f"{comp_cold:.1f} / {comp_warm:.1f} | {verdict} |")
    lines += ["", "Where a cold start goes, per program (the first cold run; seconds; trace / lowering / XLA compile "
              "from JAX's compile events):", ""]
    for r in results:
        if r.get("failed"):
            continue
        progs = r["cold"][0]["programs"]
        tot = {k: sum(p[k] for p in progs) for k in ("seconds", "trace", "lower", "xla")}
        lines.append(f"- **{r['name']}** ({len(progs)} programs, {tot['seconds']:.1f} s: trace {tot['trace']:.1f}, "
                     f"lower {tot['lower']:.1f}, XLA {tot['xla']:.1f}, the rest running them once): "
                     + "; ".join(f"{p['what']} {p['seconds']:.1f} ({p['trace']:.1f}/{p['lower']:.1f}/{p['xla']:.1f})"
                                 for p in sorted(progs, key=lambda p: -p["seconds"])))
    lines += ["",
              f"- date: {datetime.date.today()}; {describe()}",
              f"- command: `{' '.join(['python benchmarks/serve_startup.py', *argv])}`",
              f"- method: {' '.join(next(t for t in __doc__.split(chr(10) * 2) if t.startswith('Measured')).split())}",
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--runs", type=int, default=3, help="cold + warm start pairs per case (median)")
    p.add_argument("--runs-for", default="", metavar="CASE=N,...", help="another number of runs for some cases")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take before it is abandoned")
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qjax-startup-") as tmp:
        runs = {c: int(n) for c, n in (x.split("=") for x in a.runs_for.split(",") if x)}
        results = [run_case(name, tmp, runs.get(name, a.runs), a.timeout) for name in a.cases.split(",") if name]
    text = section(results, argv)
    print(text)
    if not a.no_write:
        write_section(text, RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
