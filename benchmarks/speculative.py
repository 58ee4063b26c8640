"""MTP speculative decoding (issue 22): what the checkpoint's own head buys at batch 1, and what a verify round costs.

    python benchmarks/speculative.py                # CPU, → a RESULTS.md section
    python benchmarks/speculative.py --no-write     # print it only
    python benchmarks/speculative.py --cost-only --full --recipe w2w4 --dtype bfloat16   # the GPU rows (gpu/run.sh)

Two parts, one run:

1. **Acceptance and speed** on the built-in model (``qjax/assets/default``: its BF16 body and its trained MTP head,
   float32 on the CPU) and on its w2w4 AutoRound export (experts W2 g64, the rest W4 g128, ``mtp.*`` kept BF16 as the
   seeds keep it; made once with ``qjax.autoround.api.quantize_folder`` into ``~/.cache/qjax/bench`` keyed by the
   checkpoint's hash, then loaded like any folder). For each model: greedy batch-1 generation of ``--new-tokens``
   tokens after each of ``--prompts`` held-out prompts, without speculation and with k = 1 … 4 drafts, interleaved,
   the median of ``--repeats`` runs; the tokens must be identical. Tokens/s count the whole ``qjax.generate`` call
   (prompt prefill included, the same prompts for every contender).
2. **Cost of a round** relative to one decode step, at a warm ``--context``-token cache, batch 1: the main model's
   verify call of k + 1 tokens (per-token GDN states kept, then :meth:`Cache.accept`), and the whole round (verify +
   the head over the accepted tokens + k − 1 chained drafts). A round that costs c decode steps and emits L tokens on
   average speeds decoding up by at most L / c, on any device. Measured on the CPU-scaled Qwen3.6-35B-A3B config
   (1/8 width, 8 layers; random weights with a random head: acceptance means nothing there, cost does) and, with
   ``--full`` on the GPU, at full size (random weights, no head: the verify call only).
"""

from __future__ import annotations

import os

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)  # one XLA:CPU thread: steadier timings on a shared 2-core host

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from report import append, describe  # noqa: E402

SECTION = "## MTP speculative decoding: acceptance, speed, cost of a round (issue 22)"
KS = (1, 2, 3, 4)
W2W4 = dict(bits=4, group_size=128, layer_config={".*experts.*": {"bits": 2, "group_size": 64}})


# ---------------------------------------------------------------------------------------------------------------------
# part 1: acceptance and speed on a real model
# ---------------------------------------------------------------------------------------------------------------------
def heldout_prompts(folder: str, n: int, tokens: int) -> list[np.ndarray]:
    """``n`` prompts of ``tokens`` tokens, spread evenly over the folder's ``heldout.txt``."""
    from qjax.autoround.data import load_tokenizer

    with open(os.path.join(folder, "heldout.txt"), encoding="utf-8") as f:
        ids = np.asarray(load_tokenizer(folder).encode(f.read()).ids, np.int32)
    starts = np.linspace(0, ids.size - tokens - 1, n).astype(int)
    return [ids[s:s + tokens] for s in starts]


