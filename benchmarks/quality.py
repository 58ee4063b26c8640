"""Quantization quality on the built-in trained model: held-out perplexity of BF16, RTN and AutoRound.

The model (``qjax/assets/default``: 4.4M parameters of the qwen3_5_moe architecture trained on Jane Austen) is
quantized in memory by ``qjax.autoround`` with calibration windows from its ``calib.txt`` and scored on all of its
``heldout.txt`` (disjoint from training and calibration text) in ``--seqlen``-token windows, the way the training
script scored it. For each scheme three quantizers are compared:

- ``RTN``: plain round-to-nearest (``iters=0``, optimized RTN off — auto-round's ``--iters 0 --disable_opt_rtn``);
- ``opt-RTN``: ``iters=0`` with auto-round's default optimized RTN (its imatrix-weighted scale search);
- ``AutoRound``: ``--iters`` of signed-gradient descent (auto-round's defaults otherwise).

Targets (issue 5): W2G64 AutoRound perplexity < RTN perplexity; W4G128 AutoRound within 5 % of BF16.

    python benchmarks/quality.py [--iters 200 --nsamples 128 --seqlen 256 --batch-size 8] [--no-write]

Writes (replaces) the section ``## Quantization quality on the built-in model (issue 5)`` of RESULTS.md.
"""

from __future__ import annotations

import os

from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_speed import RESULTS, git_state, write_section  # noqa: E402

SECTION = "## Quantization quality on the built-in model (issue 5)"
SCHEMES = {"W4G128": dict(bits=4, group_size=128), "W2G64": dict(bits=2, group_size=64)}
METHODS = {"RTN": dict(iters=0, disable_opt_rtn=True), "opt-RTN": dict(iters=0), "AutoRound": {}}


def quantized_modules(results: dict) -> tuple[int, int]:
    """(quantized units, quantized weight matrices counting each expert)."""
    units = sum(len(r) for r in results.values())
    mats = sum(int(np.prod(u.packed.shape[:-2])) if u.packed.ndim > 2 else 1 for r in results.values()
               for u in r.values())
    return units, mats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)

    import qjax
    from qjax.autoround.data import calibration_ids, load_tokenizer
    from qjax.autoround.driver import AutoRound, AutoRoundConfig
    from qjax.builtin import train as T
    from qjax.checkpoint.hub import default_model_dir

    folder = default_model_dir()
    model = qjax.load_model(folder)
    tok = load_tokenizer(folder)
    with open(os.path.join(folder, "heldout.txt"), encoding="utf-8") as f:
        held = np.asarray(tok.encode(f.read()).ids, np.int32)
    calib = calibration_ids(os.path.join(folder, "calib.txt"), tok, nsamples=a.nsamples, seqlen=a.seqlen, seed=42,
                            vocab_size=model.config.vocab_size)

    def ppl(m) -> float:
        nll, _ = T.mean_nll(m, held, seqlen=a.seqlen, batch=8)
        return float(np.exp(nll))

    bf16 = ppl(model)
    print(f"BF16 held-out ppl {bf16:.3f}", flush=True)
    rows = []
    for sname in a.schemes.split(","):
        for mname, over in METHODS.items():
            cfg = AutoRoundConfig(**{**SCHEMES[sname], "iters": a.iters, "nsamples": a.nsamples, "seqlen": a.seqlen,
                                     "batch_size": a.batch_size, **over})
            t0 = time.perf_counter()
            ar = AutoRound(model, calib, cfg, progress=False)
            ar.run()
            secs = time.perf_counter() - t0
            qm = ar.quantized_model()
            p = ppl(qm)
            units, mats = quantized_modules(ar.results)
            rows.append((sname, mname, cfg.iters, p, secs, units, mats))
            print(f"{sname} {mname}: ppl {p:.3f} ({p / bf16:.3f}× BF16), {secs:.0f} s, {units} units / {mats} "
                  f"matrices quantized", flush=True)

    by = {(r[0], r[1]): r[3] for r in rows}
    checks = []
    if ("W2G64", "AutoRound") in by:
        ar_, rtn = by[("W2G64", "AutoRound")], by[("W2G64", "RTN")]
        checks.append(f"W2G64 AutoRound ppl {ar_:.2f} vs RTN {rtn:.2f}: ratio {ar_ / rtn:.3f} "
                      f"({'met' if ar_ < rtn else 'MISSED'}; target < 1)")
    if ("W4G128", "AutoRound") in by:
        w4 = by[("W4G128", "AutoRound")]
        checks.append(f"W4G128 AutoRound ppl {w4:.2f} vs BF16 {bf16:.2f}: ratio {w4 / bf16:.3f} "
                      f"({'met' if w4 <= 1.05 * bf16 else 'MISSED'}; target ≤ 1.05)")
    for c in checks:
        print(c)

    cmd = " ".join(["python benchmarks/quality.py", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    lines = [SECTION, "",
             f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPU "
             f"cores, {platform.python_version()}; qjax {git_state()}",
             f"- command: `{cmd}`",
             f"- model: built-in `qjax/assets/default` (BF16); held-out: all {held.size:,} tokens of heldout.txt in "
             f"{a.seqlen}-token windows; calibration: {a.nsamples} × {a.seqlen} tokens of calib.txt; batch "
             f"{a.batch_size}; AutoRound iters {a.iters}, otherwise auto-round 0.16.1's defaults",
             "- one run each (deterministic: fixed seeds, single-threaded XLA:CPU); time = calibration + tuning, "
             "on this machine's 2 cores (shared with whatever else runs: indicative)",
             "- units the scheme cannot quantize stay BF16: a dimension not a multiple of 32 (auto-round's rule), or "
             "an input dimension not a multiple of the group size (W4G128: every down_proj, input 64; auto-round "
             "would pad the last group, which compressed-tensors cannot store); router, "
             "shared_expert_gate, norms, embeddings and lm_head are never quantized", "",
             f"BF16 perplexity: **{bf16:.3f}**", "",
             "| scheme | method | iters | held-out ppl | × BF16 | seconds | units (matrices) quantized |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for sname, mname, iters, p, secs, units, mats in rows:
        lines.append(f"| {sname} | {mname} | {iters} | {p:.3f} | {p / bf16:.3f} | {secs:.0f} | {units} ({mats}) |")
    lines += [""] + [f"- {c}" for c in checks] + [""]
    if not a.no_write:
        write_section("\n".join(lines), RESULTS, SECTION)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
