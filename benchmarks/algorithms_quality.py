"""AWQ, GPTQ, RTN and AutoRound side by side (issue 51): held-out perplexity of each algorithm's export and its time
per block, on the built-in trained hybrid model, through the path ``qjax quantize --algorithm …`` takes.

The model (``qjax/assets/default``: the qwen3_5_moe architecture at 4.4M parameters — 6 Gated DeltaNet and 2 gated
full-attention layers, 4 routed experts top-2 plus the shared expert, an MTP head — trained on Jane Austen) is the
small trained hybrid: its weights and activations are a trained network's, which random models are not, and AWQ's
and GPTQ's gains depend on exactly that. Every row runs :func:`qjax.autoround.api.quantize_folder` (the streamed
block loop of ``qjax quantize``) from the BF16 folder on the same calibration (``--nsamples`` × ``--seqlen`` tokens of
the model's calib.txt), writes compressed-tensors, loads the folder back with ``qjax.load_model`` and scores all of
``heldout.txt`` (disjoint from training and calibration) in ``--seqlen``-token windows, as a ratio to BF16.

Methods: ``RTN`` = auto-round's plain round-to-nearest (``--iters 0 --disable_opt_rtn``); ``AWQ`` / ``GPTQ`` =
``--algorithm awq|gptq`` at llm-compressor's defaults (AWQ: duo scaling, 20 grid points, the router compensated;
GPTQ: block 128, dampening 0.01, act-order static); ``AutoRound`` = ``--iters`` of auto-round's sign-gradient
tuning. Schemes: seed 002's W8A16 g32, W4A16 g128 (the built-in model's 64-wide down_proj inputs are not a multiple
of 128: those layers stay BF16 for every method), W4A16 g64, and the seed-000 mix (INT2 g64 experts, INT4 g64 rest;
g64 for the same reason as benchmarks/quality.py). All symmetric, as the presets are.

    python benchmarks/algorithms_quality.py [--schemes W8G32,W4G128,W4G64,seed000] [--methods RTN,AWQ,GPTQ,AutoRound]
                                            [--iters 200 --nsamples 64 --seqlen 256 --batch-size 8] [--no-write]

Writes (replaces) the section ``## AWQ and GPTQ: held-out perplexity and time per block (issue 51)`` of RESULTS.md.
"""

from __future__ import annotations

import os

from qjax import xla_env

xla_env.apply(single_threaded=True)

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import RESULTS, git_state, write_section
from quality import SEED000, heldout_scorer, packed_matrices

SECTION = "## AWQ and GPTQ: held-out perplexity and time per block (issue 51)"
SCHEMES = {"W8G32": dict(bits=8, group_size=32), "W4G128": dict(bits=4, group_size=128),
           "W4G64": dict(bits=4, group_size=64), "seed000": SEED000}
SCHEME_NAMES = {"W8G32": "W8A16 g32 (seed 002)", "W4G128": "W4A16 g128", "W4G64": "W4A16 g64",
                "seed000": "seed-000 mix (INT2 g64 experts, INT4 g64 rest)"}
# method → (AutoRoundConfig overrides, --algorithm)
METHODS = {"RTN": (dict(iters=0, disable_opt_rtn=True), None), "AWQ": ({}, "awq"), "GPTQ": ({}, "gptq"),
           "AutoRound": ({}, None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"of {', '.join(SCHEMES)}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    ap.add_argument("--iters", type=int, default=200, help="AutoRound's iterations")
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    a = ap.parse_args(argv)
    schemes = [s for s in a.schemes.split(",") if s]
    methods = [m for m in a.methods.split(",") if m]
    for given, known, flag in ((schemes, SCHEMES, "--schemes"), (methods, METHODS, "--methods")):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")

    import qjax
    from qjax.autoround import algorithms
    from qjax.autoround.api import quantize_folder
    from qjax.autoround.data import load_tokenizer
    from qjax.autoround.driver import AutoRoundConfig
    from qjax.checkpoint.hub import default_model_dir

    folder = default_model_dir()
    held, ppl = heldout_scorer(folder, load_tokenizer(folder), a.seqlen)
    bf16 = ppl(qjax.load_model(folder, text_only=True))
    layers = 0
    print(f"BF16 held-out ppl {bf16:.3f}", flush=True)
    common = dict(iters=a.iters, nsamples=a.nsamples, seqlen=a.seqlen, batch_size=a.batch_size)
    results: dict[tuple[str, str], tuple[float, float, int]] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in schemes:
            for method in methods:
                overrides, alg = METHODS[method]
                cfg = AutoRoundConfig(**{**SCHEMES[scheme], **common, **overrides})
                out = os.path.join(tmp, f"{scheme}-{method}")
                t0 = time.perf_counter()
                quantize_folder(folder, out, cfg, dataset=os.path.join(folder, "calib.txt"), progress=False,
                                overwrite=True, algorithm=algorithms.make(alg) if alg else None)
                secs = time.perf_counter() - t0
                model = qjax.load_model(out, text_only=True)
                layers = model.config.num_hidden_layers
                p = ppl(model)
                results[(scheme, method)] = (p, secs, packed_matrices(out))
                print(f"{scheme} {method}: ppl {p:.3f} ({p / bf16:.5f}× BF16), {secs:.0f} s, "
                      f"{results[(scheme, method)][2]} matrices quantized", flush=True)
    total = time.perf_counter() - t_all

    cmd = " ".join(["python benchmarks/algorithms_quality.py",
                    shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    lines = [SECTION, "",
             f"Held-out perplexity ratio to BF16 (**{bf16:.3f}**) of each algorithm's compressed-tensors export, "
             "loaded back by qjax (lower is better; the best of each row in bold):", "",
             "| scheme | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for scheme in schemes:
        best = min(results[(scheme, m)][0] for m in methods)
        cells = [(f"**{results[(scheme, m)][0] / bf16:.5f}**" if results[(scheme, m)][0] == best
                  else f"{results[(scheme, m)][0] / bf16:.5f}") for m in methods]
        lines.append(f"| {SCHEME_NAMES[scheme]} | " + " | ".join(cells) + " |")
    lines += ["", f"Seconds per decoder block (the whole `quantize_folder` run ÷ {layers} blocks: calibration, "
              "compiles and the export included; one process for the whole table, so later rows reuse compiled "
              "programs):", "",
              "| scheme | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for scheme in schemes:
        lines.append(f"| {SCHEME_NAMES[scheme]} | "
                     + " | ".join(f"{results[(scheme, m)][1] / layers:.1f}" for m in methods) + " |")
    mats = sorted({results[k][2] for k in results})
    lines += ["",
              f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU "
              f"cores, {platform.python_version()}; qjax {git_state()}; whole run {total / 60:.0f} min",
              f"- command: `{cmd}`",
              f"- model: built-in `qjax/assets/default` (BF16, the small trained hybrid); held-out: all "
              f"{held.size:,} tokens of heldout.txt in {a.seqlen}-token windows; calibration {a.nsamples} × "
              f"{a.seqlen} tokens of calib.txt, batch {a.batch_size}; AutoRound iters {a.iters}; one run each "
              "(deterministic)",
              f"- matrices quantized per export: {', '.join(map(str, mats))} (router, shared_expert_gate, norms, "
              "embeddings, the MTP head and any layer whose input is not a multiple of the group stay BF16 for "
              "every method)", ""]
    if a.no_write:
        print("\n".join(lines))
    else:
        write_section("\n".join(lines), RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
