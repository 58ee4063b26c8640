"""AutoRound side by side: auto-round 0.16.1 (PyTorch, CPU) and qjax.autoround on the same model, data and options.

Models (``--config``):
- ``default``: the built-in trained model (qjax/assets/default: hidden 256, 8 layers, 4 experts top-2), with
  consecutive ``seqlen + 48``-token windows of its calib.txt as a JSON list of documents; W4A16 g64 + int2 g64
  experts (g64 because its intermediate size is 64); held-out yardstick: 8 × 256 tokens of its heldout.txt.
- ``mid``: a seeded random transformers ``Qwen3_5MoeForCausalLM`` of cpu_speed.py's ``mid`` config (hidden 512,
  8 layers [lin, lin, lin, full] × 2, 32 experts top-4, expert/shared intermediate 256; docs/autoround.md's anchor),
  bf16, word-level tokenizer, random Zipf-word documents; W4A16 g128 + int2 g64 experts (seed 000's recipe).
Both tools read the same JSON file with the same ``iters``, ``nsamples``, ``seqlen``, ``batch_size`` (defaults:
docs/autoround.md's anchor, 50 / 32 / 256 / 8) and write llm_compressor folders.

auto-round runs eager: its default torch.compile path on CPU (torch 2.13 inductor) logs NaN for every block's loss on
this architecture, so it cannot be the baseline.

Reported per block: wall time (auto-round: between its successive "loss iter 0 … -> iter k …" log lines; qjax: its
own block reports, compile included in the first block of each kind) and the block's loss at iteration 0 (RTN) and
its best loss — both tools log the same quantity, token-masked MSE / valid tokens of that iteration's minibatch.
Also: total wall time of each ``quantize`` call (model load and export excluded for both), and as a common
yardstick the final-logit MSE of each quantized model against the bf16 model on held-out ids (qjax loads both
folders, so the same code scores them).

Repeats (``--repeats N``) interleave the tools and give repeat r the seed ``--seed + r`` in both (the minibatch
order): times are medians over the repeats; the best-loss comparison and the held-out scores cover every seed (one
seed's block-by-block comparison is largely chance: each tool draws its own minibatches).

qjax runs twice per repeat, each in a fresh process sharing one persistent compilation cache (with the traced
programs kept beside it): first cold (an empty cache: every tuning step is traced and compiled), then warm (the steps
load from the cache), as ``qjax quantize`` runs by default.

Target (issues 5, 24): qjax ≤ 0.5× auto-round's time per block, cold and warm, with equal or lower loss.

    python benchmarks/autoround.py [--iters 50 --nsamples 32 --seqlen 256 --batch-size 8] [--repeats 1] [--no-write]

Writes (replaces) the section ``## AutoRound: qjax vs auto-round (issue 5)`` of ``benchmarks/RESULTS.md`` (other
configs: ``## AutoRound: qjax vs auto-round, `mid` config (issue 24)``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import RESULTS, config_dict, write_section  # noqa: E402

SECTION = "## AutoRound: qjax vs auto-round (issue 5)"
MODEL_TEXT = {"default": "the built-in trained model (qjax/assets/default, bf16), calibration windows of its calib.txt"}
TARGET = 0.5
RECIPES = {  # config → (group size of the 4-bit layers, group size of the 2-bit experts): groups must divide dims
    "default": (64, 64), "mid": (128, 64), "tiny": (32, 32)}


def section(config: str) -> str:
    """The RESULTS.md heading of a config's table (the built-in model's is issue 5's)."""
    return SECTION if config == "default" else f"## AutoRound: qjax vs auto-round, `{config}` config (issue 24)"


def words(vocab: int) -> list[str]:
    return [f"w{i}" for i in range(vocab - 2)]


def write_model(folder: str, config: str) -> None:
    """``default``: a copy of the built-in trained model (real text statistics, real losses); else a seeded random
    model of cpu_speed.py's config with a word-level tokenizer."""
    if config == "default":
        import shutil

        from qjax.checkpoint.hub import default_model_dir

        shutil.copytree(default_model_dir(), folder)
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**config_dict(config))
    model = Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    ws = words(cfg.vocab_size)
    vocab = {w: i for i, w in enumerate(ws)}
    vocab["[UNK]"], vocab["<|endoftext|>"] = len(ws), len(ws) + 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="[UNK]").save_pretrained(folder)


