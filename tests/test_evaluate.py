"""``qjax eval ppl`` and ``qjax eval fidelity`` (qjax.evaluation.evaluate) through the real entry point, each checked
against a computation done here another way, plus the refusals (one ``error:`` line, exit status 2).

Models: the built-in one (4.4M parameters, its tokenizer, chat template and heldout.txt), an RTN W4 g64 copy of it
made here, and the tiny random transformers checkpoint of conftest.py.

Tolerances: ppl and fidelity numbers are recomputed in float32 with another batching (unpadded windows, right-padded
rows instead of left-padded ones), which moves summed NLLs by ~1e-6 relative (1e-4 allowed) and can flip a top-1
only at a near-tie (one token allowed).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import qjax
from qjax.checkpoint.hub import default_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

BUILTIN = default_model_dir()
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy walked into the room and",
           "The weather at Longbourn was", "She could not help thinking that"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Subprocess environment with a persistent XLA compilation cache: the two fidelity runs share the reference's
    generate and scoring programs (the first compile of the decode loop is most of a run's time on 2 cores)."""
    cache = tmp_path_factory.mktemp("jax-cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}


def _qjax(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "qjax.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def reference():
    import jax.numpy as jnp

    return qjax.load_model(BUILTIN, dtype=jnp.float32)


def _nll_and_top1(model, rows: list[list[int]], spans: list[int]) -> tuple[float, int]:
    """Summed NLL and top-1 hits of the last ``spans[i]`` tokens of each row, in one float32 forward of ``[8, 257]``
    (one compiled shape for every check here): rows right-padded with 0, which causality makes harmless."""
    assert len(rows) <= 8 and max(len(r) for r in rows) <= 257
    ids = np.zeros((8, 257), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    logits = np.asarray(model(ids), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll, hits = 0.0, 0
    for i, (r, n) in enumerate(zip(rows, spans)):
        pos = np.arange(len(r) - n - 1, len(r) - 1)  # positions predicting the span
        target = np.asarray(r[len(r) - n:])
        nll -= logp[i, pos, target].sum()
        hits += int(np.sum(logits[i, pos].argmax(-1) == target))
    return nll, hits


# ---------------------------------------------------------------------------------------------------------------------
# eval ppl
# ---------------------------------------------------------------------------------------------------------------------
def test_ppl_matches_an_independent_computation(env, reference):
    r = _qjax(env, "eval", "ppl", "--seqlen", "256", "--max-tokens", str(8 * 256 + 5), "--dtype", "float32",
              "--json", "--quiet")
    got = _json(r)
    assert (got["windows"], got["scored_tokens"], got["data_tokens"], got["unscored_tail"]) == (8, 2048, 2053, 4)
    assert got["data"] == os.path.join(BUILTIN, "heldout.txt")  # the default --data of the built-in model

    from tokenizers import Tokenizer

    with open(os.path.join(BUILTIN, "heldout.txt"), encoding="utf-8") as f:
        ids = np.asarray(Tokenizer.from_file(os.path.join(BUILTIN, "tokenizer.json")).encode(f.read()).ids[:2049])
    wins = ids[:2049].reshape(-1)[np.arange(8)[:, None] * 256 + np.arange(257)[None]]  # [8, 257], overlap of one
    nll, _ = _nll_and_top1(reference, wins.tolist(), [256] * 8)
    assert got["mean_nll"] == pytest.approx(nll / 2048, rel=1e-4)
    assert got["ppl"] == pytest.approx(math.exp(got["mean_nll"]), rel=1e-12)
    # sane against the training log (all of heldout.txt at seqlen 256; this is its first 2,048 tokens)
    with open(os.path.join(BUILTIN, "training_log.json"), encoding="utf-8") as f:
        logged = json.load(f)["eval"]["ppl_fp32"]
    assert 0.7 * logged < got["ppl"] < 1.5 * logged, (got["ppl"], logged)


def test_jsonl_paragraphs_tokenize_like_the_text(tmp_path):
    from qjax.evaluation.evaluate import load_tokenizer, read_texts, tokenize_texts

    text = "First paragraph, with words.\n\nSecond one; more words.\n\nThird."
    (tmp_path / "a.txt").write_text(text)
    with open(tmp_path / "a.jsonl", "w") as f:
        for p in text.split("\n\n"):
            f.write(json.dumps({"text": p}) + "\n")
    (tmp_path / "a.json").write_text(json.dumps(text.split("\n\n")))
    tok = load_tokenizer(BUILTIN)
    want = tokenize_texts(read_texts(str(tmp_path / "a.txt")), tok)
    assert want.tolist() == tok.encode(text)
    for name in ("a.jsonl", "a.json"):
        np.testing.assert_array_equal(tokenize_texts(read_texts(str(tmp_path / name)), tok), want)


def _short_text(tmp_path, n_chars: int = 300) -> tuple[str, np.ndarray]:
    """(path, token ids) of the first ``n_chars`` characters of heldout.txt: ~70 tokens, fewer than --seqlen 256."""
    from qjax.evaluation.evaluate import load_tokenizer, read_texts, tokenize_texts

    with open(os.path.join(BUILTIN, "heldout.txt"), encoding="utf-8") as f:
        text = f.read()[:n_chars]
    path = tmp_path / "short.txt"
    path.write_text(text, encoding="utf-8")
    return str(path), tokenize_texts(read_texts(str(path)), load_tokenizer(BUILTIN))


def test_text_shorter_than_seqlen_is_one_window_of_its_length(tmp_path, reference):
    import jax.numpy as jnp

    from qjax.evaluation.evaluate import mean_nll, perplexity_of_file

    path, ids = _short_text(tmp_path)
    assert 2 < ids.size < 257
    r = perplexity_of_file(BUILTIN, path, seqlen=256, dtype=jnp.float32)
    assert (r.seqlen, r.requested_seqlen, r.windows, r.data_tokens, r.scored_tokens, r.unscored_tail) == \
        (ids.size - 1, 256, 1, ids.size, ids.size - 1, 0)
    assert r.note == f"{path} has {ids.size} tokens, fewer than --seqlen 256 + 1: scored as one window of {ids.size - 1}"
    # the same program on the same float32 weights: the same number
    assert (r.mean_nll, r.scored_tokens) == mean_nll(reference, ids, seqlen=ids.size - 1)
    assert r.ppl == math.exp(r.mean_nll)
    assert f"{ids.size} tokens → 1 window of {ids.size - 1} (--seqlen 256 requested" in r.format()
    assert r.to_dict()["requested_seqlen"] == 256

    # a text of at least one window keeps the requested seqlen and says nothing more
    whole = perplexity_of_file(BUILTIN, path, seqlen=ids.size - 1, dtype=jnp.float32)
    assert (whole.seqlen, whole.requested_seqlen, whole.note) == (ids.size - 1, None, None)
    assert whole.mean_nll == r.mean_nll
    assert "requested_seqlen" not in whole.to_dict() and "note" not in whole.to_dict()
    assert "requested" not in whole.format()


def test_short_text_cli_prints_a_note_and_scores_it(capsys, tmp_path):
    from qjax.cli import main

    path, ids = _short_text(tmp_path)
    assert main(["eval", "ppl", "--data", path, "--seqlen", "256", "--dtype", "float32", "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == (f"qjax eval ppl: note: {path} has {ids.size} tokens, fewer than --seqlen 256 + 1: scored "
                           f"as one window of {ids.size - 1}")
    got = json.loads(out)
    assert (got["seqlen"], got["requested_seqlen"], got["windows"], got["scored_tokens"]) == \
        (ids.size - 1, 256, 1, ids.size - 1)
    assert math.isfinite(got["ppl"]) and got["ppl"] > 1

    # --max-tokens cutting the text below one window: the same rule, the note names --max-tokens
    assert main(["eval", "ppl", "--seqlen", "256", "--max-tokens", "100", "--dtype", "float32", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == ("qjax eval ppl: note: --max-tokens 100 keeps 100 tokens, fewer than --seqlen 256 + 1: "
                           "scored as one window of 99")
    assert "100 tokens → 1 window of 99 (--seqlen 256 requested: fewer than 257 tokens); 99 tokens scored" in out


# ---------------------------------------------------------------------------------------------------------------------
# eval fidelity
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n")  # a trailing blank line is not a prompt
    return str(path)


@pytest.fixture(scope="module")
def rtn_copy(tmp_path_factory, reference):
    """The built-in model RTN-quantized as the Qwen3.6 target recipe (routed experts INT2 g64, other linears INT4 g64,
    symmetric; compressed-tensors) with its tokenizer files. INT4 alone left 12-token answers' argmaxes unchanged."""
    from qjax.convert import save_pretrained

    from qjax.autoround.rtn import quantize_model

    scheme = lambda bits: {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"experts": {"targets": [r"re:.*mlp\.experts\..*"], "weights": scheme(2)},
                            "rest": {"targets": ["Linear"], "weights": scheme(4)}}}
    out = tmp_path_factory.mktemp("rtn") / "w2w4"
    extra = [os.path.join(BUILTIN, f) for f in ("tokenizer.json", "tokenizer_config.json")]
    # from the float32 copy already loaded (its weights are the checkpoint's bf16 values)
    return save_pretrained(quantize_model(reference, qc), out, extra_files=extra)


def _fidelity(env, model, prompts_file):
    return _json(_qjax(env, "eval", "fidelity", "--model", model, "--reference", BUILTIN, "--prompts", prompts_file,
                       "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", "--dtype", "float32", "--json",
                       "--quiet"))


@pytest.fixture(scope="module")
def self_fidelity(env, prompts_file):
    """``eval fidelity`` with the built-in model as both model and reference."""
    return _fidelity(env, BUILTIN, prompts_file)


def test_fidelity_of_the_reference_to_itself(self_fidelity, reference):
    from qjax.evaluation.evaluate import encode_prompts, load_tokenizer

    got = self_fidelity
    assert got["chat"] is True  # the built-in folder has a chat template, so it is used by default
    assert got["prompts"] == len(PROMPTS)
    answers, n = got["answers"], got["scored_tokens"]
    assert n == sum(len(a) for a in answers) > 0
    assert got["ppl"] == got["reference_ppl"] and got["ppl_change"] == 0.0
    assert got["agreement"] == got["reference_agreement"] == 1.0

    # recomputed here: each prompt rendered as a user message, its answer ended by a stop token or the length limit,
    # and the answer tokens' NLL and argmax from a right-padded forward (the CLI left-pads)
    tok = load_tokenizer(BUILTIN)
    prompt_ids = encode_prompts(PROMPTS, tok, chat=True)
    assert prompt_ids[0] == tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    stops = set(tok.stop_token_ids)
    for a in answers:
        assert 1 <= len(a) <= MAX_NEW and (a[-1] in stops or len(a) == MAX_NEW) and not stops & set(a[:-1])
    nll, hits = _nll_and_top1(reference, [p + a for p, a in zip(prompt_ids, answers)], [len(a) for a in answers])
    assert got["reference_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert hits == n  # the answers are the reference's greedy ones: its own argmax at every position


def test_fidelity_of_an_rtn_copy(env, prompts_file, rtn_copy, self_fidelity):
    base = self_fidelity
    got = _fidelity(env, rtn_copy, prompts_file)  # the reference's programs come from the compilation cache
    # the reference side is the same computation whatever the model is
    for key in ("answers", "reference_ppl", "reference_agreement", "scored_tokens", "prompts"):
        assert got[key] == base[key], key
    # INT2 experts / INT4 rest change some argmaxes but keep most (measured: 38 of 48, ppl 5.106 vs 5.293 — the
    # quantized model happens to be more confident on these answers, so only "different" is asserted for the ppl)
    assert 0.5 < got["agreement"] < 1.0
    assert got["ppl"] != got["reference_ppl"]
    assert got["ppl_change"] == pytest.approx(got["ppl"] / got["reference_ppl"] - 1, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------------
def test_missing_data_file_exits_2(env, tmp_path):
    r = _qjax(env, "eval", "ppl", "--data", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"error: --data {tmp_path / 'nope.txt'}: no such file"


def _main(capsys, *argv) -> str:
    from qjax.cli import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_refusals_name_the_file_or_option(capsys, tmp_path, tiny_hf, prompts_file):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    assert str(empty) in _main(capsys, "eval", "ppl", "--data", str(empty))
    one = tmp_path / "one.txt"
    one.write_text("a")  # one token: nothing to predict (a short text of ≥ 2 tokens is one window of its own length)
    err = _main(capsys, "eval", "ppl", "--data", str(one), "--seqlen", "256")
    assert err == f"error: --data {one} holds 1 token; perplexity needs at least 2 (one to read, one to predict)"
    assert "Traceback" not in err
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    err = _main(capsys, "eval", "ppl", "--model", tiny_hf[1], "--data", str(short))
    assert tiny_hf[1] in err and "no tokenizer.json" in err
    err = _main(capsys, "eval", "fidelity", "--model", tiny_hf[1], "--reference", BUILTIN, "--prompts", prompts_file)
    assert "vocabulary of 512 tokens" in err and "4096" in err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    err = _main(capsys, "eval", "fidelity", "--model", BUILTIN, "--reference", BUILTIN, "--prompts", str(bad))
    assert f"{bad}:2" in err and "'prompt'" in err
