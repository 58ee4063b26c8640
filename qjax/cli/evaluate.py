"""``qjax eval ppl``, ``qjax eval fidelity`` and ``qjax compare``: flags → :mod:`qjax.evaluation.evaluate` /
:mod:`qjax.evaluation.compare` (``qjax compare --routing``: :mod:`qjax.research.routing`).

Bad input (a missing file, empty data, a text of fewer than 2 tokens, a folder without tokenizer files, models with
different vocabularies) ends in one ``error: ...`` line on stderr and exit status 2 (``qjax.cli.main`` prints the
ValueError subclasses raised here). A text shorter than one ``--seqlen`` window is scored as one window of its own
length, with a one-line ``qjax eval ppl: note: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from qjax.cli.options import (
    add_compile_cache_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    dtype,
    start_compile_cache,
)
from qjax.evaluation import PERPLEXITY_METHOD

PPL_HELP = ("Perplexity of a text file under a checkpoint, tokenized with the folder's tokenizer. Method: "
            + PERPLEXITY_METHOD + ".")
FIDELITY_HELP = (
    "Fidelity of a (quantized) model to its reference, as quantized model cards report it: the reference's greedy "
    "answer to each prompt, then under the model and under the reference the perplexity of those answer tokens "
    "given the prompt (teacher forcing) and the next-token top-1 agreement with the reference's greedy tokens.")
COMPARE_HELP = (
    "Per-block numerics diff against transformers: the same token ids through transformers' Qwen3_5MoeForCausalLM "
    "(float32, eager attention, CPU) holding the folder's own weights — quantized ones decompressed by "
    "compressed-tensors (auto_round folders through qjax's bit-exact conversion), static FP8 KV scales emulated on "
    "both sides — and qjax; error of the embeddings, each decoder block's output, the final norm and the logits. The "
    "transformers side needs float32 host memory for the whole model. --dtype float64 adds the ground truth: both "
    "in float64 (transformers' float32 pins promoted), then each implementation's float32 and bfloat16 error "
    "against it, block by block. --routing --reference REF: the routing of --model against REF instead (no "
    "transformers): per layer top-k agreement, router KL, expert load, routing-weight and shared-gate drift, end to "
    "end and isolated (the model's router on REF's hidden states); exit status 1 when a layer is flagged. --damage "
    "--reference REF: each block's share of KL(REF ‖ model) by patching, ranked, with a --layer_config suggestion. "
    "--lens [--reference REF]: the logit lens per layer.")
# ``qjax compare --routing`` defaults, stated here without importing JAX (qjax.research.routing checks they agree)
ROUTING_MIN_AGREEMENT = 0.99
ROUTING_MAX_ROUTER_KL = 1e-4
ROUTING_SEQLEN = 256
ROUTING_MAX_TOKENS = 4096


def _dtype(name):
    import jax.numpy as jnp

    return jnp.dtype(name) if name else None


def _emit(report, a, **kw) -> None:
    print(json.dumps(report.to_dict(**kw), indent=1) if a.json else report.format(**kw))


def cmd_ppl(a) -> int:
    from qjax.checkpoint.hub import default_model_dir
    from qjax.evaluation.evaluate import EvalError, perplexity_of_file

    start_compile_cache(a.compile_cache)
    model = a.model or default_model_dir()
    data = a.data
    if data is None:
        data = os.path.join(model, "heldout.txt")
        if not os.path.isfile(data):
            raise EvalError(f"--data is required ({model} has no heldout.txt to default to)")
    report = perplexity_of_file(model, data, seqlen=a.seqlen, batch=a.batch_size, max_tokens=a.max_tokens,
                                dtype=_dtype(a.dtype), progress=not a.quiet, tokenizer_dir=a.tokenizer)
    if report.note:
        print(f"qjax eval ppl: note: {report.note}", file=sys.stderr, flush=True)
    _emit(report, a)
    return 0


def cmd_fidelity(a) -> int:
    from qjax.evaluation.evaluate import fidelity, read_prompts

    start_compile_cache(a.compile_cache)
    prompts = read_prompts(a.prompts)
    report = fidelity(a.model, a.reference, prompts, max_new_tokens=a.max_new_tokens, chat=a.chat,
                      enable_thinking=a.thinking, batch=a.batch_size, dtype=_dtype(a.dtype), progress=not a.quiet)
    _emit(report, a)
    return 0


def cmd_compare(a) -> int:
    from qjax.checkpoint.hub import default_model_dir
    from qjax.evaluation.compare import CompareError, compare_folder, compare_truth
    from qjax.model.config import TextConfig

    model = a.model or default_model_dir()
    modes = [f for f, on in (("--routing", a.routing), ("--damage", a.damage), ("--lens", a.lens)) if on]
    if len(modes) > 1:
        raise CompareError(f"give one of --routing, --damage, --lens (got {' and '.join(modes)})")
    if modes:
        return cmd_research(a, model, modes[0])
    for flag, value in (("--reference", a.reference), ("--data", a.data), ("--min-agreement", a.min_agreement),
                        ("--max-router-kl", a.max_router_kl)):
        if value is not None:
            raise CompareError(f"{flag} applies to --routing, --damage and --lens only")
    given = [n for n, v in (("--prompt", a.prompt), ("--ids", a.ids), ("--seqlen", a.seqlen)) if v is not None]
    if len(given) > 1:
        raise CompareError(f"give one input: --prompt, --ids or --seqlen (got {' and '.join(given)})")
    if a.ids is not None:
        try:
            ids = np.array([[int(x) for x in a.ids.replace(",", " ").split()]], np.int64)
        except ValueError:
            raise CompareError(f"--ids {a.ids!r}: expected integers separated by spaces or commas") from None
    elif a.prompt is not None:
        from qjax.evaluation.evaluate import load_tokenizer

        ids = np.array([load_tokenizer(model).encode(a.prompt)], np.int64)
    else:
        if a.seqlen is not None and a.seqlen < 1:
            raise CompareError(f"--seqlen must be ≥ 1, got {a.seqlen}")
        vocab = TextConfig.from_file(model).vocab_size
        ids = np.random.default_rng(a.seed).integers(0, vocab, (1, a.seqlen or 80))
    if ids.size == 0:
        raise CompareError("the input has no tokens")
    if a.dtype == "float64":
        report = compare_truth(model, ids, quiet=a.quiet)
    else:
        report = compare_folder(model, ids, dtype=a.dtype, quiet=a.quiet)
    _emit_to(report, a.json, tol=a.tol)
    return 0


def _emit_to(report, json_to: str | None, **kw) -> None:
    """``--json`` alone: the report as JSON on stdout; ``--json FILE``: the table on stdout, the JSON in FILE."""
    if json_to == "-":
        print(json.dumps(report.to_dict(**kw), indent=1))
        return
    print(report.format(**kw))
    if json_to is not None:
        with open(json_to, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(**kw), f, indent=1)


def _routing_ids(a, model: str, reference: str) -> np.ndarray:
    """``[B, seqlen]`` token ids: --ids / --prompt as one row; --data (or the reference's heldout.txt when neither is
    given) tokenized by the reference's tokenizer, in rows of --seqlen, at most --max-tokens; else seeded random ids."""
    from qjax.evaluation.compare import CompareError
    from qjax.evaluation.evaluate import load_tokenizer, read_texts, tokenize_texts
    from qjax.model.config import TextConfig

    given = [n for n, v in (("--prompt", a.prompt), ("--ids", a.ids), ("--data", a.data)) if v is not None]
    if len(given) > 1:
        raise CompareError(f"give one input: --prompt, --ids or --data (got {' and '.join(given)})")
    seqlen = ROUTING_SEQLEN if a.seqlen is None else a.seqlen
    if seqlen < 1 or a.max_tokens < 1:
        raise CompareError(f"--seqlen and --max-tokens must be ≥ 1 (got {seqlen} and {a.max_tokens})")
    if a.ids is not None:
        try:
            return np.array([[int(x) for x in a.ids.replace(",", " ").split()]], np.int64)
        except ValueError:
            raise CompareError(f"--ids {a.ids!r}: expected integers separated by spaces or commas") from None
    if a.prompt is not None:
        return np.array([load_tokenizer(reference, "--reference").encode(a.prompt)], np.int64)
    data = a.data
    if data is None and a.seqlen is None and os.path.isfile(os.path.join(reference, "heldout.txt")):
        data = os.path.join(reference, "heldout.txt")
    if data is None:
        vocab = TextConfig.from_file(reference).vocab_size
        rows = max(1, a.max_tokens // seqlen)
        return np.random.default_rng(a.seed).integers(0, vocab, (rows, seqlen))
    tokens = tokenize_texts(read_texts(data), load_tokenizer(reference, "--reference"))[:a.max_tokens]
    if tokens.size < seqlen:
        return tokens[None].astype(np.int64)
    return tokens[: tokens.size // seqlen * seqlen].reshape(-1, seqlen).astype(np.int64)


def cmd_research(a, model: str, mode: str) -> int:
    """``--routing`` / ``--damage`` / ``--lens``: :mod:`qjax.research` on two checkpoints (one for ``--lens``)."""
    import qjax
    from qjax.evaluation.compare import CompareError
    from qjax.evaluation.evaluate import check_same_vocabulary

    if a.reference is None and mode != "--lens":
        raise CompareError(f"{mode} compares two checkpoints: give --reference (e.g. the unquantized original)")
    if a.dtype == "float64":
        raise CompareError(f"{mode} runs in the checkpoints' dtype, float32 or bfloat16 (not --dtype float64)")
    if a.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # said before the models run, not after
            raise CompareError("--plot needs matplotlib (pip install 'qjax[plot]' or pip install matplotlib)")
    reference = a.reference or model
    if a.reference is not None:
        check_same_vocabulary(model, a.reference)
    ids = _routing_ids(a, model, reference)
    if ids.size == 0:
        raise CompareError("the input has no tokens")
    ref = qjax.load_model(reference, dtype=_dtype(a.dtype), text_only=True)
    # the same dtype for both: rounding is not what is measured
    mine = ref if a.reference is None else qjax.load_model(model, dtype=ref.dtype, text_only=True)
    names = (model, reference)
    kw = {}
    if mode == "--lens":
        from qjax.research.lens import logit_lens

        report = logit_lens(mine, ids, None if a.reference is None else ref, batch=a.batch_size, names=names)
    elif mode == "--damage":
        from qjax.research.damage import block_damage

        report = block_damage(mine, ref, ids, batch=a.batch_size, names=names)
        kw = {"bits": a.suggest_bits, "group_size": a.suggest_group_size, "top": a.suggest_top}
    else:
        from qjax.research.routing import compare_routing

        report = compare_routing(mine, ref, ids, batch=a.batch_size,
                                 min_agreement=ROUTING_MIN_AGREEMENT if a.min_agreement is None else a.min_agreement,
                                 max_router_kl=ROUTING_MAX_ROUTER_KL if a.max_router_kl is None else a.max_router_kl,
                                 names=names)
    _emit_to(report, a.json, **kw)
    if a.plot is not None:
        from qjax.research.plots import write_plots

        for path in write_plots(report, a.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if mode == "--routing" and report.flagged else 0


def register(subparsers) -> None:
    """Add ``eval`` (``ppl``, ``fidelity``) and ``compare`` to the ``qjax`` command line."""
    ev = subparsers.add_parser("eval", help="perplexity of a text, fidelity of a quantized model to its reference",
                               description="Evaluate checkpoints: `qjax eval ppl` and `qjax eval fidelity`.")
    evsub = ev.add_subparsers(dest="eval_command", required=True)

    p = evsub.add_parser("ppl", help="perplexity of a text file", description=PPL_HELP)
    p.add_argument("--model", default=None, help="checkpoint folder with tokenizer files (default: the built-in model)")
    p.add_argument("--data", default=None,
                   help="text file: .txt (the whole file), .jsonl ('text' per line) or .json (list of strings or "
                        "objects with 'text'); documents are joined by a blank line (default: the model folder's "
                        "heldout.txt)")
    p.add_argument("--seqlen", type=int, default=2048,
                   help="model inputs per window (default 2048); data with fewer than seqlen + 1 tokens is scored as "
                        "one window of its own length (a note on stderr says so)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward call (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of the data")
    add_tokenizer_argument(p)
    _common(p)
    p.set_defaults(func=cmd_ppl)

    f = evsub.add_parser("fidelity", help="fidelity of a quantized model to its reference", description=FIDELITY_HELP)
    f.add_argument("--model", required=True, help="the checkpoint to evaluate (e.g. a quantized build)")
    f.add_argument("--reference", required=True, help="the reference checkpoint (e.g. the BF16 original); its "
                   "tokenizer renders the prompts and its greedy answers are the text scored")
    f.add_argument("--prompts", required=True,
                   help="prompts file: .txt (one per line), .jsonl ('prompt' per line) or .json list")
    f.add_argument("--max-new-tokens", type=int, default=128, help="longest reference answer (default 128)")
    f.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render each prompt as a user message with the reference's chat template (default: on when "
                        "the folder has a chat template)")
    f.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="enable_thinking passed to the chat template (default: the template's own default)")
    f.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default 8)")
    _common(f)
    f.set_defaults(func=cmd_fidelity)

    c = subparsers.add_parser("compare", help="per-block numerics diff against transformers", description=COMPARE_HELP)
    c.add_argument("--model", default=None, help="checkpoint folder (default: the built-in model)")
    c.add_argument("--prompt", default=None, help="input text (tokenized with the folder's tokenizer)")
    c.add_argument("--ids", default=None, help="input token ids ('1 2 3')")
    c.add_argument("--seqlen", type=int, default=None,
                   help="without --prompt/--ids: this many seeded random token ids (default 80, which crosses the "
                        "64-token chunk of the delta rule). With --routing: tokens per row (default "
                        f"{ROUTING_SEQLEN}; without --data: rows of seeded random ids up to --max-tokens)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random ids")
    c.add_argument("--dtype", type=dtype, choices=["float32", "bfloat16", "float64"], default=None,
                   help="float32 / bfloat16: qjax's dtype against transformers in float32 (default float32). float64: "
                        "ground truth — transformers in float64 everywhere is the truth, and qjax and transformers "
                        "each in float32 and bfloat16 are reported side by side by their distance to it. With "
                        "--routing: both models' dtype (default: the reference checkpoint's)")
    c.add_argument("--tol", type=float, default=1e-4,
                   help="a block diverges when its max abs error exceeds this fraction of its max |value| "
                        "(default 1e-4)")
    c.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the report as JSON; with FILE: print the table and write the JSON to FILE")
    c.add_argument("--quiet", action="store_true", help="no loading bars or notices from transformers")
    r = c.add_argument_group("research instruments (--routing, --damage, --lens; docs/research.md)")
    r.add_argument("--routing", action="store_true",
                   help="compare the routing of --model with --reference's instead of numerics with transformers; "
                        "exit status 1 when a layer is flagged, 0 otherwise")
    r.add_argument("--damage", action="store_true",
                   help="rank --model's blocks (a quantized build of --reference) by their share of KL(reference ‖ "
                        "model), measured by patching each block of the reference in (and the reverse); prints a "
                        "--layer_config suggestion for qjax quantize")
    r.add_argument("--lens", action="store_true",
                   help="logit lens: each layer's residual stream through the final norm and lm_head (with "
                        "--reference: also the KL between the two models' lenses, layer by layer)")
    r.add_argument("--reference", default=None, help="the reference checkpoint (e.g. the unquantized original)")
    r.add_argument("--data", default=None,
                   help="text file (.txt, .jsonl, .json) tokenized by the reference's tokenizer (default: the "
                        "reference's heldout.txt when it has one and --seqlen is not given, else seeded random ids)")
    r.add_argument("--max-tokens", type=int, default=ROUTING_MAX_TOKENS,
                   help=f"tokens compared at most (default {ROUTING_MAX_TOKENS})")
    r.add_argument("--batch-size", type=int, default=8, help="rows per forward call (default 8)")
    r.add_argument("--min-agreement", type=float, default=None,
                   help=f"flag a layer whose isolated top-k agreement (the model's router on the reference's hidden "
                        f"states) is below this (default {ROUTING_MIN_AGREEMENT}: quantization leaves it at exactly "
                        "1; rounding alone (bfloat16 against float32) kept ≥ 0.9991 on the built-in model, an "
                        "uncompensated router after AWQ-style smoothing 0.945–0.989; docs/research.md)")
    r.add_argument("--max-router-kl", type=float, default=None,
                   help=f"also flag a layer whose isolated router KL exceeds this, nats (default "
                        f"{ROUTING_MAX_ROUTER_KL:g}: rounding alone ≤ 2.2e-6, the uncompensated router ≥ 6.3e-4)")
    r.add_argument("--plot", default=None, metavar="DIR",
                   help="also write PNG pictures into DIR (needs matplotlib: the 'plot' extra)")
    r.add_argument("--suggest-top", type=int, default=2, help="--damage: blocks the suggestion promotes (default 2)")
    r.add_argument("--suggest-bits", type=int, default=4, help="--damage: their experts' bits (default 4)")
    r.add_argument("--suggest-group-size", type=int, default=128,
                   help="--damage: their group size (default 128)")
    c.set_defaults(func=cmd_compare)


def _common(p) -> None:
    add_dtype_argument(p)
    add_compile_cache_argument(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
