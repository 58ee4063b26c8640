"""Train the built-in default model's MTP head (the speculative drafter) over its frozen body, on a CPU.

    python benchmarks/train_mtp_head.py --out qjax/assets/default [--minutes 12] [--steps N] [--init random]

Reads the shipped model in ``--out`` (float32 in memory), adds a one-layer MTP head (``mtp.*``: fc over
[embedding of token t+1, hidden h_t], one full-attention + MoE decoder layer, norm, the tied lm_head) and trains only
that head (:func:`qjax.builtin.train.train_mtp`: cross-entropy of token t+2 + 0.01 · the head's MoE balancing loss)
on the default model's own training split — the same corpus, splits and token stream as
``benchmarks/train_default_model.py`` (its functions, imported), tokenized with the shipped tokenizer — in random
windows of ``--seqlen`` + 2 tokens (the body sees ``--seqlen``, the head predicts ``--seqlen``).

Measures on all of ``heldout.txt`` before and after (:func:`qjax.builtin.train.mtp_accuracy`): the head's loss and
top-1 accuracy for token t+2, and its agreement with the main model's greedy token at t+2 (what a greedy draft's
acceptance is), then the acceptance of real greedy speculative decoding (``qjax.generate(speculative="mtp")``) from
held-out prompts. Writes the folder back (atomically: a temporary folder renamed into place) in BF16 with the
``mtp.*`` tensors added and ``"mtp_num_hidden_layers": 1`` in config.json; every tensor already there keeps its bytes
(checked before the folder is replaced), ``training_log.json`` gains an ``mtp`` section and README.md a section
"MTP head".

Time: the script is sized to ``--minutes`` (default 12) on 2 CPU cores: training gets what is left after loading and
the first evaluation, less ``--reserve-s`` for the final evaluation and writing; ``--steps`` caps it (the step count
reached is logged; passing it as ``--steps`` with a larger ``--minutes`` repeats the run).
"""

from __future__ import annotations

import os

# one single-threaded XLA:CPU program, as in train_default_model.py (must be set before jax starts)
from qjax import xla_env  # noqa: E402

xla_env.apply(single_threaded=True)

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default_model as tdm  # noqa: E402  (the corpus and its splits)

from qjax.builtin.train import MTP_INITS  # noqa: E402

README_SECTION = "## MTP head"
# files the writer regenerates; everything else in the folder is carried over as it is
REWRITTEN = ("config.json", "model.safetensors", "generation_config.json", "README.md", "training_log.json")


