"""What hostile requests cost a live ``qjax serve`` (issue 52): the size, template and shutdown attacks of the issue,
against the built-in model on this host, with the server's resident memory and /health latency measured around
them.

    python benchmarks/serve_attacks.py            # prints the table
    python benchmarks/serve_attacks.py --write    # and appends it to benchmarks/RESULTS.md

Each row is the median of ``--repeats`` runs (the server is started once; SIGTERM ends it last). Measured from the
outside, as a client sees it: a request's wall time to its answer; /health's worst latency while the attack runs
(probed every 50 ms from another thread); VmRSS of the server process from /proc before the attacks, at their peak
(sampled every 20 ms) and 2.5 s after them (the memory release runs at most every 2 s).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import requests
from report import append, describe

KEY = "sk-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "qjax.cli", "serve", *args, "--port", "0", "--api-key", KEY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = None
    for line in proc.stdout:
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].strip()
            break
    if url is None:
        raise RuntimeError("qjax serve did not start")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    while requests.get(url + "/health", timeout=5).status_code != 200:
        time.sleep(0.2)
    return proc, url


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def attack(url: str, pid: int, requests_: list[tuple[str, dict]]) -> dict:
    """Send ``requests_`` at once; the worst /health latency meanwhile, each answer's status and the slowest wall
    time, RSS before / peak / 2.5 s after."""
    stop, health, peak = threading.Event(), [0.0], [0]

    def probe():
        while not stop.is_set():
            t = time.perf_counter()
            requests.get(url + "/health", timeout=120)
            health[0] = max(health[0], time.perf_counter() - t)
            time.sleep(0.05)

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.02)

    def send(item):
        path, body = item
        t = time.perf_counter()
        r = requests.post(url + path, json=body, headers=AUTH, timeout=600)
        return r.status_code, time.perf_counter() - t

    before = rss(pid)
    threads = [threading.Thread(target=probe), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    with concurrent.futures.ThreadPoolExecutor(len(requests_)) as pool:
        out = list(pool.map(send, requests_))
    stop.set()
    for t in threads:
        t.join()
    time.sleep(2.5)
    return {"status": sorted({s for s, _ in out}), "seconds": max(w for _, w in out), "health": health[0],
            "before": before, "peak": max(peak[0], before), "after": rss(pid)}


def shutdown(proc: subprocess.Popen, url: str, n: int = 64) -> dict:
    """``n`` requests in flight (half streaming), then SIGTERM: what each got, and the time to exit."""
    def one(i):
        stream = i % 2 == 0
        body = {"prompt": [5, 6, 7 + i % 50], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        r = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120, stream=stream)
        if not stream:
            return str(r.status_code)
        lines = [x for x in r.iter_lines() if x]
        return "stream+[DONE]" if lines and lines[-1] == b"data: [DONE]" else "stream cut"

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        time.sleep(1.0)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        got = [f.result() for f in futures]
        rc = proc.wait(120)
    return {"answers": {k: got.count(k) for k in sorted(set(got))}, "exit": rc, "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    from qjax.checkpoint.hub import default_model_dir

    proc, url = start([default_model_dir(), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                       "--max-num-batched-tokens", "256", "--trust-request-chat-template"])
    huge = "w " * (15 << 20)  # 30 MB of text
    chat = [{"role": "user", "content": "Hi"}]
    loops = ("{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}{% endfor %}"
             "{% endfor %}{% endfor %}")
    attacks = {
        "30 MB prompt (completions)": [("/v1/completions", {"prompt": huge})],
        "30 MB message (chat)": [("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})],
        "4 × 30 MB prompts at once": [("/v1/completions", {"prompt": huge})] * 4,
        "request template, 3 nested loops": [("/v1/chat/completions", {"messages": chat, "chat_template": loops})],
        "top_k = 2^63": [("/v1/completions", {"prompt": "x", "top_k": 2 ** 63})],
    }
    rows = []
    try:
        for name, reqs in attacks.items():
            runs = [attack(url, proc.pid, reqs) for _ in range(a.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "health", "before", "peak",
                                                                           "after")}
            rows.append((name, runs[0]["status"], med))
        down = shutdown(proc, url)
    finally:
        if proc.poll() is None:
            proc.kill()
    mib = lambda b: f"{b / (1 << 20):,.0f}"  # noqa: E731
    lines = [f"### Hostile requests against a live server (issue 52), {time.strftime('%Y-%m-%d')}", "",
             f"{describe()}; command: `python benchmarks/serve_attacks.py --repeats {a.repeats}`; the built-in "
             "model, float32, `--max-model-len 256 --max-num-seqs 8 --trust-request-chat-template` (so that a "
             "request's template runs, inside the budgets); medians of the repeats.", "",
             "| attack | answer | slowest answer (s) | worst /health (s) | RSS before / peak / after (MiB) |",
             "|---|---|---|---|---|"]
    for name, status, m in rows:
        lines.append(f"| {name} | {', '.join(map(str, status))} | {m['seconds']:.2f} | {m['health']:.3f} | "
                     f"{mib(m['before'])} / {mib(m['peak'])} / {mib(m['after'])} |")
    lines += ["", f"SIGTERM with 64 requests in flight (half streaming): answers {json.dumps(down['answers'])}, "
                  f"exit status {down['exit']} after {down['seconds']:.1f} s.", ""]
    text = "\n".join(lines)
    print(text)
    if a.write:
        append(text)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