def write_calibration(path: str, n: int, length: int, vocab: int, seed: int = 0, model_dir: str | None = None) -> None:
    """A JSON list of ``n`` documents of ≥ ``length`` tokens: consecutive windows of the built-in model's calib.txt
    (decoded back to text) when ``model_dir`` is given, else random Zipf-distributed words."""
    if model_dir is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "calib.txt"), encoding="utf-8") as f:
            ids = tok.encode(f.read()).ids
        step = length + 16  # re-encoding a decoded window can merge a few tokens: keep a margin over seqlen
        if len(ids) < n * step:
            raise SystemExit(f"calib.txt has {len(ids)} tokens, fewer than {n} × {step}")
        docs = [tok.decode(ids[i * step:(i + 1) * step]) for i in range(n)]
        with open(path, "w") as f:
            json.dump(docs, f)
        return
    r = random.Random(seed)
    ws = words(vocab)
    # Zipf-like word frequencies so that routing is uneven, as with real text
    weights = [1.0 / (i + 1) for i in range(len(ws))]
    docs = [" ".join(r.choices(ws, weights, k=length)) for _ in range(n)]
    with open(path, "w") as f:
        json.dump(docs, f)


class _Capture(logging.Handler):
    """auto-round's per-block log lines: 'quantized N/M layers in the block, loss iter 0: A -> iter k: B'."""

    PAT = re.compile(r"loss iter 0: ([0-9.eE+-]+) -> iter (\d+): ([0-9.eE+-]+)")

    def __init__(self):
        super().__init__()
        self.blocks: list[tuple[float, float, float, int]] = []  # (time, init, best, best_iter)

    def emit(self, record):
        m = self.PAT.search(record.getMessage())
        if m:
            self.blocks.append((time.perf_counter(), float(m.group(1)), float(m.group(3)), int(m.group(2))))


def run_auto_round(base: str, calib: str, out: str, a) -> dict:
    import torch
    from auto_round import AutoRound

    torch.set_num_threads(os.cpu_count() or 2)
    cap = _Capture()
    for name in ("autoround", "auto_round"):
        logging.getLogger(name).addHandler(cap)
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    # explicit: AutoTokenizer maps the qwen3_5_moe config to Qwen3_5Tokenizer, which cannot read a word-level vocab
    # (and the model object too: given a path, auto-round loads the tokenizer itself)
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    gs, egs = RECIPES[a.config]
    ar = AutoRound(model, tokenizer=tok, scheme="W4A16", bits=4, group_size=gs, iters=a.iters, nsamples=a.nsamples,
                   seqlen=a.seqlen, batch_size=a.batch_size, dataset=calib, seed=a.seed,
                   layer_config={".*experts.*": {"bits": 2, "group_size": egs}},
                   # torch.compile (inductor, CPU, torch 2.13) turns every block's loss into NaN on this architecture
                   # ("bf16 and fp16 are mixed in the scheduler node"); eager gives finite losses
                   enable_torch_compile=False)
    t0 = time.perf_counter()
    ar.quantize()
    total = time.perf_counter() - t0
    ar.save_quantized(out, format="llm_compressor")
    times = np.diff([t0] + [b[0] for b in cap.blocks]).tolist()
    return {"total": total, "block_s": times, "init": [b[1] for b in cap.blocks], "best": [b[2] for b in cap.blocks],
            "best_iter": [b[3] for b in cap.blocks]}


