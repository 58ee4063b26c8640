"""qjax.evaluation.lm_eval_adapter: lm-eval's three request types against direct qjax and transformers scoring on a tiny
random checkpoint (word-level tokenizer written here), then the real lm-eval command line on the built-in Austen model
with local tasks written into tmp_path (multiple choice, rolling perplexity, generation).

Numbers behind the CLI thresholds: the built-in model's training_log.json records a held-out token perplexity of
≈ 72 (256-token windows) against ≈ 618 for a unigram model; the paragraphs scored here are short, so their first
tokens see little context and the token perplexity implied by lm-eval's word_perplexity is allowed up to 2.5× the
logged value, and must beat the unigram baseline by 3×. A 12-word Austen context followed by its true 6-word
continuation vs. two shuffles of the same words: the model must pick the original in ≥ 75 % of 16 items (chance 33 %).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from eval_tasks import austen_tasks
from oracles.hf import hf_generate_greedy, hf_logits, make_hf_model, save_hf, tiny_text_config

from qjax.checkpoint.hub import default_model_dir

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from qjax.evaluation.lm_eval_adapter import QJaxLM, bucket_length  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

VOCAB = 512
EOT = VOCAB - 1  # "<|endoftext|>", last id of the word-level vocabulary
# every in-process request fits one [BATCH, 64] program: each new shape costs ~10 s of XLA:CPU compile here
BATCH = 4


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, str]:
    """(transformers model, folder): tiny random checkpoint with a word-level tokenizer "w0".."w509"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = make_hf_model(tiny_text_config(), seed=3)
    folder = save_hf(hf, tmp_path_factory.mktemp("tiny-lm-eval"))
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["[UNK]"], vocab["<|endoftext|>"] = VOCAB - 2, EOT
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="[UNK]").save_pretrained(folder)
    return hf, folder


@pytest.fixture(scope="module")
def lm(tiny) -> QJaxLM:
    return QJaxLM(pretrained=tiny[1], dtype="float32", batch_size=BATCH)


def _logp(logits: np.ndarray, ids: list[int], n_cont: int) -> tuple[float, bool]:
    """log p(last n_cont of ids | the ones before) and greedy-ness from the logits of ``ids[:-1]``."""
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    pos = np.arange(len(ids) - 1 - n_cont, len(ids) - 1)
    tgt = np.asarray(ids)[pos + 1]
    return float(logp[pos, tgt].sum()), bool(np.all(logits[pos].argmax(-1) == tgt))


def _hf(hf, ids: list[int], n_cont: int) -> tuple[float, bool]:
    """The reference: transformers on exactly ``ids`` (unpadded, unbatched)."""
    return _logp(hf_logits(hf, np.asarray(ids[:-1])[None])[0], ids, n_cont)


def _ll(reqs) -> list[Instance]:
    return [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 64, 65, 256, 257, 320, 513, 4000, 4096)] == \
        [64, 64, 128, 256, 320, 320, 640, 4096, 4096]
    assert all(bucket_length(n) % 64 == 0 and n <= bucket_length(n) <= max(n + 63, 1.25 * n) for n in range(1, 5000))


