"""CPU prefill and decode throughput: qjax vs transformers (same machine, same run, same weights).

For each config a seeded transformers ``Qwen3_5MoeForCausalLM`` (torch.manual_seed(0), float32, eval) is saved with
``save_pretrained``; transformers reloads it (``attn_implementation="eager"``, ``experts_implementation="eager"``,
optionally also with its defaults, sdpa + grouped_mm) and ``qjax.load_model`` loads it; both run the same token ids.

Measured per config (fp32; ``mid`` also in bf16 unless ``--no-bf16``, with ``--bf16-new-tokens`` new tokens):

- prefill tok/s, ``1×512`` and ``4×128``: transformers ``model(ids, use_cache=True)`` under ``torch.no_grad``;
  qjax ``qjax.extend`` into a fresh cache (all positions' logits, like transformers).
- decode tok/s, batch 1 and 4, a 32-token prompt, N new tokens greedy (N = 64 by default): transformers
  ``generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)``, qjax ``qjax.generate(...,
  eos_token_id=[])``. decode time = generate time − prefill time of the same prompt (both forward the prompt once and
  then run N−1 single-token steps), decode tok/s = B·(N−1) / decode time.

Contenders of one measurement are timed interleaved (a, b, c, a, b, c, …) after one untimed warm-up call each with
the same shapes, so a burst of load from other processes hits all of them alike; each time is the median of
``--repeats`` runs (≥3 for a callable whose calls average over ``--slow-s`` seconds). qjax results are forced with
``jax.block_until_ready`` / ``np.asarray``; the first (compiling) call's excess over the steady-state median is
reported as qjax's compile time. torch runs with 2 threads. Sanity: qjax's greedy tokens must equal transformers'
for the tiny fp32 config (asserted, prints MATCH).

    python benchmarks/cpu_speed.py [--configs tiny,mid] [--repeats N] [--no-write]

Writes (replaces) the section ``## CPU: qjax vs transformers eager (issue 2)`` of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

SECTION = "## CPU: qjax vs transformers eager (issue 2)"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
TARGET = 3.0  # decode ≥ 3× transformers eager

LIN, FULL = "linear_attention", "full_attention"


# ---------------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------------
def config_dict(name: str) -> dict:
    if name == "tiny":
        return dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, initializer_range=0.1, tie_word_embeddings=False,
            max_position_embeddings=2048,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
    if name == "mid":
        return dict(
            vocab_size=8192, hidden_size=512, num_hidden_layers=8, layer_types=[LIN, LIN, LIN, FULL] * 2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
            shared_expert_intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=2048,
            # head_dim 64 × 0.25 → rotary dim 16 → 8 frequencies = sum(mrope_section)
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
    raise SystemExit(f"unknown config {name!r} (tiny, mid)")


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    median: float
    runs: list[float]
    first: float | None = None  # untimed-warm-up call's wall time (qjax: includes compilation)

    @property
    def compile_s(self) -> float | None:
        return None if self.first is None else max(self.first - self.median, 0.0)


def bench(fns: dict, repeats: int, slow_s: float = 1e9, min_repeats: int = 3) -> dict[str, Timing]:
    """Time several callables against each other: one warm-up call each (timed separately), then ``repeats``
    interleaved rounds (a, b, c, a, b, c, …) so that a burst of load from other processes hits every contender
    alike. A callable whose calls average over ``slow_s`` seconds stops after ``min_repeats`` rounds."""
    first, runs = {}, {k: [] for k in fns}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[k] = time.perf_counter() - t0
    for _ in range(repeats):
        for k, fn in fns.items():
            r = runs[k]
            if len(r) >= min_repeats and sum(r) / len(r) > slow_s:
                continue
            t0 = time.perf_counter()
            fn()
            r.append(time.perf_counter() - t0)
    return {k: Timing(statistics.median(r), r, first[k]) for k, r in runs.items()}


def cpu_steal() -> tuple[int, int] | None:
    """(steal, total) jiffies from /proc/stat: time the hypervisor gave this VM's CPUs to someone else."""
    try:
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return f[7], sum(f)
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Row:
    config: str
    dtype: str
    phase: str  # prefill | decode
    shape: str  # "B×T" (prefill) or "B×N (prompt P)" (decode)
    tokens: int  # tokens counted in tok/s
    qjax: Timing
    hf: Timing
    hf_default: Timing | None = None
    qjax_prefill: Timing | None = None  # decode rows: prompt prefill subtracted
    hf_prefill: Timing | None = None
    hf_default_prefill: Timing | None = None
    extra: dict = field(default_factory=dict)
    load: float | None = None  # 1-minute load average when the row finished (other processes' load shows here)

    def _time(self, t: Timing | None, p: Timing | None) -> float | None:
        if t is None:
            return None
        return t.median - (p.median if p is not None else 0.0)

    def tps(self, which: str) -> float | None:
        t = {"qjax": (self.qjax, self.qjax_prefill), "hf": (self.hf, self.hf_prefill),
             "hf_default": (self.hf_default, self.hf_default_prefill)}[which]
        dt = self._time(*t)
        if dt is None:
            return None
        return self.tokens / dt if dt > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------------------------------------