def run_qjax(base: str, calib: str, out: str, a, programs=None) -> dict:
    from qjax.convert import save_pretrained

    import qjax
    from qjax.autoround.data import calibration_ids, load_tokenizer
    from qjax.autoround.driver import AutoRound, AutoRoundConfig

    model = qjax.load_model(base)
    ids = calibration_ids(calib, load_tokenizer(base), nsamples=a.nsamples, seqlen=a.seqlen)
    gs, egs = RECIPES[a.config]
    cfg = AutoRoundConfig(bits=4, group_size=gs, layer_config={".*experts.*": {"bits": 2, "group_size": egs}},
                          iters=a.iters, nsamples=a.nsamples, seqlen=a.seqlen, batch_size=a.batch_size, seed=a.seed)
    ar = AutoRound(model, ids, cfg, progress=False, programs=programs)
    t0 = time.perf_counter()
    ar.run()
    total = time.perf_counter() - t0
    save_pretrained(ar.quantized_model(), out)
    return {"total": total, "block_s": [r.seconds for r in ar.reports], "init": [r.init_loss for r in ar.reports],
            "best": [r.best_loss for r in ar.reports], "best_iter": [r.best_iter for r in ar.reports]}


def run_qjax_process(base: str, calib: str, out: str, a, cache: str) -> dict:
    """:func:`run_qjax` in a fresh Python process whose persistent compilation cache is ``cache`` (an empty folder:
    a cold run; one a previous run filled: warm). A fresh process, so nothing compiled by an earlier run of this
    script's own process is reused except through that cache."""
    import subprocess

    spec = {"base": base, "calib": calib, "out": out, "cache": cache, "result": out + ".json",
            "args": {k: getattr(a, k) for k in ("config", "iters", "nsamples", "seqlen", "batch_size", "seed")}}
    subprocess.run([sys.executable, "-P", os.path.abspath(__file__)],
                   env={**os.environ, "QJAX_AUTOROUND_WORKER": json.dumps(spec)}, check=True)
    with open(spec["result"], encoding="utf-8") as f:
        return json.load(f)


def _worker() -> None:
    spec = json.loads(os.environ["QJAX_AUTOROUND_WORKER"])
    from qjax import xla_env
    from qjax.autoround.api import use_cpu_devices
    from qjax.program_cache import program_cache, use_compile_cache

    xla_env.apply(single_threaded=True)  # `qjax quantize`'s XLA:CPU flags (read when the backend starts, below)
    use_cpu_devices(spec["args"]["batch_size"])  # as `qjax quantize` does: one CPU device per core (data parallel)
    # the compilation cache and the traced programs beside it, as `qjax quantize` keeps them
    programs = program_cache(use_compile_cache(spec["cache"]))
    a = argparse.Namespace(**spec["args"])
    r = run_qjax(spec["base"], spec["calib"], spec["out"], a, programs)
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump(r, f)