def test_loglikelihood_matches_qjax_and_transformers(tiny, lm):
    """Requests of 4…60 tokens right-padded together in batches of 4, the trailing-space convention and a greedy
    continuation: each equals transformers on the unpadded request, and the longest equals qjax's own logits."""
    hf, _ = tiny
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB - 2, n).tolist() for n in (4, 20, 37, 60, 9)]
    reqs = [(_words(s[:-k]), " " + _words(s[-k:])) for s, k in zip(seqs, (1, 3, 5, 2, 7))]
    reqs.append((_words(seqs[2][:-5]) + " ", _words(seqs[2][-5:])))  # trailing context space moves to the continuation
    # a continuation made of the model's own greedy tokens must come back is_greedy=True
    ctx = seqs[1]
    greedy = hf_generate_greedy(hf, np.asarray(ctx)[None], 3)[0, len(ctx):].tolist()
    reqs.append((_words(ctx), " " + _words(greedy)))
    got = lm.loglikelihood(_ll(reqs), disable_tqdm=True)

    for (c, x), (lp, is_greedy) in zip(reqs, got):
        ids = lm.tok_encode(c + x)
        n_cont = len(ids) - len(lm.tok_encode(c.rstrip()))
        ref_lp, ref_greedy = _hf(hf, ids, n_cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4, rel=1e-5)
        assert is_greedy == ref_greedy
    assert got[5] == pytest.approx(got[2], abs=1e-6)
    assert got[-1][1] is True

    ids = seqs[3]
    direct = _logp(np.asarray(lm.model(np.asarray(ids[:-1], np.int32)[None]))[0], ids, 2)
    assert got[3][0] == pytest.approx(direct[0], abs=1e-4, rel=1e-5) and got[3][1] == direct[1]


def test_empty_context_and_truncation(tiny):
    """Empty context: conditioned on the end-of-text token. Longer than max_length: the window keeps the last
    max_length + 1 tokens (HFLM)."""
    hf, folder = tiny
    lm16 = QJaxLM(pretrained=folder, dtype="float32", batch_size=BATCH, max_length=16)
    rng = np.random.default_rng(1)
    cont, long = rng.integers(0, VOCAB - 2, 4).tolist(), rng.integers(0, VOCAB - 2, 40).tolist()
    (lp_empty, _), (lp_long, _) = lm16.loglikelihood(
        _ll([("", _words(cont)), (_words(long[:-6]), " " + _words(long[-6:]))]), disable_tqdm=True)
    assert lp_empty == pytest.approx(_hf(hf, [EOT] + cont, 4)[0], abs=1e-4)
    assert lp_long == pytest.approx(_hf(hf, long[-17:], 6)[0], abs=1e-4)


def test_loglikelihood_rolling(tiny):
    """max_length 16: a 40-token document is scored in disjoint windows of ≤ 16 predictions, each conditioned on the
    up to 16 tokens before its end (the first on the end-of-text token, the last partial window on a full context),
    summed; a 9-token document is one window."""
    hf, folder = tiny
    lm16 = QJaxLM(pretrained=folder, dtype="float32", batch_size=BATCH, max_length=16)
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, VOCAB - 2, n).tolist() for n in (40, 9)]
    got = lm16.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (_words(d),), i)
                                      for i, d in enumerate(docs)], disable_tqdm=True)
    for doc, lp in zip(docs, got):
        padded, ref = [EOT] + doc, 0.0
        for s in range(0, len(doc), 16):
            e = min(s + 16, len(doc))
            ref += _hf(hf, padded[max(0, e - 16):e + 1], e - s)[0]
        assert lp == pytest.approx(ref, abs=1e-4, rel=1e-5)


def test_generate_until(tiny, lm):
    """Greedy continuations of prompts of different lengths batched together equal transformers' greedy ones; stop
    strings cut the text before them; a stop token ends the row; unsupported options are refused by name."""
    hf, _ = tiny
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB - 2, n).tolist() for n in (5, 12, 30)]
    refs = [hf_generate_greedy(hf, np.asarray(p)[None], 6)[0, len(p):].tolist() for p in prompts]
    gk = {"until": [], "max_gen_toks": 6, "do_sample": False}
    got = lm.generate_until([Instance("generate_until", {}, (_words(p), gk), i) for i, p in enumerate(prompts)],
                            disable_tqdm=True)
    assert got == [_words(r) for r in refs]

    stop = f"w{refs[0][2]}"  # the third generated word
    cut = lm.generate_until([Instance("generate_until", {}, (_words(prompts[0]), {**gk, "until": [stop]}), 0)],
                            disable_tqdm=True)[0]
    assert stop not in cut and _words(refs[0]).startswith(cut) and cut

    old = lm._stop_ids
    lm._stop_ids = (refs[1][3],)  # as if the fourth generated token were end-of-text
    try:
        short = lm.generate_until([Instance("generate_until", {}, (_words(prompts[1]), gk), 0)], disable_tqdm=True)
    finally:
        lm._stop_ids = old
    assert short == [_words(refs[1][:3])]

    with pytest.raises(ValueError, match="repetition_penalty"):
        lm.generate_until([Instance("generate_until", {}, ("w1", {**gk, "repetition_penalty": 1.2}), 0)])


