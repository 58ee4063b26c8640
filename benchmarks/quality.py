"""Quantization quality on the built-in trained model: held-out perplexity of qjax's and auto-round's quantizers.

The model (``qjax/assets/default``: 4.4M parameters of the qwen3_5_moe architecture trained on Jane Austen; hidden
256, 8 layers, 4 experts of intermediate 64) is quantized and every result is scored by the same qjax code on all of
its ``heldout.txt`` (disjoint from training and calibration text) in ``--seqlen``-token windows, the way the training
script scored it, as a perplexity ratio to the BF16 model. Each quantized model is written as a compressed-tensors
folder and loaded back with ``qjax.load_model`` before scoring, so both tools' results go through the same loader.

Issue 24, seed 000's recipe: W4A16 sym with ``layer_config {".*experts.*": {"bits": 2, "group_size": 64}}`` and
``--enable_alg_ext``, for qjax.autoround and for auto-round 0.16.1 (PyTorch, CPU) at equal settings. The recipe's
4-bit group 128 does not divide the built-in model's down_proj inputs (64), where auto-round pads the last group and
qjax leaves the layer BF16; group 64 divides every layer for both tools, so the 4-bit layers use group 64
(benchmarks/autoround.py's ``RECIPES["default"]``). The card's iters 1000 / nsamples 512 are too slow for this CPU:
both tools get ``--iters`` / ``--nsamples`` / ``--seqlen`` / ``--batch-size``. Four quantizers per tool:

- ``RTN``: plain round-to-nearest (``iters=0, disable_opt_rtn=True``);
- ``opt-RTN``: ``iters=0`` with auto-round's default optimized RTN (its imatrix-weighted scale search);
- ``AutoRound``: ``--iters`` of signed-gradient descent, auto-round's defaults otherwise;
- ``AutoRound+alg_ext``: the same with ``enable_alg_ext=True``.

Both tools read the same JSON list of documents (consecutive windows of calib.txt, benchmarks/autoround.py's
``write_calibration``); auto-round runs eager (``enable_torch_compile=False``: its torch.compile path logs NaN block
losses on this architecture, see benchmarks/autoround.py). Target (issue 24): qjax's AutoRound ratio below
auto-round's, with and without alg_ext. Per-block losses of the tuned runs (both tools log init and best block loss)
show where a difference comes from.

Also (issue 5, qjax only, ``--schemes``): uniform W4G128 and W2G64 with RTN / opt-RTN / AutoRound. Targets: W2G64
AutoRound perplexity < RTN perplexity; W4G128 AutoRound within 5 % of BF16.

    python benchmarks/quality.py [--iters 200 --nsamples 128 --seqlen 256 --batch-size 8] [--schemes W4G128,W2G64]
                                 [--methods RTN,opt-RTN,AutoRound,AutoRound+alg_ext] [--skip-auto-round] [--no-write]

Writes (replaces) the section ``## Quantization quality on the built-in model (issues 5, 24)`` of RESULTS.md.

``--lm-head`` (GPU decode, part 6) measures instead what a quantized LM head costs: the built-in model with only its
head quantized (int8 per channel, int4 g128), and the seed-000 body alone, + an int8 head, + an int4 head, each body
by plain RTN and by AutoRound (``--head-methods``) — every model made by qjax.autoround with ``--quant_lm_head``'s
rules (a ``layer_config`` entry for ``lm_head``: RTN at iters 0, tuned after the last block otherwise). The built-in
model ties its head to the embedding, which auto-round (and qjax quantize) leave unquantized, so the head is first
untied (:func:`untied`: a copy of the table, the same logits) — the layout of Qwen3.6-35B-A3B, whose head is its own.
Also the bytes a batch-1 decode step reads with each head on the 35B config (``qjax inspect``'s line, no device).
Writes (replaces) the section ``## Quantized LM head: perplexity and decode bytes (GPU decode, part 6)``.
"""

from __future__ import annotations

import os

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autoround import _Capture, _folder, write_calibration  # noqa: E402
from cpu_speed import RESULTS, git_state, write_section  # noqa: E402

