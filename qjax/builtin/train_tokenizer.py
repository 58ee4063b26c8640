"""Train a small Qwen-style byte-level BPE tokenizer with the ``tokenizers`` library.

    tok = train_tokenizer(texts, vocab_size=4096)
    save_tokenizer(tok, "out/")      # tokenizer.json + tokenizer_config.json (ChatML chat_template)

Same pipeline as Qwen2/3's ``tokenizer.json``: NFC normalisation, Qwen's pre-tokenisation regex (contractions,
letter runs with one leading non-letter, single digits, punctuation runs, newlines, spaces), byte-level mapping and
BPE, byte-level decoding. The special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are appended after the
BPE vocabulary (as Qwen does), so the vocabulary has exactly ``vocab_size`` entries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2/Qwen3 tokenizer.json pre-tokenisation pattern
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE trained on ``texts``; ``vocab_size`` counts the 256 byte symbols, the merges and the 3 special
    tokens (deterministic for the same texts and arguments)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=min_frequency,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config(tok: Tokenizer, model_max_length: int = 4096) -> dict:
    """A ``tokenizer_config.json`` for transformers (fast tokenizer from tokenizer.json) with a ChatML template."""
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }


def save_tokenizer(tok: Tokenizer, folder: str | os.PathLike, *, model_max_length: int = 4096) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; returns their paths."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    tj = os.path.join(folder, "tokenizer.json")
    tok.save(tj, pretty=False)
    tc = os.path.join(folder, "tokenizer_config.json")
    with open(tc, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tok, model_max_length), f, indent=2, ensure_ascii=False)
        f.write("\n")
    return [tj, tc]