def check_body_unchanged(old_dir: str, new_dir: str) -> tuple[int, int]:
    """Every tensor of ``old_dir``'s model.safetensors is in ``new_dir``'s with the same dtype, shape and bytes; the
    new file adds only ``mtp.*``. Returns (tensors kept, tensors added)."""
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    with SafetensorsFile(os.path.join(old_dir, "model.safetensors")) as old, \
            SafetensorsFile(os.path.join(new_dir, "model.safetensors")) as new:
        old_keys = [k for k in old.keys() if not k.startswith("mtp.")]  # a rerun replaces the previous head
        for k in old_keys:
            if k not in new or old.dtype(k) != new.dtype(k) or old.shape(k) != new.shape(k):
                raise SystemExit(f"tensor {k}: missing or reshaped in the new checkpoint")
            if old.get(k).tobytes() != new.get(k).tobytes():
                raise SystemExit(f"tensor {k}: bytes changed")
        added = sorted(set(new.keys()) - set(old_keys))
        if not added or any(not k.startswith("mtp.") for k in added):
            raise SystemExit(f"the new checkpoint adds {added}; expected mtp.* only")
        return len(old_keys), len(added)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="qjax/assets/default", help="the default model's folder (updated in place)")
    ap.add_argument("--corpus", default=None, help="r-cran-janeaustenr .deb or installed janeaustenr folder")
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget of the whole script")
    ap.add_argument("--steps", type=int, default=2000, help="training steps (fewer if --minutes runs out)")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=MTP_INITS[0], choices=MTP_INITS,
                    help="head initialisation (qjax.builtin.train.add_mtp_head, which says why random)")
    ap.add_argument("--reserve-s", type=float, default=150.0,
                    help="seconds kept for the final evaluation and writing after training")
    ap.add_argument("--no-write", action="store_true", help="train and measure only (compare settings)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    import qjax
    from qjax.builtin import train as T
    from qjax.builtin.train_tokenizer import ENDOFTEXT
    from qjax.convert.hf_writer import save_pretrained, write_atomically

    def say(msg):
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    out = os.path.abspath(a.out)
    record = _read_json(os.path.join(out, "training_log.json"))

    # the training stream, exactly as train_default_model.py built it (checked against its log)
    rdx, rdb, source = tdm.load_corpus_files(a.corpus)
    train_parts, heldout_text, _ = tdm.corpus_splits(tdm.read_novels(rdx, rdb))
    with open(os.path.join(out, "heldout.txt"), encoding="utf-8") as f:
        if f.read() != heldout_text:
            raise SystemExit(f"{out}/heldout.txt is not this corpus's held-out split")
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    train_ids = tdm.training_stream(tok, train_parts, tok.token_to_id(ENDOFTEXT))
    if train_ids.size != record["tokenizer"]["train_tokens"]:
        raise SystemExit(f"training stream has {train_ids.size} tokens, the model's log says "
                         f"{record['tokenizer']['train_tokens']}")
    held_ids = np.asarray(tok.encode(heldout_text).ids, np.int32)
    say(f"corpus: {source}; train {train_ids.size:,} tokens, held-out {held_ids.size:,} tokens")

    # the model, a fresh head, the baseline measurement
    model = T.add_mtp_head(qjax.load_model(out, dtype="float32"), init=a.init, seed=a.seed)
    n_head = T.count_params(model.mtp)
    before = T.mtp_accuracy(model, held_ids, seqlen=a.seqlen, batch=8)
    say(f"head ({a.init} init, {n_head:,} parameters) before training: " + _fmt(before))

    tc = T.TrainConfig(steps=a.steps, batch=a.batch, seqlen=a.seqlen, lr=a.lr, warmup_steps=a.warmup, seed=a.seed)
    budget = a.minutes * 60 - (time.perf_counter() - t0) - a.reserve_s
    say(f"training the head for ≤ {a.steps} steps of {a.batch}×{a.seqlen} predicted tokens within {budget:.0f} s")

    def show(step, e):
        if "event" in e:
            say(f"step {step}: {e['step_s']:.3f} s/step → run shortened to {e['steps']} steps")
        else:
            say(f"step {step}: loss {e['loss']:.4f} ce {e['ce']:.4f} aux {e['aux']:.3f} |g| {e['grad_norm']:.2f} "
                f"lr {e['lr']:.2e}")

    t_train = time.perf_counter()
    model, log = T.train_mtp(model, T.batches(train_ids, a.batch, a.seqlen + 1, seed=a.seed), tc,
                             time_budget_s=budget, log_every=25, callback=show)
    train_s = time.perf_counter() - t_train
    steps = log[-1]["step"]
    after = T.mtp_accuracy(model, held_ids, seqlen=a.seqlen, batch=8)
    say(f"trained {steps} steps in {train_s:.0f} s; fp32 head: " + _fmt(after))
    if a.no_write:
        return 0

    # write: save into a scratch folder, check the body's bytes and measure the BF16 head there, then swap it in
    work = tempfile.mkdtemp(prefix="qjax-mtp-")
    try:
        new_dir = os.path.join(work, "model")
        carried = [os.path.join(out, n) for n in sorted(os.listdir(out)) if n not in REWRITTEN]
        # generation_config.json as it is (the writer would regenerate it from the loaded settings)
        save_pretrained(model, new_dir, dtype=jnp.bfloat16,
                        extra_files=carried + [os.path.join(out, "generation_config.json")])
        kept, added = check_body_unchanged(out, new_dir)
        old_cfg, new_cfg = (_read_json(os.path.join(d, "config.json")) for d in (out, new_dir))
        diff = {k for k in old_cfg.keys() | new_cfg.keys() if old_cfg.get(k) != new_cfg.get(k)}
        if diff - {"mtp_num_hidden_layers"} or new_cfg["mtp_num_hidden_layers"] != 1:
            raise SystemExit(f"config.json changed in {sorted(diff)}; expected mtp_num_hidden_layers → 1 only")
        say(f"saved: {kept} tensors byte-identical, {added} mtp.* tensors added")

        shipped = qjax.load_model(new_dir)  # as users get it: BF16
        if shipped.mtp is None:
            raise SystemExit("the saved checkpoint loads without its MTP head")
        bf16 = T.mtp_accuracy(shipped, held_ids, seqlen=a.seqlen, batch=8)
        say("BF16 checkpoint: " + _fmt(bf16))
        spec = speculative_acceptance(qjax, shipped, held_ids)
        say(f"greedy speculative decoding (k = 1, {spec['prompts']} held-out prompts of {spec['prompt_tokens']} "
            f"tokens, {spec['new_tokens']} new): acceptance {spec['acceptance']:.3f}, "
            f"{spec['mean_accepted_length']:.3f} tokens per verify call")

        record["mtp"] = {
            "head": {"layers": 1, "parameters": n_head, "init": a.init},
            "training": {**dataclasses.asdict(tc), "steps_run": steps, "train_seconds": round(train_s, 1),
                         "window_tokens": a.seqlen + 2, "tokens_predicted": steps * a.batch * a.seqlen,
                         "trainable": "mtp.* only (body, embedding and tied lm_head frozen)", "log": log},
            "eval": {"heldout_scored_tokens": bf16["tokens"], "seqlen": a.seqlen,
                     "before": _rounded(before), "after_fp32": _rounded(after), "after_bf16": _rounded(bf16),
                     "speculative_greedy_k1": spec},
            "environment": {"python": platform.python_version(), "jax": jax.__version__, "cpu_count": os.cpu_count(),
                            "machine": platform.processor() or platform.machine(),
                            "xla_flags": os.environ.get("XLA_FLAGS", ""),
                            "command": " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])},
            "total_seconds": None,
        }
        record["mtp"]["total_seconds"] = round(time.perf_counter() - t0, 1)
        with open(os.path.join(new_dir, "training_log.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        with open(os.path.join(new_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(readme.split("\n" + README_SECTION + "\n")[0].rstrip("\n") + "\n\n" + render_section(record))

        def swap_in(tmp: str) -> None:
            for name in os.listdir(new_dir):
                shutil.copyfile(os.path.join(new_dir, name), os.path.join(tmp, name))

        write_atomically(out, swap_in, overwrite=True)
        os.chmod(out, 0o755)  # write_atomically builds the folder with mkdtemp (0700)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"wrote {out} (total {time.perf_counter() - t0:.0f} s)")
    return 0


def speculative_acceptance(qjax, model, held_ids: np.ndarray, *, prompts: int = 8, prompt_tokens: int = 32,
                           new_tokens: int = 64) -> dict:
    """Greedy ``qjax.generate(speculative="mtp", num_speculative_tokens=1)`` from ``prompts`` held-out windows
    spread over ``heldout.txt``: the fraction of verify rounds whose draft was accepted."""
    starts = np.linspace(0, held_ids.size - prompt_tokens - 1, prompts).astype(int)
    ids = np.stack([held_ids[s:s + prompt_tokens] for s in starts])
    _, stats = qjax.generate(model, ids, max_new_tokens=new_tokens, do_sample=False, speculative="mtp",
                             num_speculative_tokens=1, return_stats=True)
    return {"prompts": prompts, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "acceptance": round(stats.acceptance_per_position[0], 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4)}


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _fmt(m: dict) -> str:
    return (f"loss {m['loss']:.3f}, top-1 {m['top1']:.3f}, agreement with main greedy {m['agree']:.3f} "
            f"(chance {m['agree_mode']:.3f}; main model top-1 {m['main_top1']:.3f}) on {m['tokens']:,} tokens")


def _rounded(m: dict) -> dict:
    return {k: (int(v) if k == "tokens" else round(float(v), 4)) for k, v in m.items()}


def render_section(r: dict) -> str:
    """README.md's MTP section from ``training_log.json``'s ``mtp`` record."""
    m = r["mtp"]
    t, e, h = m["training"], m["eval"], m["head"]
    b, f, s = e["before"], e["after_bf16"], e["speculative_greedy_k1"]
    return f"""{README_SECTION}

`mtp.*` ({h['parameters'] / 1e6:.2f} M parameters, BF16) is a one-layer multi-token-prediction head, the drafter of
`qjax generate --speculative mtp` and `qjax serve --speculative-config`: from the main model's final hidden state
h_t and the token at t+1 it predicts the token at t+2 (`fc` over [embedding, hidden], one full-attention + MoE
decoder layer, its own norm, the tied lm_head). It was trained after the model, alone: the body, the embedding and
the lm_head are frozen (their tensors are byte-identical to those of the model trained above), by
`benchmarks/train_mtp_head.py` with `qjax.builtin.train.train_mtp` on the same training split — cross-entropy of
token t+2 + {t['aux_loss_coef']} × the head's MoE load-balancing loss, AdamW peak LR {t['lr']} ({t['warmup_steps']}
warmup steps, cosine to {t['lr'] * t['min_lr_ratio']:.0e}), batch {t['batch']} × {t['seqlen']} predicted tokens,
`{h['init']}` init — {t['steps_run']} steps ({t['tokens_predicted']:,} tokens) in
{t['train_seconds']:.0f} s on {m['environment']['cpu_count']} CPU cores (`{m['environment']['command']}`; the
time budget decided the step count). Reproduce with

    python benchmarks/train_mtp_head.py --out qjax/assets/default --steps {t['steps_run']} --minutes 40

Held-out ({e['heldout_scored_tokens']:,} tokens of `heldout.txt`, {e['seqlen']}-token windows), before → after
training, BF16 checkpoint:

| | before | after |
|---|---|---|
| loss of token t+2 (nats) | {b['loss']:.3f} | **{f['loss']:.3f}** |
| top-1 accuracy of token t+2 | {b['top1']:.3f} | **{f['top1']:.3f}** |
| agreement with the main model's greedy token at t+2 | {b['agree']:.3f} | **{f['agree']:.3f}** |

The agreement is a greedy draft's acceptance rate (the token at t+1 given); always drafting the main model's most
frequent greedy token would agree {f['agree_mode']:.3f} of the time, and the main model itself predicts the next
token with top-1 accuracy {f['main_top1']:.3f}. Real greedy speculative decoding with one draft per step
(`qjax.generate(speculative="mtp")`, {s['prompts']} held-out prompts of {s['prompt_tokens']} tokens,
{s['new_tokens']} new tokens each) accepted {s['acceptance']:.3f} of the drafts
({s['mean_accepted_length']:.2f} tokens per main-model call; greedy output loops, which makes drafts easier).
"""


if __name__ == "__main__":
    sys.exit(main())
