"""The built-in default model (qjax/assets/default) and the training code that made it (qjax.builtin.train,
qjax.builtin.train_tokenizer).

Numbers behind the thresholds (from the shipped model's training_log.json and these tests' own slices):
- held-out perplexity of the BF16 checkpoint ≈ PPL_LOGGED on all of heldout.txt; on the 2,048-token slice scored here
  it must stay below a third of the add-one unigram baseline fitted on calib.txt (≈ UNIGRAM_NOTE);
- a greedy continuation of "Once upon a time" is made of words that occur in the shipped Austen samples;
- the MTP head (benchmarks/train_mtp_head.py, 474 steps) agrees with the main model's greedy token at t+2 on 0.647 of
  all held-out positions (0.680 on the first MTP_SLICE tokens scored here, 0.63–0.68 on other 512-token slices; an
  untrained head 0.005, always drafting the most frequent greedy token ≈ 0.15): the floor is 0.5.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax.builtin import train as T
from qjax.model.config import FULL, LINEAR, TextConfig

pytestmark = pytest.mark.slow

ASSET = Path(qjax.__file__).resolve().parent / "assets" / "default"
MTP_SLICE, MTP_AGREE_FLOOR = 512, 0.5
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "README.md", "heldout.txt", "calib.txt", "training_log.json")


@pytest.fixture(scope="module")
def model():
    return qjax.load_model(ASSET)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ASSET / "tokenizer.json"))


def _read(name: str) -> str:
    return (ASSET / name).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# the shipped model
# ---------------------------------------------------------------------------------------------------------------------
def test_assets_complete_and_small():
    sizes = {f: os.path.getsize(ASSET / f) for f in FILES}
    # the BF16 body (8.7 MB), its MTP head (1.3 MB), the text samples and the tokenizer (0.5 MB)
    assert sum(os.path.getsize(p) for p in ASSET.iterdir()) <= 11 * 1024**2, sizes
    assert sizes["heldout.txt"] <= 200 * 1024 and sizes["calib.txt"] <= 300 * 1024, sizes
    held, calib = _read("heldout.txt"), _read("calib.txt")
    # disjoint samples: no paragraph of one occurs in the other
    paras = lambda t: {p for p in t.split("\n\n") if len(p) > 200}
    assert not paras(held) & paras(calib)


def test_config_is_the_full_architecture(model, tokenizer):
    cfg = TextConfig.from_file(ASSET)
    raw = json.loads(_read("config.json"))
    assert raw["model_type"] == "qwen3_5_moe_text" and raw["dtype"] == "bfloat16"
    assert LINEAR in cfg.layer_types and FULL in cfg.layer_types
    assert cfg.layer_period == (LINEAR, LINEAR, LINEAR, FULL) and cfg.num_groups >= 2
    assert cfg.num_experts > 1 and 1 < cfg.num_experts_per_tok < cfg.num_experts
    assert cfg.shared_expert_intermediate_size > 0
    layer = model.groups.layers[0].mlp
    assert layer.shared_expert.down_proj.weight.shape[-1] == cfg.shared_expert_intermediate_size
    assert layer.experts.gate_up_proj.shape[-3:] == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    # quantization group sizes apply: every linear's in_features is a multiple of 64 (INT2 g64 / INT4 g128 mostly)
    for d in (cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
              cfg.num_attention_heads * cfg.head_dim, cfg.linear_value_dim):
        assert d % 64 == 0, d
    # tokenizer and generation defaults agree with the model
    assert tokenizer.get_vocab_size() == cfg.vocab_size
    eot = tokenizer.token_to_id("<|endoftext|>")
    assert {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")} == {
        cfg.vocab_size - 3, cfg.vocab_size - 2, cfg.vocab_size - 1}
    gen = json.loads(_read("generation_config.json"))
    assert gen["do_sample"] is True and gen["eos_token_id"] == [eot] and 0 < gen["temperature"] < 1
    assert model.generation_config.eos_token_id == (eot,)
    tc = json.loads(_read("tokenizer_config.json"))
    assert tc["eos_token"] == "<|endoftext|>" and "<|im_start|>" in tc["chat_template"]


def test_heldout_perplexity_beats_unigram(model, tokenizer):
    vocab = model.config.vocab_size
    held = np.asarray(tokenizer.encode(_read("heldout.txt")).ids, np.int32)
    calib = np.asarray(tokenizer.encode(_read("calib.txt")).ids, np.int32)
    sl = held[:8 * 256 + 1]
    nll, n = T.mean_nll(model, sl, seqlen=256, batch=8)
    uni = T.unigram_nll(calib, sl[1:], vocab)
    ppl, ppl_uni = math.exp(nll), math.exp(uni)
    logged = json.loads(_read("training_log.json"))["eval"]
    print(f"held-out slice ({n} tokens): model ppl {ppl:.1f}, unigram (fitted on calib.txt) {ppl_uni:.1f}; "
          f"logged full held-out ppl {logged['ppl_bf16']:.1f}, unigram {logged['ppl_unigram']:.1f}")
    assert n == 2048
    assert ppl < ppl_uni / 3
    assert logged["ppl_bf16"] < logged["ppl_unigram"] / 3


def test_greedy_generation_is_mostly_real_words(model, tokenizer):
    prompt = np.asarray([tokenizer.encode("Once upon a time").ids], np.int32)
    out = qjax.generate(model, prompt, max_new_tokens=48, do_sample=False)
    text = tokenizer.decode(out[0, prompt.shape[1]:].tolist())
    known = {w.lower() for w in re.findall(r"[A-Za-z]+", _read("calib.txt") + _read("heldout.txt"))}
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    real = sum(w in known for w in words)
    print(f"greedy: {'Once upon a time' + text!r} — {real}/{len(words)} known words")
    assert len(words) >= 15
    assert real >= 0.85 * len(words)


def test_mtp_head_drafts_the_main_models_greedy_token(model, tokenizer):
    assert model.mtp is not None and json.loads(_read("config.json"))["mtp_num_hidden_layers"] == 1
    held = np.asarray(tokenizer.encode(_read("heldout.txt")).ids, np.int32)
    m = T.mtp_accuracy(model, held[:MTP_SLICE + 2], seqlen=MTP_SLICE // 2, batch=2)
    logged = json.loads(_read("training_log.json"))["mtp"]["eval"]
    print(f"MTP head on {m['tokens']} held-out tokens: agreement with the main model's greedy token {m['agree']:.3f} "
          f"(chance {m['agree_mode']:.3f}), top-1 {m['top1']:.3f}; logged on all of heldout.txt: agreement "
          f"{logged['after_bf16']['agree']:.3f}, top-1 {logged['after_bf16']['top1']:.3f}")
    assert m["tokens"] == MTP_SLICE
    assert m["agree"] > MTP_AGREE_FLOOR and m["agree"] > 2 * m["agree_mode"]
    assert logged["after_bf16"]["agree"] > MTP_AGREE_FLOOR


# ---------------------------------------------------------------------------------------------------------------------
# training code
# ---------------------------------------------------------------------------------------------------------------------
def _tiny_config(**over) -> TextConfig:
    from qjax.cli import DEMO_CONFIG

    raw = {**DEMO_CONFIG, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
           "layer_types": [LINEAR, LINEAR, LINEAR, FULL], "head_dim": 16, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
           "num_experts": 4, "initializer_range": 0.02, "tie_word_embeddings": True,
           "rope_parameters": {**DEMO_CONFIG["rope_parameters"], "mrope_section": [1, 0, 1]}, **over}
    return TextConfig.from_dict(raw)


def test_forward_train_matches_model_forward():
    cfg = _tiny_config()
    m = qjax.init_model(cfg, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 80)), jnp.int32)
    from flax import nnx

    graphdef, state = nnx.split(m)
    logits, aux = jax.jit(lambda st, x: T.forward_train(nnx.merge(graphdef, st), x))(state, ids)
    np.testing.assert_allclose(logits, m(ids), atol=1e-5)
    assert 0.99 < float(aux) < 1.5  # ≈ 1 when the router is near uniform


def test_training_reduces_loss_and_balances_experts():
    cfg = _tiny_config()
    m = qjax.init_model(cfg, seed=0)
    ids = np.tile(np.random.default_rng(1).permutation(cfg.vocab_size)[:24], 100)  # a memorisable cycle
    tc = T.TrainConfig(steps=40, batch=4, seqlen=32, lr=1e-2, warmup_steps=5, aux_loss_coef=0.01)
    m, log = T.train(m, T.batches(ids, tc.batch, tc.seqlen, seed=0), tc, log_every=10)
    assert [e["step"] for e in log] == [10, 20, 30, 40]
    assert log[0]["ce"] > 3.0 and log[-1]["ce"] < 1.0, log
    assert all(e["aux"] < 1.5 for e in log), log  # experts stay in use
    # the trained model is an ordinary model: its own forward and the perplexity helper agree with training
    assert T.perplexity(m, ids[:4 * 32 + 1], seqlen=32, batch=4) < math.exp(1.0)


def test_train_mtp_lowers_the_loss_and_freezes_the_body():
    from flax import nnx

    cfg = _tiny_config()
    m = T.add_mtp_head(qjax.init_model(cfg, seed=0), init="identity", seed=1)
    # the training forward of the head is the model's own (mtp_logits), plus the router loss
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
    hidden = m.forward(ids).hidden
    logits, aux = T.mtp_forward_train(m, ids[:, 1:], hidden[:, :-1])
    np.testing.assert_allclose(logits, m.mtp_logits(ids, hidden), atol=1e-5)
    assert 0.99 < float(aux) < 1.5

    cycle = np.tile(np.random.default_rng(1).permutation(cfg.vocab_size)[:24], 100)
    held = cycle[:4 * 32 + 2]
    before_state = {p: np.array(v) for p, v in nnx.to_flat_state(nnx.state(m))}
    before = T.mtp_accuracy(m, held, seqlen=32, batch=4)
    tc = T.TrainConfig(steps=20, batch=4, seqlen=32, lr=1e-2, warmup_steps=5)
    m, log = T.train_mtp(m, T.batches(cycle, tc.batch, tc.seqlen + 1, seed=0), tc, log_every=10)
    after = T.mtp_accuracy(m, held, seqlen=32, batch=4)
    assert [e["step"] for e in log] == [10, 20]
    assert log[-1]["ce"] < log[0]["ce"] - 0.3 and after["loss"] < before["loss"] - 0.3, (log, before, after)
    after_state = {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(m))}
    changed = {p for p in before_state if not np.array_equal(before_state[p], after_state[p])}
    # only the head moved: every other variable (the body, the tied embedding) is bit-identical
    assert changed and all(p[0] == "mtp" for p in changed), changed


def test_learning_rate_schedule():
    tc = T.TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [T.learning_rate(i, 100, tc) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_tokenizer_training_round_trip(tmp_path):
    from qjax.builtin.train_tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer

    texts = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, "
             "must be in want of a wife."] * 50 + ["Emma Woodhouse, handsome, clever, and rich — 1816."] * 50
    tok = train_tokenizer(texts, vocab_size=300)
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [297, 298, 299]
    s = "Once upon a time, Ms. Émma's 42 \"wishes\"\n\nended.<|endoftext|>"
    enc = tok.encode(s)
    assert enc.ids[-1] == 297 and tok.decode(enc.ids, skip_special_tokens=False) == s
    paths = save_tokenizer(tok, tmp_path)
    cfg = json.loads(Path(paths[1]).read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["added_tokens_decoder"]["299"]["content"] == "<|im_end|>"