SECTION = "## Quantization quality on the built-in model (issues 5, 24)"
HEAD_SECTION = "## Quantized LM head: perplexity and decode bytes (GPU decode, part 6)"
SEED000 = dict(bits=4, group_size=64, layer_config={".*experts.*": {"bits": 2, "group_size": 64}})
# the heads measured: recipe scheme (qjax inspect / qjax bench) → layer_config entry (qjax quantize); both int8
# per channel and int4 g128 divide every head (hidden 256 here, 2048 on the 35B)
HEADS = {"int8:channel": {"bits": 8, "group_size": -1}, "int4:g128": {"bits": 4, "group_size": 128}}
HEAD_METHODS = {"RTN": dict(iters=0, disable_opt_rtn=True), "AutoRound": {}}
SCHEMES = {"W4G128": dict(bits=4, group_size=128), "W2G64": dict(bits=2, group_size=64)}
METHODS = {"RTN": dict(iters=0, disable_opt_rtn=True), "opt-RTN": dict(iters=0), "AutoRound": {},
           "AutoRound+alg_ext": dict(enable_alg_ext=True)}
SCHEME_METHODS = ("RTN", "opt-RTN", "AutoRound")


def packed_matrices(folder: str) -> int:
    """Quantized weight matrices stored in ``folder`` (``*.weight_packed`` tensors; experts one per expert in both
    tools' output), so both tools' coverage is counted the same way."""
    from safetensors import safe_open

    n = 0
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, "np") as f:
            n += sum(k.endswith(".weight_packed") for k in f.keys())
    return n


def run_qjax(model, ids, settings: dict, out: str):
    """qjax.autoround with ``settings`` → (seconds for calibration + tuning, per-block reports)."""
    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.convert import save_pretrained

    t0 = time.perf_counter()
    ar = AutoRound(model, ids, AutoRoundConfig(**settings), progress=False)
    ar.run()
    secs = time.perf_counter() - t0
    save_pretrained(ar.quantized_model(), out)
    blocks = [(r.init_loss, r.best_loss, r.best_iter) for r in ar.reports] if settings["iters"] else []
    return secs, blocks


def run_auto_round(folder: str, calib: str, settings: dict, out: str):
    """auto-round 0.16.1 with ``settings`` (eager) → (seconds of ``quantize()``, per-block (init, best, iter))."""
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(os.cpu_count() or 2)
    cap = _Capture()
    loggers = [logging.getLogger(n) for n in ("autoround", "auto_round")]
    for lg in loggers:
        lg.addHandler(cap)
    torch.manual_seed(0)
    # the tokenizer explicitly: AutoTokenizer maps the qwen3_5_moe config to a class that cannot read this vocab
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    s = dict(settings)
    ar = AutoRound(model, tokenizer=tok, scheme="W4A16", bits=s.pop("bits"), group_size=s.pop("group_size"),
                   dataset=calib, enable_torch_compile=False, **s)
    t0 = time.perf_counter()
    ar.quantize()
    secs = time.perf_counter() - t0
    ar.save_quantized(out, format="llm_compressor")
    for lg in loggers:
        lg.removeHandler(cap)
    return secs, [(b[1], b[2], b[3]) for b in cap.blocks]


def heldout_scorer(folder: str, tok, seqlen: int):
    """(the built-in model's held-out token ids, ``ppl(model)``: their perplexity in ``seqlen``-token windows)."""
    from qjax.builtin import train as T

    with open(os.path.join(folder, "heldout.txt"), encoding="utf-8") as f:
        held = np.asarray(tok.encode(f.read()).ids, np.int32)

    def ppl(m) -> float:
        nll, _ = T.mean_nll(m, held, seqlen=seqlen, batch=8)
        return float(np.exp(nll))

    return held, ppl


def untied(model):
    """``model`` with an lm_head of its own holding a copy of its tied embedding table: the same logits (checked by
    the caller), and a head that can be quantized while the input embedding stays in the model dtype."""
    import dataclasses

    from flax import nnx

    from qjax.model.qwen3_5_moe import Qwen3_5MoeForCausalLM

    if not model.config.tie_word_embeddings:
        return model
    cfg = dataclasses.replace(model.config, tie_word_embeddings=False)
    out = Qwen3_5MoeForCausalLM(cfg, dtype=model.dtype, rngs=nnx.Rngs(0), with_mtp=model.mtp is not None)
    nnx.update(out, nnx.state(model))
    out.lm_head.weight[...] = model.embed_tokens[...]
    return out


