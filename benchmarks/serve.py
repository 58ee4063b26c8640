"""Serving speed: the continuous-batching engine under C concurrent clients vs the same requests one after another
with ``qjax.generate``, measured in the same run (issue 17).

    python benchmarks/serve.py                                   # built-in model + CPU-scaled 35B, C = 1, 8, 32
    python benchmarks/serve.py --model scale8 --recipe w2w4 --write   # one model; append the table to RESULTS.md
    python benchmarks/serve.py --model full --recipe w2w4 --dtype bfloat16 --prompt 512 --output 128   # H200
    python benchmarks/serve.py --startup [serve_startup.py's flags]   # start-up: time to ready, cold and warm

Workload: ``--requests`` requests (default 2·C, at least 16), each a random ``--prompt``-token prompt and exactly
``--output`` greedy tokens (eos ignored). Clients are closed loops: each of the C clients sends its next request
when its last one finished. Measured per request on the engine's callbacks (no HTTP): time to first token (TTFT,
from submission), the gaps between its tokens (ITL; the engine hands out up to ``--num-scheduler-steps`` tokens per
device call, so gaps inside a call are ~0); output tokens/s = all output tokens ÷ wall time. Baseline in the same
process: ``qjax.generate`` on each request in turn (tokens/s), and its own batch-1 decode speed
(tokens/s of ``generate(N)`` − ``generate(1)``). Median of ``--repeats`` timed runs after one warm-up run per
concurrency (compiles). Targets: at C = 32, ≥ 6× the sequential tokens/s; at C = 1, decode speed (1 ÷ mean ITL)
within 10 % of generate's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time

import numpy as np
from report import append, describe


def make_model(kind: str, recipe: str, dtype: str):
    import jax.numpy as jnp

    import qjax
    from qjax.checkpoint.hub import default_model_dir
    from qjax.runtime.bench import load_config
    from qjax.runtime.random_model import random_model

    if kind == "builtin":
        return qjax.load_model(default_model_dir(), dtype=jnp.dtype(dtype)), f"built-in model ({dtype})"
    cfg = load_config(None, scale=8, layers=8) if kind == "scale8" else load_config(None)
    name = "Qwen3.6-35B-A3B shapes" + (" ÷ 8 (8 layers)" if kind == "scale8" else "")
    return random_model(cfg, recipe, dtype=jnp.dtype(dtype)), f"{name}, random weights, {recipe}, {dtype}"


def workload(vocab: int, n: int, prompt: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, prompt).tolist() for _ in range(n)]


def sequential(model, prompts: list[list[int]], output: int) -> float:
    """Seconds for ``qjax.generate`` on each prompt in turn."""
    import qjax

    t0 = time.perf_counter()
    for p in prompts:
        qjax.generate(model, np.asarray([p]), max_new_tokens=output, do_sample=False, eos_token_id=[])
    return time.perf_counter() - t0


def generate_decode_rate(model, prompt: list[int], output: int, repeats: int) -> float:
    """qjax.generate's own batch-1 decode tokens/s: (time of N tokens − time of 1) ÷ (N − 1)."""
    import qjax

    ids = np.asarray([prompt])

    def t(n):
        qjax.generate(model, ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            qjax.generate(model, ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return (output - 1) / (t(output) - t(1))


def serve(engine, prompts: list[list[int]], output: int, concurrency: int) -> dict:
    """Closed-loop clients against a started engine; per-request token timestamps."""
    from qjax.serving import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    records: list[dict] = []

    def client():
        while True:
            with lock:
                if not queue:
                    return
                i, p = queue.pop(0)
            done = threading.Event()
            rec = {"submit": time.perf_counter(), "times": []}

            def cb(out, rec=rec, done=done):
                now = time.perf_counter()
                rec["times"] += [now] * len(out.new_token_ids)
                if out.finished:
                    done.set()

            engine.add_request(f"bench-{i}-{rec['submit']}", p, params, cb)
            done.wait()
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["times"][0] - r["submit"] for r in records]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    decode = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in records if len(r["times"]) > 1]
    return {"wall": wall, "tokens": sum(len(r["times"]) for r in records), "ttft": ttft, "itl": itl,
            "decode_rate": statistics.median(decode)}


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def bench(kind: str, a) -> dict:
    from qjax.serving import Engine, EngineConfig

    model, title = make_model(kind, a.recipe, a.dtype)
    cmax = max(a.concurrency)
    max_len = -(-(a.prompt + a.output) // 64) * 64
    engine = Engine(model, EngineConfig(max_num_seqs=cmax, max_model_len=max_len,
                                        max_num_batched_tokens=a.batched_tokens, decode_steps=a.steps))
    engine.warmup()
    engine.start()
    rows = []
    base_prompts = workload(model.config.vocab_size, max(16, 2 * cmax), a.prompt, 0)
    sequential(model, base_prompts[:1], a.output)  # compile generate's programs
    gen_rate = generate_decode_rate(model, base_prompts[0], a.output, a.repeats)
    for c in a.concurrency:
        n = a.requests or max(16, 2 * c)
        prompts = workload(model.config.vocab_size, n, a.prompt, c)
        serve(engine, prompts, a.output, c)  # warm-up: every bucket this concurrency reaches is compiled
        runs = [serve(engine, prompts, a.output, c) for _ in range(a.repeats)]
        seq = [sequential(model, prompts, a.output) for _ in range(a.repeats)]
        tps = statistics.median(r["tokens"] / r["wall"] for r in runs)
        seq_tps = n * a.output / statistics.median(seq)
        best = sorted(runs, key=lambda r: r["tokens"] / r["wall"])[len(runs) // 2]
        rows.append({"concurrency": c, "requests": n, "tok_s": tps, "sequential_tok_s": seq_tps,
                     "ratio": tps / seq_tps, "ttft_p50": pct(best["ttft"], 50), "ttft_p99": pct(best["ttft"], 99),
                     "itl_p50": pct(best["itl"], 50), "itl_p99": pct(best["itl"], 99),
                     "decode_rate": statistics.median(r["decode_rate"] for r in runs), "generate_decode": gen_rate})
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    return {"model": title, "rows": rows, "programs": len(engine.compiled)}


def table(res: dict, a) -> str:
    lines = [f"**{res['model']}** — prompt {a.prompt}, output {a.output} tokens (greedy, eos ignored), "
             f"{res['programs']} engine programs compiled",
             "",
             "| C | requests | serve tok/s | sequential generate tok/s | × sequential | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | decode tok/s per request | generate decode tok/s (B=1) | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        check = ""
        if r["concurrency"] == 32:
            check = f"target ≥ 6×: {'met' if r['ratio'] >= 6 else 'MISSED'}"
        if r["concurrency"] == 1:
            rel = r["decode_rate"] / r["generate_decode"]
            check = f"decode {rel:.2f}× generate's (target ≥ 0.90: {'met' if rel >= 0.9 else 'MISSED'})"
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['tok_s']:.0f} | {r['sequential_tok_s']:.0f} | "
                     f"{r['ratio']:.2f} | {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} | "
                     f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} | {r['decode_rate']:.0f} | "
                     f"{r['generate_decode']:.0f} | {check} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--startup"]:  # the start-up table: its own script (a real ``qjax serve`` per start)
        import serve_startup

        return serve_startup.main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin,scale8", help="builtin, scale8, full (comma-separated)")
    p.add_argument("--recipe", default="w2w4", help="recipe of the random-weight models")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="--num-scheduler-steps")
    p.add_argument("--batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    from qjax import xla_env

    xla_env.apply(single_threaded=True)

    results = [bench(kind, a) for kind in a.model.split(",")]
    head = (f"## Serving (issue 17): engine vs sequential qjax.generate\n\n"
            f"- date: {datetime.date.today()}, {describe()}\n"
            f"- command: `python benchmarks/serve.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
            f"- method: {' '.join(__doc__.split(chr(10) + chr(10))[2].split())}\n")
    text = head + "\n" + "\n\n".join(table(r, a) for r in results) + "\n"
    print(text)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    if a.write:
        append(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