def run_config(name: str, dtypes: list[str], args, rows: list[Row], log) -> None:
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    import qjax

    cfg = config_dict(name)
    hf_config = Qwen3_5MoeTextConfig(**cfg)
    torch.manual_seed(0)
    hf_model = Qwen3_5MoeForCausalLM(hf_config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in hf_model.parameters())
    log(f"\n=== {name}: {n_params / 1e6:.2f}M parameters ===")

    with tempfile.TemporaryDirectory(prefix=f"qjax-bench-{name}-") as folder:
        hf_model.save_pretrained(folder)
        hf_model = None
        for dtype_name in dtypes:
            tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            jdtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
            hf = Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=tdtype, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
            impls = f"attn={hf.config._attn_implementation}, experts={hf.config._experts_implementation}"
            hf_def = None
            if args.hf_default and (dtype_name == "fp32" or args.hf_default_bf16):
                hf_def = Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=tdtype).eval()
                impls += (f"; default: attn={hf_def.config._attn_implementation}, "
                          f"experts={hf_def.config._experts_implementation}")
            t0 = time.perf_counter()
            model = qjax.load_model(folder, dtype=jdtype)
            log(f"--- {name} {dtype_name}: transformers {impls}; qjax load {time.perf_counter() - t0:.2f}s")
            rows_here = bench_model(name, dtype_name, hf, hf_def, model, cfg["vocab_size"], args, log)
            rows.extend(rows_here)
            del hf, hf_def, model
            jax.clear_caches()


def new_cache(model, batch: int, max_len: int):
    """An empty qjax generation cache (``model.init_cache`` where it exists, else ``Cache.init``)."""
    import qjax
    if hasattr(model, "init_cache"):
        return model.init_cache(batch, max_len)
    return qjax.Cache.init(model.config, batch, max_len, model.dtype)