def decode_bytes_35b() -> dict[str, tuple[float, float]]:
    """head scheme ("bf16" too) → (MB a batch-1 decode step of Qwen3.6-35B-A3B reads with the w2w4 recipe and that
    head, of which the head's), from the planner ``qjax inspect --recipe`` prints it with (no device)."""
    from qjax.convert.planner import plan_recipe_cfg
    from qjax.runtime.bench import load_config

    cfg = load_config()
    out = {}
    for head in ["bf16", *HEADS]:
        p = plan_recipe_cfg(cfg, f"w2w4,lm_head={head}")
        out[head] = (p.decode["total"] / 1e6, p.lm_head_bytes / 1e6)
    return out


def lm_head_main(a, argv) -> int:
    """The ``--lm-head`` measurement (module docstring)."""
    import qjax
    from qjax.autoround.data import calibration_ids, load_tokenizer
    from qjax.checkpoint.hub import default_model_dir

    methods = [m for m in a.head_methods.split(",") if m]
    unknown = [m for m in methods if m not in HEAD_METHODS]
    if unknown:
        raise SystemExit(f"--head-methods: unknown {', '.join(unknown)} (known: {', '.join(HEAD_METHODS)})")
    folder = default_model_dir()
    tied = qjax.load_model(folder)
    model = untied(tied)
    tok = load_tokenizer(folder)
    held, ppl = heldout_scorer(folder, tok, a.seqlen)

    bf16 = ppl(tied)
    if ppl(model) != bf16:
        raise SystemExit("the untied copy of the built-in model does not score as the model itself")
    print(f"BF16 held-out ppl {bf16:.3f}", flush=True)
    common = dict(nsamples=a.nsamples, seqlen=a.seqlen, batch_size=a.batch_size)
    body = {k: v for k, v in SEED000.items() if k != "layer_config"}
    # the head alone (the decoder stays BF16), then the seed-000 body alone and with each head
    jobs = [(method, body_name, head) for method in methods for body_name in (None, "seed 000")
            for head in ([*HEADS] if body_name is None else [None, *HEADS])]
    rows = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        calib = os.path.join(tmp, "calib.json")
        write_calibration(calib, a.nsamples + 8, a.seqlen + 32, model.config.vocab_size, model_dir=folder)
        ids = calibration_ids(calib, tok, nsamples=a.nsamples, seqlen=a.seqlen, vocab_size=model.config.vocab_size)
        for i, (method, body_name, head) in enumerate(jobs):
            layer_config = dict(SEED000["layer_config"]) if body_name else {}
            if head:
                layer_config["lm_head"] = HEADS[head]
            settings = {**(body if body_name else {"bits": 16}), "layer_config": layer_config,
                        "iters": a.iters, **common, **HEAD_METHODS[method]}
            out = os.path.join(tmp, str(i))
            secs, _ = run_qjax(model, ids, settings, out)
            loaded = qjax.load_model(out)
            if (loaded.quant.lm_head is not None) != bool(head):
                raise SystemExit(f"{out}: the head is {'not ' if head else ''}quantized")
            p = ppl(loaded)
            rows.append((method, body_name, head, settings["iters"], p, secs))
            print(f"{method} body {body_name} head {head}: ppl {p:.3f} ({p / bf16:.4f}× BF16), {secs:.0f} s",
                  flush=True)
    total = time.perf_counter() - t_all
    body_only = {r[0]: r[4] for r in rows if r[1] and r[2] is None}
    cmd = " ".join(["python benchmarks/quality.py", shlex.join(argv)]).strip()
    lines = [HEAD_SECTION, "",
             f"Held-out perplexity of the built-in model, BF16 **{bf16:.3f}**, with its LM head quantized, alone and "
             "on the seed-000 body (INT2 g64 experts, INT4 g64 rest):", "",
             "| body | head | iters | held-out ppl | × BF16 | × body alone | seconds |",
             "|---|---|---:|---:|---:|---:|---:|",
             f"| BF16 | BF16 | - | {bf16:.3f} | 1.0000 | - | - |"]
    for method, body_name, head, iters, p, secs in rows:
        name = f"seed 000, {method}" if body_name else "BF16"
        head_name = f"{head} ({'tuned' if iters and method != 'RTN' else 'RTN'})" if head else "BF16"
        ratio = "-" if body_name and not head else f"{p / (body_only[method] if body_name else bf16):.4f}"
        lines.append(f"| {name} | {head_name} | {iters} | {p:.3f} | {p / bf16:.4f} | {ratio} | {secs:.0f} |")
    dec = decode_bytes_35b()
    base_mb = dec["bf16"][0]
    lines += ["",
              "Bytes one batch-1 decode step reads on Qwen3.6-35B-A3B with the w2w4 recipe (`qjax inspect --config "
              "qjax/assets/configs/qwen3_6_35b_a3b.json --recipe 'w2w4,lm_head=HEAD'`, its `decode step at batch 1` "
              "line: every weight outside the routed experts, 8 of 256 experts, the GDN state read and written; KV "
              "20.48 kB per context token on top). A decode step is bound by bytes ÷ memory bandwidth, so its time "
              "scales as the bytes at batch 1:", "",
              "| head | head MB | step MB | × BF16 head's step | bound at 4.8 TB/s (H200) | at 3.35 TB/s (H100) |",
              "|---|---:|---:|---:|---:|---:|"]
    for head, (step, head_mb) in dec.items():
        lines.append(f"| {head} | {head_mb:,.1f} | {step:,.1f} | {step / base_mb:.3f} | {4.8e12 / (step * 1e6):,.0f} "
                     f"tok/s | {3.35e12 / (step * 1e6):,.0f} tok/s |")
    lines += ["",
              f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU "
              f"cores, {platform.python_version()}; qjax {git_state()}; whole run {total / 60:.0f} min",
              f"- command: `{cmd}`",
              f"- model: built-in `qjax/assets/default` (BF16), its head untied first (a copy of the embedding table: "
              f"the same perplexity, checked); held-out: all {held.size:,} tokens of heldout.txt in {a.seqlen}-token "
              "windows, each model saved as compressed-tensors and loaded back before scoring; calibration: "
              f"{a.nsamples} × {a.seqlen} tokens of calib.txt",
              "- every row is qjax.autoround with the head asked for as `qjax quantize --quant_lm_head` / a "
              "`layer_config` entry for `lm_head` asks for it: RTN = iters 0 without optimized RTN (auto-round's "
              f"RTN, the head's equal to auto-round 0.16.1's bit for bit: tests/test_lm_head.py); AutoRound = iters "
              f"{a.iters}, the head tuned after the last block on the final-norm streams; the 4-bit body layers use "
              "group 64 (see the section above); one run each (deterministic)",
              "- ratios: each row against BF16 and against the same body with a BF16 head, all measured in this run",
              "- decode bytes: the planner's count on the real config's shapes (qjax.convert.planner.decode_bytes, "
              "the bench's bound); the tok/s columns are that bound only (bytes ÷ datasheet HBM bandwidth), not "
              "measured", ""]
    if a.no_write:
        print("\n".join(lines))
    else:
        write_section("\n".join(lines), RESULTS, HEAD_SECTION)
        print(f"wrote {RESULTS}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="issue 5's qjax-only schemes; '' skips them")
    ap.add_argument("--skip-auto-round", action="store_true", help="qjax rows only (no auto-round installed)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"seed 000 quantizers to run, of {', '.join(METHODS)} (a subset replaces the whole table)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    ap.add_argument("--lm-head", action="store_true",
                    help="measure a quantized LM head instead (its own section; module docstring)")
    ap.add_argument("--head-methods", default=",".join(HEAD_METHODS),
                    help=f"with --lm-head: how the bodies are made, of {', '.join(HEAD_METHODS)}")
    a = ap.parse_args(argv)
    if a.lm_head:
        return lm_head_main(a, sys.argv[1:] if argv is None else argv)
    methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)} (known: {', '.join(METHODS)})")

    import qjax
    from qjax.autoround.data import calibration_ids, load_tokenizer
    from qjax.checkpoint.hub import default_model_dir

    folder = default_model_dir()
    model = qjax.load_model(folder)
    tok = load_tokenizer(folder)
    held, ppl = heldout_scorer(folder, tok, a.seqlen)

    bf16 = ppl(model)
    print(f"BF16 held-out ppl {bf16:.3f}", flush=True)
    common = dict(iters=a.iters, nsamples=a.nsamples, seqlen=a.seqlen, batch_size=a.batch_size)
    jobs = [("seed 000", m, "qjax") for m in methods]
    if not a.skip_auto_round:
        jobs += [("seed 000", m, "auto-round") for m in methods]
    jobs += [(s, m, "qjax") for s in filter(None, a.schemes.split(",")) for m in SCHEME_METHODS]
    rows, blocks = [], {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # auto-round caches tokenized calibration sets by a fingerprint that ignores the vocabulary: a private cache
        # keeps another run's tokenization of the same file name out
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf-datasets")
        # its preprocessing subprocess filtered every sample out here (0 cached); in-process it keeps them
        os.environ["AR_DISABLE_DATASET_SUBPROCESS"] = "1"
        calib = os.path.join(tmp, "calib.json")
        write_calibration(calib, a.nsamples + 8, a.seqlen + 32, model.config.vocab_size, model_dir=folder)
        ids = calibration_ids(calib, tok, nsamples=a.nsamples, seqlen=a.seqlen, vocab_size=model.config.vocab_size)
        for i, (scheme, method, tool) in enumerate(jobs):
            settings = {**(SEED000 if scheme == "seed 000" else SCHEMES[scheme]), **common, **METHODS[method]}
            out = os.path.join(tmp, str(i))
            if tool == "qjax":
                secs, blocks[(tool, method, scheme)] = run_qjax(model, ids, settings, out)
            else:
                secs, blocks[(tool, method, scheme)] = run_auto_round(folder, calib, settings, out)
                out = _folder(out)
            p = ppl(qjax.load_model(out))
            mats = packed_matrices(out)
            rows.append((scheme, method, tool, settings["iters"], p, secs, mats))
            print(f"{scheme} {method} {tool}: ppl {p:.3f} ({p / bf16:.4f}× BF16), {secs:.0f} s, {mats} matrices "
                  f"quantized", flush=True)
    total = time.perf_counter() - t_all

    by = {(r[0], r[1], r[2]): r[4] for r in rows}
    verdicts = []
    for method in [m for m in ("AutoRound", "AutoRound+alg_ext") if m in methods]:
        ar_ = by.get(("seed 000", method, "auto-round"))
        q = by[("seed 000", method, "qjax")]
        if ar_ is None:
            verdicts.append(f"{method}: qjax ppl ratio {q / bf16:.4f}; auto-round not run (--skip-auto-round)")
        else:
            verdicts.append(f"{method}: qjax AutoRound ppl ratio {q / bf16:.4f} vs auto-round {ar_ / bf16:.4f} "
                            f"({'met' if q < ar_ else 'MISSED'}: target qjax < auto-round)")
    checks = []
    if ("W2G64", "AutoRound", "qjax") in by:
        w2, rtn = by[("W2G64", "AutoRound", "qjax")], by[("W2G64", "RTN", "qjax")]
        checks.append(f"W2G64 AutoRound ppl {w2:.2f} vs RTN {rtn:.2f}: ratio {w2 / rtn:.3f} "
                      f"({'met' if w2 < rtn else 'MISSED'}; target < 1)")
    if ("W4G128", "AutoRound", "qjax") in by:
        w4 = by[("W4G128", "AutoRound", "qjax")]
        checks.append(f"W4G128 AutoRound ppl {w4:.2f} vs BF16 {bf16:.2f}: ratio {w4 / bf16:.3f} "
                      f"({'met' if w4 <= 1.05 * bf16 else 'MISSED'}; target ≤ 1.05)")
    for c in verdicts + checks:
        print(c)

    cmd = " ".join(["python benchmarks/quality.py", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    lines = [SECTION, "", *(f"- {v}" for v in verdicts), "",
             f"Seed 000 recipe at equal settings; BF16 perplexity **{bf16:.3f}**:", "",
             "| method | iters | qjax ppl | qjax × BF16 | auto-round ppl | auto-round × BF16 | qjax s | auto-round s "
             "| matrices quantized (qjax / auto-round) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    full = {(r[1], r[2]): r for r in rows if r[0] == "seed 000"}
    for method in methods:
        q, ar_ = full[(method, "qjax")], full.get((method, "auto-round"))
        arc = (f"{ar_[4]:.3f} | {ar_[4] / bf16:.4f}", f"{ar_[5]:.0f}", f"{ar_[6]}") if ar_ else ("- | -", "-", "-")
        lines.append(f"| {method} | {q[3]} | {q[4]:.3f} | {q[4] / bf16:.4f} | {arc[0]} | {q[5]:.0f} | {arc[1]} | "
                     f"{q[6]} / {arc[2]} |")
    lines += ["",
              f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU "
              f"cores, {platform.python_version()}; qjax {git_state()}; whole run {total / 60:.0f} min",
              f"- command: `{cmd}`",
              f"- model: built-in `qjax/assets/default` (BF16); held-out: all {held.size:,} tokens of heldout.txt in "
              f"{a.seqlen}-token windows, scored by qjax for every row (each result saved as compressed-tensors and "
              f"loaded back); calibration: one JSON file of {a.nsamples + 8} consecutive calib.txt windows read by "
              f"both tools ({a.nsamples} × {a.seqlen} tokens used); iters {a.iters}, batch {a.batch_size}, otherwise "
              "auto-round 0.16.1's defaults",
              "- seed 000 recipe (issue 24): W4A16 sym, `.*experts.*` int2 g64, with and without alg_ext; the 4-bit "
              "layers use **group 64, not the card's 128** (128 does not divide down_proj's input 64 here: "
              f"auto-round would pad the group, qjax would leave those layers BF16), and iters {a.iters} / nsamples "
              f"{a.nsamples} instead of the card's 1000 / 512 (CPU time), equal for both tools; auto-round eager",
              "- never quantized (both tools): router, shared_expert_gate, norms, embeddings, lm_head, and any layer "
              "with a dimension not a multiple of 32 (Gated DeltaNet in_proj_a/in_proj_b); in the uniform W4G128 "
              "rows also every down_proj (input 64)",
              "- one run each (deterministic: fixed seeds; qjax single-threaded XLA:CPU, auto-round torch on all "
              "cores); seconds = calibration + tuning (model load and export excluded), on a shared machine: "
              "indicative", ""]
    cols = [(t, k) for k in ("AutoRound", "AutoRound+alg_ext") for t in ("auto-round", "qjax")
            if blocks.get((t, k, "seed 000"))]
    if cols:
        lines += ["Per block, loss at iteration 0 → best (each tool's own log: token-masked output MSE of that "
                  "iteration's minibatch; after block 0 each tool feeds its own quantized outputs forward):", "",
                  "| block | " + " | ".join(f"{t} {k}" for t, k in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for b in range(max(len(blocks[(t, k, "seed 000")]) for t, k in cols)):
            cells = []
            for t, k in cols:
                bl = blocks[(t, k, "seed 000")]
                cells.append(f"{bl[b][0]:.3e} → {bl[b][1]:.3e} (it {bl[b][2]})" if b < len(bl) else "-")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    scheme_rows = [r for r in rows if r[0] != "seed 000"]
    if scheme_rows:
        lines += ["Uniform schemes (issue 5, qjax only):", "",
                  "| scheme | method | iters | held-out ppl | × BF16 | seconds | matrices quantized |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for scheme, method, _, iters, p, secs, mats in scheme_rows:
            lines.append(f"| {scheme} | {method} | {iters} | {p:.3f} | {p / bf16:.3f} | {secs:.0f} | {mats} |")
        lines += [""] + [f"- {c}" for c in checks] + [""]
    if a.no_write:
        print("\n".join(lines))
    else:
        write_section("\n".join(lines), RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