def w2w4_export(folder: str, iters: int) -> str:
    """The built-in model's w2w4 AutoRound export, made once per checkpoint (its hash names the cache folder)."""
    from qjax.autoround.api import quantize_folder
    from qjax.autoround.driver import AutoRoundConfig

    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    out = os.path.join(os.path.expanduser("~/.cache/qjax/bench"), f"default-{digest}-w2w4-autoround-{iters}-128x256")
    if not os.path.isfile(os.path.join(out, "config.json")):
        print(f"quantizing the built-in model to w2w4 (AutoRound, {iters} iters) → {out}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        # calibration as benchmarks/quality.py: 128 windows of 256 tokens of calib.txt, batch 8
        quantize_folder(folder, out, AutoRoundConfig(**W2W4, iters=iters, nsamples=128, seqlen=256, batch_size=8),
                        dataset=os.path.join(folder, "calib.txt"))
        print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def acceptance_rows(model, prompts: list[np.ndarray], new_tokens: int, ks, repeats: int) -> list[dict]:
    """Per contender (plain, then k = …): median seconds over the prompts' generate calls, tokens/s, acceptance."""
    import qjax
    from qjax.runtime.speculative import SpeculativeStats

    kw = dict(max_new_tokens=new_tokens, eos_token_id=[], do_sample=False)
    contenders = {"plain": None, **{f"k={k}": k for k in ks}}
    times = {name: [] for name in contenders}
    stats = {name: SpeculativeStats(num_speculative_tokens=k) for name, k in contenders.items() if k}
    want = [qjax.generate(model, p[None], **kw) for p in prompts]  # also compiles the plain programs
    for name, k in contenders.items():  # compile, and check the tokens once
        if k:
            for p, w in zip(prompts, want):
                got, st = qjax.generate(model, p[None], speculative="mtp", num_speculative_tokens=k,
                                        return_stats=True, **kw)
                if not np.array_equal(got, w):
                    raise SystemExit(f"{name}: speculative tokens differ from plain greedy decoding")
                for field in ("rounds", "row_rounds", "emitted"):
                    setattr(stats[name], field, getattr(stats[name], field) + getattr(st, field))
                stats[name].accepted_at = [a + b for a, b in zip(stats[name].accepted_at, st.accepted_at)]
    for _ in range(repeats):  # interleaved: machine load hits every contender alike
        for name, k in contenders.items():
            extra = dict(speculative="mtp", num_speculative_tokens=k) if k else {}
            t0 = time.perf_counter()
            for p in prompts:
                qjax.generate(model, p[None], **kw, **extra)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    rows = []
    for name, k in contenders.items():
        s = statistics.median(times[name])
        rows.append(dict(name=name, k=k, s=s, tok_s=len(prompts) * new_tokens / s, speedup=base / s,
                         mean_len=stats[name].mean_accepted_length if k else 1.0,
                         per_pos=stats[name].acceptance_per_position if k else []))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# part 2: the cost of a round
# ---------------------------------------------------------------------------------------------------------------------
def round_cost(model, ks, context: int, steps: int, repeats: int) -> list[dict]:
    """Seconds per decode step, per verify call of k + 1 tokens, and per whole round (verify + head), batch 1 at a
    ``context``-token cache; each timed call runs ``steps`` of them in one program."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qjax.runtime import speculative as S
    from qjax.runtime.generate import prefill
    from qjax.runtime.sampling import SamplingArrays

    graphdef, state = nnx.split(model)
    cfg = model.config
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, context)), jnp.int32)
    greedy = SamplingArrays.zeros(1)

    # one jitted call per step, as speculative generation dispatches its rounds (a fori_loop of steps in one program
    # measured 2× slower per step here: the loop carries the whole cache)
    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
    def decode(graphdef, state, cache, tok):
        out = nnx.merge(graphdef, state).forward(tok[:, None], cache=cache)
        return out.cache, jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)

    @functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(2,))
    def verify(graphdef, state, cache, tok, k):
        out = nnx.merge(graphdef, state).forward(jnp.broadcast_to(tok[:, None], (1, k + 1)), cache=cache,
                                                 keep_steps=True)
        g = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        return out.cache.accept(jnp.full((1,), k + 1, jnp.int32)), g[:, -1]

    def steps_of(call, cache, tok):
        for _ in range(steps):
            cache, tok = call(cache, tok)
        return tok

    def warm(k):
        cache = model.init_cache(1, context + steps * (k + 1) + 2 * k + 2, spec_tokens=k + 1 if k else 0)
        _, cache = prefill(graphdef, state, cache, ids, jnp.ones_like(ids))
        return jax.block_until_ready(cache)

    def timed(call, k):
        tok = jnp.zeros((1,), jnp.int32)
        steps_of(call, warm(k), tok)  # compile
        ts = []
        for _ in range(repeats):
            cache = warm(k)
            t0 = time.perf_counter()
            jax.block_until_ready(steps_of(call, cache, tok))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / steps

    step = timed(lambda c, t: decode(graphdef, state, c, t), 0)
    rows = [dict(k=0, what="decode step", s=step, ratio=1.0)]
    for k in ks:
        rows.append(dict(k=k, what=f"verify {k + 1} tokens", ratio=None,
                         s=timed(lambda c, t, k=k: verify(graphdef, state, c, t, k), k)))
        if model.mtp is not None:
            def one_round(k=k):
                size = context + steps * (k + 1) + 2 * k + 2
                return S.prefill(graphdef, state, model.init_cache(1, size, spec_tokens=k + 1),
                                 model.init_mtp_cache(1, size), ids, jnp.ones_like(ids), S.row_keys(0, 1), greedy, k)

            def rounds(args, k=k):
                last, drafts, cache, mtp_cache, keys = args
                for _ in range(steps):
                    g, consumed, drafts, cache, mtp_cache, keys = S.verify_round(graphdef, state, cache, mtp_cache,
                                                                                last, drafts, keys, greedy)
                    last = jnp.take_along_axis(g, consumed[:, None] - 1, axis=1)[:, 0]
                return last

            rounds(one_round())  # compile
            ts = []
            for _ in range(repeats):
                args = jax.block_until_ready(one_round())
                t0 = time.perf_counter()
                jax.block_until_ready(rounds(args))
                ts.append(time.perf_counter() - t0)
            rows.append(dict(k=k, what=f"round k={k} (verify + head)", s=statistics.median(ts) / steps, ratio=None))
    for r in rows:
        r["ratio"] = r["s"] / step
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------
def acceptance_table(title: str, rows: list[dict], cost: dict[int, float] | None) -> list[str]:
    lines = [f"**{title}**", "", "| decoding | mean accepted length | acceptance per draft position | s (median) | "
             "tok/s | × plain |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        per = " / ".join(f"{x:.2f}" for x in r["per_pos"]) or "—"
        lines.append(f"| {r['name']} | {r['mean_len']:.2f} | {per} | {r['s']:.2f} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f} |")
    return lines + [""]


def cost_table(title: str, rows: list[dict]) -> list[str]:
    lines = [f"**{title}**", "", "| call | ms | × decode step |", "|---|---:|---:|"]
    lines += [f"| {r['what']} | {r['s'] * 1e3:.2f} | {r['ratio']:.2f} |" for r in rows]
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="AutoRound iterations of the w2w4 export")
    ap.add_argument("--context", type=int, default=512, help="cache length for the cost of a round")
    ap.add_argument("--steps", type=int, default=8, help="decode steps / rounds per timed program")
    ap.add_argument("--cost-only", action="store_true", help="only part 2")
    ap.add_argument("--full", action="store_true", help="part 2 at full size (the GPU)")
    ap.add_argument("--recipe", default="bf16", help="part 2 with --full: the random model's recipe")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    import qjax
    from qjax.checkpoint.hub import default_model_dir
    from qjax.runtime.bench import load_config
    from qjax.runtime.random_model import random_model

    dtype = jnp.dtype(a.dtype)
    cmd = "python benchmarks/speculative.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [SECTION, "", f"- date: {datetime.date.today().isoformat()}; {describe()}", f"- command: `{cmd.strip()}`",
             f"- part 1: {a.prompts} held-out prompts × {a.prompt_tokens} tokens, {a.new_tokens} new tokens each, "
             f"greedy, batch 1, float32; median of {a.repeats} interleaved runs; speculative tokens checked identical "
             "to plain greedy decoding",
             f"- part 2: batch 1, {a.context}-token cache, {a.steps} calls per timed program, median of {a.repeats}",
             ""]
    print("\n".join(lines), flush=True)

    def emit(more: list[str]):
        print("\n".join(more), flush=True)
        lines.extend(more)

    if not a.cost_only:
        folder = default_model_dir()
        prompts = heldout_prompts(folder, a.prompts, a.prompt_tokens)
        body = qjax.load_model(folder, dtype=jnp.float32)
        if body.mtp is None:
            raise SystemExit(f"{folder} has no mtp.* head: train it first (benchmarks/train_mtp_head.py)")
        best = {}
        for title, model in (("built-in model, BF16 weights (float32 compute)", body),
                             (f"its w2w4 AutoRound export ({a.iters} iters), MTP head BF16",
                              qjax.load_model(w2w4_export(folder, a.iters), dtype=jnp.float32))):
            rows = acceptance_rows(model, prompts, a.new_tokens, KS, a.repeats)
            emit(acceptance_table(title, rows, None))
            best[title] = rows
        (b_title, b_rows), (q_title, q_rows) = best.items()
        top = max(b_rows[1:], key=lambda r: r["speedup"])
        emit([f"- best k on the built-in model: {top['name']}, {top['speedup']:.2f}× plain decoding "
              f"({'met' if top['speedup'] >= 1.6 else 'MISSED'}; target ≥ 1.6×)"])
        gaps = [abs(q["mean_len"] - b["mean_len"]) / b["mean_len"] for b, q in zip(b_rows[1:], q_rows[1:])]
        emit([f"- w2w4 body vs BF16 body, mean accepted length: largest relative gap {max(gaps):.1%} over k = 1…4 "
              f"({'met' if max(gaps) <= 0.10 else 'MISSED'}; target within 10 %)", ""])
        emit(cost_table("cost of a round, built-in model (float32)", round_cost(body, KS, a.context, a.steps,
                                                                                   a.repeats)))

    if a.full:
        cfg = load_config()
        model = random_model(cfg, a.recipe, dtype=dtype)
        title = f"cost of a verify call, full-size Qwen3.6-35B-A3B, random weights, {a.recipe}, {a.dtype}"
    else:
        cfg = load_config(scale=8, layers=8)
        model = qjax.init_model(cfg, dtype=dtype, with_mtp=True)
        title = f"cost of a round, CPU-scaled Qwen3.6-35B-A3B (1/8 width, 8 layers), random weights + head, {a.dtype}"
    emit(cost_table(title, round_cost(model, KS, a.context, a.steps, a.repeats)))
    if not a.no_write:
        append("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