def test_options_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="parallelize"):
        QJaxLM(pretrained=tiny[1], parallelize=True)
    with pytest.raises(ValueError, match="tokenizer.json"):
        QJaxLM(pretrained=save_hf(make_hf_model(tiny_text_config()), tmp_path / "no-tok"))
    lm = QJaxLM.create_from_arg_string(f"pretrained={tiny[1]},batch_size=5,dtype=float32",
                                       {"batch_size": 1, "max_batch_size": None, "device": None})
    assert lm.batch_size == 5 and lm.max_length == 512


def test_chat_template():
    """--apply_chat_template: the built-in model's ChatML template; without a generation prompt the last message is
    left open (transformers' continue_final_message), so a scored continuation extends it."""
    lm = QJaxLM(batch_size=1)
    chat = [{"role": "user", "content": "Who is Emma?"}, {"role": "assistant", "content": "Miss Woodhouse"}]
    assert lm.apply_chat_template(chat[:1]) == "<|im_start|>user\nWho is Emma?<|im_end|>\n<|im_start|>assistant\n"
    assert lm.apply_chat_template(chat, add_generation_prompt=False) == \
        "<|im_start|>user\nWho is Emma?<|im_end|>\n<|im_start|>assistant\nMiss Woodhouse"
    assert "<|im_start|>" in lm.chat_template(True) and lm.chat_template(False) is None


# --------------------------------------------------------------------------------------------------------------------
# the real command line on the built-in model
# --------------------------------------------------------------------------------------------------------------------
def test_lm_eval_command_line(tmp_path):
    info = austen_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "qjax.cli", "lm-eval",  # = python -m qjax.evaluation.lm_eval_adapter
           "--model", "qjax",
           "--model_args", f"pretrained={default_model_dir()},dtype=float32,batch_size=8",
           "--tasks", "qjax_austen_mc,qjax_austen_ppl,qjax_austen_gen", "--include_path", str(tmp_path / "tasks"),
           "--limit", "16", "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    [results_file] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    res = json.loads(Path(results_file).read_text())["results"]

    assert res["qjax_austen_mc"]["acc,none"] >= 0.75

    log = json.loads((Path(default_model_dir()) / "training_log.json").read_text())["eval"]
    ppl, tk, docs = res["qjax_austen_ppl"], info["tokenizer"], info["docs"]
    n_tok = sum(len(tk.encode(d).ids) for d in docs)
    n_words = sum(len(re.split(r"\s+", d)) for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    token_ppl = ppl["word_perplexity,none"] ** (n_words / n_tok)
    assert log["ppl_fp32"] / 2 < token_ppl < min(2.5 * log["ppl_fp32"], log["ppl_unigram"] / 3), token_ppl
    assert ppl["bits_per_byte,none"] == pytest.approx(math.log2(token_ppl) * n_tok / n_bytes, rel=1e-6)

    assert 0.0 <= res["qjax_austen_gen"]["exact_match,none"] <= 1.0
    [samples] = glob.glob(str(out / "**" / "samples_qjax_austen_gen_*.jsonl"), recursive=True)
    resps = [json.loads(line)["resps"][0][0] for line in Path(samples).read_text().splitlines()]
    assert len(resps) == 4 and all(r.strip() and "." not in r and "\n" not in r for r in resps), resps
    assert all(len(tk.encode(r).ids) <= 13 for r in resps), resps