def bench_model(name, dtype_name, hf, hf_def, model, vocab, args, log) -> list[Row]:
    import jax
    import torch

    import qjax

    rng = np.random.default_rng(0)
    rows: list[Row] = []
    reps, slow = args.repeats, args.slow_s

    def hf_prefill_fn(m, ids_t):
        def f():
            with torch.no_grad():
                return m(ids_t, use_cache=True).logits
        return f

    def qjax_prefill_fn(ids_j, max_len):
        def f():
            cache = new_cache(model, ids_j.shape[0], max_len)
            jax.block_until_ready(cache)
            logits, cache = qjax.extend(model, cache, ids_j)
            jax.block_until_ready((logits, cache))
            return logits
        return f

    # ---- prefill ----------------------------------------------------------------------------------------------------
    for b, t in ((1, 512), (4, 128)):
        ids = rng.integers(0, vocab, (b, t), dtype=np.int64)
        ids_t, ids_j = torch.from_numpy(ids), jax.numpy.asarray(ids, jax.numpy.int32)
        fns = {"qjax": qjax_prefill_fn(ids_j, t), "hf": hf_prefill_fn(hf, ids_t)}
        if hf_def is not None:
            fns["hf_default"] = hf_prefill_fn(hf_def, ids_t)
        tm = bench(fns, reps, slow)
        row = Row(name, dtype_name, "prefill", f"{b}×{t}", b * t, tm["qjax"], tm["hf"], tm.get("hf_default"))
        if dtype_name == "fp32":
            # same logits? (a cheap plausibility check, not a parity test)
            with torch.no_grad():
                ref = hf(ids_t).logits.float().numpy()
            got = np.asarray(fns["qjax"](), np.float32)
            row.extra["max abs Δlogits"] = float(np.max(np.abs(got - ref)))
        row.load = os.getloadavg()[0]
        rows.append(row)
        log(_fmt_row(row))

    # ---- decode -----------------------------------------------------------------------------------------------------
    n_new = args.new_tokens
    if name == "mid" and args.mid_new_tokens:
        n_new = args.mid_new_tokens
    if dtype_name == "bf16" and args.bf16_new_tokens:
        n_new = args.bf16_new_tokens
    p = args.prompt
    for b in (1, 4):
        ids = rng.integers(0, vocab, (b, p), dtype=np.int64)
        ids_t, ids_j = torch.from_numpy(ids), jax.numpy.asarray(ids, jax.numpy.int32)
        mask_t = torch.ones_like(ids_t)
        out = {}

        def qjax_gen():
            out["qjax"] = qjax.generate(model, ids_j, max_new_tokens=n_new, do_sample=False, eos_token_id=[])
            return out["qjax"]

        def hf_gen_fn(m, key):
            def f():
                with torch.no_grad():
                    out[key] = m.generate(ids_t, attention_mask=mask_t, max_new_tokens=n_new, min_new_tokens=n_new,
                                          do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
                return out[key]
            return f

        fns = {"qjax": qjax_gen, "qjax_p": qjax_prefill_fn(ids_j, p + n_new),
               "hf": hf_gen_fn(hf, "hf"), "hf_p": hf_prefill_fn(hf, ids_t)}
        if hf_def is not None:
            fns.update(hf_default=hf_gen_fn(hf_def, "hf_default"), hf_default_p=hf_prefill_fn(hf_def, ids_t))
        tm = bench(fns, reps, slow)
        row = Row(name, dtype_name, "decode", f"{b}×{n_new} (prompt {p})", b * (n_new - 1), tm["qjax"], tm["hf"],
                  tm.get("hf_default"), tm["qjax_p"], tm["hf_p"], tm.get("hf_default_p"))
        assert out["qjax"].shape == (b, p + n_new), out["qjax"].shape
        assert out["hf"].shape == (b, p + n_new), out["hf"].shape
        same = np.array_equal(out["qjax"], out["hf"])
        agree = float(np.mean(out["qjax"][:, p:] == out["hf"][:, p:]))
        first = float(np.mean(out["qjax"][:, p] == out["hf"][:, p]))
        row.extra["greedy"] = ("MATCH" if same else
                               f"differ (first token equal in {first:.0%} of rows, {agree:.0%} of all new tokens)")
        if name == "tiny" and dtype_name == "fp32":
            assert same, f"tiny fp32 greedy tokens differ: qjax {out['qjax'][:, p:]} vs transformers {out['hf'][:, p:]}"
            log("tiny fp32 greedy tokens qjax == transformers: MATCH")
        row.load = os.getloadavg()[0]
        rows.append(row)
        log(_fmt_row(row))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------------------
def _num(x: float | None, nd: int = 0) -> str:
    if x is None:
        return "–"
    if x != x:
        return "n/a"
    return f"{x:,.{nd}f}"


def _ratio(a, b) -> str:
    return "–" if a is None or b is None or not b > 0 else f"{a / b:.2f}×"


def _fmt_row(r: Row) -> str:
    s = (f"{r.config:4s} {r.dtype} {r.phase:7s} {r.shape:16s} qjax {_num(r.tps('qjax')):>9s} tok/s | "
         f"hf eager {_num(r.tps('hf')):>8s} tok/s | ratio {_ratio(r.tps('qjax'), r.tps('hf')):>7s}")
    if r.hf_default is not None:
        s += f" | hf default {_num(r.tps('hf_default'))} ({_ratio(r.tps('qjax'), r.tps('hf_default'))})"
    s += f" | qjax compile {r.qjax.compile_s:.1f}s"
    for k, v in r.extra.items():
        s += f" | {k} {v:.2e}" if isinstance(v, float) else f" | {k}: {v}"
    return s


def markdown(rows: list[Row], meta: dict, with_default: bool) -> str:
    lines = [SECTION, "",
             f"- date: {meta['date']}",
             f"- machine: {meta['cpu']}, {meta['cores']} cores (`nproc` {meta['nproc']}); "
             f"torch threads {meta['torch_threads']}",
             f"- command: `{meta['command']}`",
             f"- qjax: commit {meta['git']}",
             f"- thread env vars: {meta['env']}",
             f"- versions: jax {meta['jax']} (jaxlib {meta['jaxlib']}, backend {meta['backend']}), "
             f"flax {meta['flax']}, "
             f"torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}",
             f"- method: {meta['method']}",
             f"- target: **decode ≥ {TARGET:g}× transformers eager** (per decode row: MET / MISSED)",
             ""]
    head = ["config", "dtype", "phase", "batch×tokens", "qjax tok/s", "transformers eager tok/s", "qjax / eager"]
    if with_default:
        head += ["transformers sdpa+grouped_mm tok/s", "qjax / default"]
    head += ["qjax compile (s)", "target", "check"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        q, h = r.tps("qjax"), r.tps("hf")
        cells = [r.config, r.dtype, r.phase, r.shape, _num(q), _num(h), _ratio(q, h)]
        if with_default:
            cells += [_num(r.tps("hf_default")), _ratio(q, r.tps("hf_default"))]
        target = "–"
        if r.phase == "decode":
            if q is None or h is None or q != q or h != h:
                target = "n/a (decode time ≤ timing noise)"
            else:
                target = "MET" if q / h >= TARGET else "MISSED"
        check = "; ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.extra.items())
        cells += [f"{r.qjax.compile_s:.1f}", target, check]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("qjax compile: prefill rows `qjax.extend`; decode rows the first `qjax.generate` (prefill + decode "
                 "loop programs).")
    lines.append("")
    lines.append("Raw timings in seconds — median [min] over n runs; decode rows: generate − prompt prefill = decode, "
                 "and ms per decode step; load = 1-min load average when the row finished:")
    lines.append("")
    lines.append("```")

    def raw(t: Timing, p: Timing | None, steps: int) -> str:
        s = f"{t.median:.4f} [{min(t.runs):.4f}] n={len(t.runs)}"
        if p is not None:
            d = t.median - p.median
            s += f" − {p.median:.4f} [{min(p.runs):.4f}] = {d:.4f} ({1e3 * d / steps:.1f} ms/step)"
        return s

    for r in rows:
        steps = max(1, int(re.match(r"\d+×(\d+)", r.shape).group(1)) - 1) if r.phase == "decode" else 1
        lines.append(f"{r.config} {r.dtype} {r.phase} {r.shape} (load {r.load:.1f}):")
        lines.append(f"    qjax     {raw(r.qjax, r.qjax_prefill, steps)}")
        lines.append(f"    eager    {raw(r.hf, r.hf_prefill, steps)}")
        if r.hf_default is not None:
            lines.append(f"    default  {raw(r.hf_default, r.hf_default_prefill, steps)}")
    lines.append("```")
    if meta.get("notes"):
        lines += ["", *meta["notes"]]
    return "\n".join(lines) + "\n"


def write_section(text: str, path: str = RESULTS, section: str = SECTION) -> None:
    """Replace the section headed ``section`` (up to the next ``## `` heading) or append it; keep everything else."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if not old.strip():
        new = "# Benchmark results\n\n" + text
    else:
        pat = re.compile(r"^" + re.escape(section) + r"[ \t]*\n.*?(?=^## |\Z)", re.M | re.S)
        if pat.search(old):
            new = pat.sub(lambda _: text + "\n", old, count=1).rstrip("\n") + "\n"
        else:
            new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


def git_state() -> str:
    """Which qjax was measured: its folder, and when that is this repository's, the commit and whether the sources
    differ from it (uncommitted edits are measured too)."""
    import qjax
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.dirname(os.path.abspath(qjax.__file__))
    if os.path.commonpath([root, src]) != root:
        return f"imported from {src} (not this checkout)"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qjax", "kernels", "convert"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "this checkout (git unavailable)"
    return head + (f" + uncommitted changes in {len(dirty.splitlines())} qjax source files" if dirty else "")


def machine_meta(args) -> dict:
    import flax
    import jax
    import jaxlib
    import torch
    import transformers

    cpu, cores = platform.processor() or "?", "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = info.get("Model name", cpu)
        cores = info.get("CPU(s)", cores)
        if "Core(s) per socket" in info:
            cores += f" (cores/socket {info['Core(s) per socket']}, threads/core {info.get('Thread(s) per core', '?')})"
    except (OSError, subprocess.CalledProcessError):
        pass
    return dict(
        date=subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
        or datetime.datetime.now(datetime.timezone.utc).isoformat(),
        cpu=cpu, cores=cores, nproc=os.cpu_count(), torch_threads=torch.get_num_threads(),
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
        git=git_state(),
        env=", ".join(f"{k}={os.environ[k]!r}" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                         "XLA_FLAGS") if k in os.environ) or "none set",
        jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(), flax=flax.__version__,
        torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
        method=(f"median of {args.repeats} interleaved runs (qjax, transformers, … in turn; 3 when a call takes "
                f"> {args.slow_s:g}s) after one warm-up call each with the same shapes; prefill = transformers "
                f"`model(ids, use_cache=True)` vs `qjax.extend` into a fresh cache; decode = generate("
                f"{args.prompt}-token prompt, N new, greedy) − prefill of the prompt, tok/s = B·(N−1)/time; qjax "
                f"compile = first call − steady median; transformers eager = attn_implementation and "
                f"experts_implementation both \"eager\""),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid", help="comma-separated: tiny, mid")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    ap.add_argument("--no-bf16", action="store_true", help="skip the mid bf16 rows")
    ap.add_argument("--hf-default", action=argparse.BooleanOptionalAction, default=True,
                    help="also time transformers' defaults (sdpa + grouped_mm), fp32 rows")
    ap.add_argument("--hf-default-bf16", action="store_true", help="... and for the bf16 rows too")
    ap.add_argument("--prompt", type=int, default=32, help="decode prompt length")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode new tokens")
    ap.add_argument("--mid-new-tokens", type=int, default=0, help="new tokens for mid (0: --new-tokens)")
    ap.add_argument("--bf16-new-tokens", type=int, default=16, help="new tokens for bf16 rows (0: as fp32)")
    ap.add_argument("--slow-s", type=float, default=2.0,
                    help="a callable whose calls average over this many seconds gets only 3 timed runs")
    ap.add_argument("--openblas-threads", type=int, default=None,
                    help="set OPENBLAS_NUM_THREADS (jax's CPU LAPACK calls, e.g. the GDN triangular solve, run on "
                         "scipy's OpenBLAS); default: leave the environment alone")
    args = ap.parse_args(argv)
    if args.openblas_threads is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.openblas_threads)  # before jax/scipy load OpenBLAS

    import torch
    torch.set_num_threads(2)
    import transformers
    transformers.logging.set_verbosity_error()

    t_start, steal0, load0 = time.perf_counter(), cpu_steal(), os.getloadavg()
    rows: list[Row] = []
    log = lambda s: print(s, flush=True)
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        dtypes = ["fp32"] + (["bf16"] if name == "mid" and not args.no_bf16 else [])
        run_config(name, dtypes, args, rows, log)
    meta = machine_meta(args)
    steal1 = cpu_steal()
    contention = f"load average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}"
    if steal0 and steal1 and steal1[1] > steal0[1]:
        contention += f"; CPU steal during the run {100 * (steal1[0] - steal0[0]) / (steal1[1] - steal0[1]):.1f}%"
    notes = [f"Total benchmark wall time: {time.perf_counter() - t_start:.0f}s ({contention})."]
    busiest = max([load0[0], os.getloadavg()[0]] + [r.load for r in rows if r.load is not None])
    if busiest > (os.cpu_count() or 1) + 0.5:
        notes.append(f"**Warning: the machine was shared** (1-min load average up to {busiest:.1f} on "
                     f"{os.cpu_count()} CPUs while this ran): both implementations use 2 threads, and an "
                     "oversubscribed core can slow either by 10-100×; rerun on a quiet machine before trusting "
                     "absolute numbers.")
    tiny_dec = [r for r in rows if r.config == "tiny" and r.dtype == "fp32" and r.phase == "decode"]
    if tiny_dec:
        notes.append("Sanity: tiny fp32 greedy tokens, qjax vs transformers: "
                     + ("MATCH" if all(r.extra.get("greedy") == "MATCH" for r in tiny_dec) else "MISMATCH")
                     + " (asserted).")
    meta["notes"] = notes
    md = markdown(rows, meta, args.hf_default)
    print("\n" + md)
    if not args.no_write:
        write_section(md)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