def held_ids(base: str, config: str, vocab: int) -> np.ndarray:
    """Held-out ids ``[n, 256]``: the built-in model's heldout.txt (8 windows), else random ids."""
    if config != "default":
        return np.random.default_rng(1).integers(0, vocab - 2, (2, 128)).astype(np.int32)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    with open(os.path.join(base, "heldout.txt"), encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    return np.asarray(ids[:8 * 256], np.int32).reshape(8, 256)


def logit_mse(base: str, folder: str, ids: np.ndarray) -> tuple[float, float]:
    """(final-logit MSE vs the unquantized model, perplexity of ``ids``) of the checkpoint in ``folder``."""
    import jax
    import jax.numpy as jnp

    import qjax

    ref = np.asarray(qjax.load_model(base, dtype=jnp.float32)(ids))
    got = qjax.load_model(folder, dtype=jnp.float32)(ids)
    logp = jax.nn.log_softmax(got[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:, None]), axis=-1).mean()
    return float(np.mean((np.asarray(got) - ref) ** 2)), float(np.exp(nll))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="default", choices=sorted(RECIPES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each tool (median of the totals); repeat r tunes with seed --seed + r in both tools")
    ap.add_argument("--seed", type=int, default=42, help="the first repeat's seed (auto-round's and qjax's default)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # auto-round caches tokenized calibration sets by a fingerprint that ignores the vocabulary: a private cache
        # keeps another run's tokenization of the same file name out
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf-datasets")
        # its preprocessing subprocess filtered every sample out here (0 cached); in-process it keeps them
        os.environ["AR_DISABLE_DATASET_SUBPROCESS"] = "1"
        base = os.path.join(tmp, "base")
        write_model(base, a.config)
        with open(os.path.join(base, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        calib = os.path.join(tmp, "calib.json")
        write_calibration(calib, a.nsamples + 8, a.seqlen + 32, vocab,
                          model_dir=base if a.config == "default" else None)
        held = held_ids(base, a.config, vocab)
        with open(os.path.join(base, "config.json")) as f:
            a.layer_kinds = json.load(f)["layer_types"]
        runs = {"auto-round": [], "qjax": [], "qjax-warm": []}
        for rep in range(a.repeats):
            # interleaved, so background load hits both alike; qjax twice: a cold compilation cache, then warm (the
            # same seed: the same result); each repeat its own seed, so the loss comparison covers several samplings
            ra = argparse.Namespace(**dict(vars(a), seed=_seed(a, rep)))
            cache = os.path.join(tmp, f"jax-cache{rep}")
            runs["auto-round"].append(run_auto_round(base, calib, os.path.join(tmp, f"ar{rep}"), ra))
            runs["qjax"].append(run_qjax_process(base, calib, os.path.join(tmp, f"qj{rep}"), ra, cache))
            runs["qjax-warm"].append(run_qjax_process(base, calib, os.path.join(tmp, f"qw{rep}"), ra, cache))
        mse = {"auto-round": [logit_mse(base, _folder(os.path.join(tmp, f"ar{r}")), held) for r in range(a.repeats)],
               "qjax": [logit_mse(base, os.path.join(tmp, f"qj{r}"), held) for r in range(a.repeats)],
               "bf16_ppl": logit_mse(base, base, held)[1], "ids_shape": held.shape}
    text = report(runs, mse, a)
    print(text)
    if not a.no_write:
        write_section(text, section=section(a.config))
        print(f"wrote {RESULTS}")


def _folder(out: str) -> str:
    for root, _, files in os.walk(out):
        if "config.json" in files:
            return root
    raise FileNotFoundError(out)


def report(runs: dict, mse: dict, a) -> str:
    ar_t = statistics.median(r["total"] for r in runs["auto-round"])
    qj_t = statistics.median(r["total"] for r in runs["qjax"])
    ar0, qj0 = runs["auto-round"][0], runs["qjax"][0]
    qw_t = statistics.median(r["total"] for r in runs["qjax-warm"])
    qw0 = runs["qjax-warm"][0]
    ratio, ratio_w = qj_t / ar_t, qw_t / ar_t
    seeds = " / ".join(str(_seed(a, r)) for r in range(a.repeats))
    lines = [section(a.config), "",
             f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU cores "
             f"(shared), {platform.python_version()}",
             f"- command: `python benchmarks/autoround.py {shlex.join(sys.argv[1:])}`",
             f"- model: {MODEL_TEXT.get(a.config, f'cpu_speed.py `{a.config}` config, seeded random, in bf16')}; "
             f"recipe W4A16 g{RECIPES[a.config][0]} + int2 g{RECIPES[a.config][1]} experts; iters {a.iters}, "
             f"nsamples {a.nsamples}, seqlen {a.seqlen}, batch {a.batch_size}; median of {a.repeats} run(s) per tool",
             f"- total tuning time: auto-round {ar_t:.1f} s; qjax with a cold compilation cache {qj_t:.1f} s → "
             f"**qjax/auto-round = {ratio:.2f}** (target ≤ {TARGET}: {'MET' if ratio <= TARGET else 'MISSED'}); "
             f"qjax again with that cache warm {qw_t:.1f} s → **{ratio_w:.2f}** "
             f"({'MET' if ratio_w <= TARGET else 'MISSED'}); each qjax run in a fresh process",
             "- each repeat (auto-round, then qjax cold, then warm, interleaved): "
             + "; ".join(f"{a_['total']:.1f} / {c['total']:.1f} / {w['total']:.1f} s → {c['total'] / a_['total']:.2f} / "
                         f"{w['total'] / a_['total']:.2f}"
                         for a_, c, w in zip(runs["auto-round"], runs["qjax"], runs["qjax-warm"])),
             f"- final-logit MSE vs the bf16 model on held-out ids {list(mse['ids_shape'])} (seed {seeds}): "
             f"auto-round {_each(mse['auto-round'], 0, '{:.3e}')}, qjax {_each(mse['qjax'], 0, '{:.3e}')}; "
             f"perplexity of those ids: BF16 {mse['bf16_ppl']:.2f}, auto-round {_each(mse['auto-round'], 1, '{:.2f}')}, "
             f"qjax {_each(mse['qjax'], 1, '{:.2f}')} (the same qjax code scores both folders)", "",
             "Per-block tables: the first repeat (seed " + str(a.seed) + ").", "",
             "| block | auto-round s | qjax s (cold cache) | qjax s (warm) | auto-round loss it0 → best | "
             "qjax loss it0 → best |",
             "|---|---|---|---|---|---|"]
    n = max(len(ar0["best"]), len(qj0["best"]))
    for i in range(n):
        def cell(r, k, fmt):
            return fmt.format(r[k][i]) if i < len(r[k]) and r[k][i] is not None else "-"
        lines.append(f"| {i} | {cell(ar0, 'block_s', '{:.1f}')} | {cell(qj0, 'block_s', '{:.1f}')} | "
                     f"{cell(qw0, 'block_s', '{:.1f}')} | "
                     f"{cell(ar0, 'init', '{:.3e}')} → {cell(ar0, 'best', '{:.3e}')} | "
                     f"{cell(qj0, 'init', '{:.3e}')} → {cell(qj0, 'best', '{:.3e}')} |")
    # the first block of each layer kind carries qjax's XLA compile of that kind's tuning step
    first = {}
    for i, kind in enumerate(a.layer_kinds):
        first.setdefault(kind, i)
    rest = [i for i in range(min(len(ar0["block_s"]), len(qj0["block_s"]))) if i not in first.values()]
    met = [sum(1 for x, y in zip(q["block_s"], ar0["block_s"]) if x <= TARGET * y) for q in (qj0, qw0)]
    lines += ["", f"Blocks at ≤ {TARGET}× auto-round's time: {met[0]} of {len(ar0['block_s'])} cold, "
                  f"{met[1]} warm."]
    if rest:
        ar_rest, qj_rest = sum(ar0["block_s"][i] for i in rest), sum(qj0["block_s"][i] for i in rest)
        lines += ["", f"Without the blocks that compile (qjax's first block of each layer kind: "
                      f"{sorted(first.values())}): auto-round {ar_rest:.1f} s, qjax {qj_rest:.1f} s → "
                      f"{qj_rest / ar_rest:.2f} (first run of each tool)."]
    # best block loss, each repeat (seed) apart: each tool samples its own minibatches and, after block 0, feeds
    # its own quantized outputs forward, so one seed's block-by-block comparison is largely chance
    per_seed, ratios = [], []
    for q, r in zip(runs["qjax"], runs["auto-round"]):
        pairs = [(x, y) for x, y in zip(q["best"], r["best"]) if x is not None and y is not None]
        per_seed.append((sum(1 for x, y in pairs if x <= y), len(pairs)))
        ratios += [x / y for x, y in pairs if y > 0]
    lower, total = sum(k for k, _ in per_seed), sum(n for _, n in per_seed)
    gmean = float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan")
    lines += ["", f"qjax's best block loss ≤ auto-round's in {lower} of {total} blocks over seed {seeds} ("
                  + ", ".join(f"{k}/{n}" for k, n in per_seed) + f"); qjax/auto-round best loss: geometric mean "
                  f"{gmean:.3f}, range {min(ratios):.3f}–{max(ratios):.3f} (each tool's own minibatches; the streams "
                  "differ after block 0 since each feeds its own quantized outputs forward)."]
    return "\n".join(lines) + "\n"


def _seed(a, rep: int) -> int:
    """The seed both tools tune with in repeat ``rep``."""
    return a.seed + rep


def _each(values: list, k: int, fmt: str) -> str:
    """``values[r][k]`` of each repeat, formatted and joined with ' / '."""
    return " / ".join(fmt.format(v[k]) for v in values)


if __name__ == "__main__":
    if "QJAX_AUTOROUND_WORKER" in os.environ:
        _worker()
    else:
        main()
