"""Calibration data from a local file (nothing from a hub), cut the way auto-round cuts pile-10k
(docs/autoround.md §15).

Accepted files:
  - ``.txt``: documents separated by blank lines;
  - ``.jsonl``: one object per line with ``"text"`` (tokenized here) or ``"input_ids"`` (used as they are);
  - ``.json``: a list of strings or of such objects (auto-round's local-file form).

Documents are shuffled with the seed, tokenized without truncation, and those with at least ``seqlen`` tokens are
cut to their first ``seqlen`` (auto-round drops shorter ones). When fewer than ``nsamples`` documents are long
enough, the shuffled documents are concatenated (separated by the tokenizer's end-of-text token when it has one) and
cut into consecutive ``seqlen`` windows — auto-round's ``:concat=true`` — and a warning says so. A file with fewer
than ``seqlen`` tokens in all is an error naming the file and the counts.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
from tokenizers import Tokenizer

from qjax.validation import parse_json

logger = logging.getLogger("qjax.autoround")


class CalibrationError(ValueError):
    pass


def read_documents(path: str | os.PathLike) -> list[str | list[int]]:
    """Documents of ``path``: strings, or token-id lists from ``input_ids`` fields."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CalibrationError(f"--dataset {path}: no such file (qjax reads calibration text from a local "
                               ".txt, .jsonl or .json file)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CalibrationError(f"--dataset {path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                docs.append(_doc(parse_json(line.encode(), f"{path}:{n}", error=CalibrationError), f"{path}:{n}"))
    elif ext == ".json":
        data = parse_json(raw, path, error=CalibrationError)
        if not isinstance(data, list):
            raise CalibrationError(f"{path}: expected a JSON list of strings or objects")
        docs = [_doc(d, f"{path}[{i}]") for i, d in enumerate(data)]
    else:
        docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    docs = [d for d in docs if len(d)]
    if not docs:
        raise CalibrationError(f"{path}: no documents")
    return docs


def _doc(obj, where: str) -> str | list[int]:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict) and "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CalibrationError(f"{where}: input_ids must be a list of integers")
        bad = [i for i in ids if not 0 <= i < 2**31]
        if bad:
            raise CalibrationError(f"{where}: input_ids holds {bad[0]}, not a token id")
        return ids
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return obj["text"]
    raise CalibrationError(f"{where}: expected a string or an object with 'text' or 'input_ids'")


def load_tokenizer(model_dir: str | os.PathLike):
    """The ``tokenizers`` tokenizer of a model folder (its tokenizer.json)."""
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.isfile(path):
        raise CalibrationError(f"{model_dir}: no tokenizer.json, so text calibration data cannot be tokenized; "
                               "add the tokenizer files or pass a .jsonl whose lines hold 'input_ids'")
    return Tokenizer.from_file(path)


def calibration_ids(path, tokenizer, *, nsamples: int, seqlen: int, seed: int = 42,
                    vocab_size: int | None = None) -> np.ndarray:
    """``[n, seqlen]`` int32 calibration samples, ``n = min(nsamples, what the file holds)``."""
    if nsamples < 1 or seqlen < 2:
        raise CalibrationError(f"nsamples ({nsamples}) must be ≥ 1 and seqlen ({seqlen}) ≥ 2")
    docs = read_documents(path)
    random.Random(seed).shuffle(docs)
    need_tok = any(isinstance(d, str) for d in docs)
    if need_tok and tokenizer is None:
        raise CalibrationError(f"{path}: holds text but no tokenizer is available")
    ids = [d if isinstance(d, list) else tokenizer.encode(d).ids for d in docs]
    long = [x[:seqlen] for x in ids if len(x) >= seqlen]
    if len(long) >= nsamples:
        out = np.asarray(long[:nsamples], np.int32)
    else:
        eos = _eos_id(tokenizer) if tokenizer is not None else None
        stream: list[int] = []
        for x in ids:
            stream.extend(x)
            if eos is not None:
                stream.append(eos)
        total = len(stream)
        if total < seqlen:
            raise CalibrationError(f"{path}: {total} tokens in all, fewer than one sample of seqlen {seqlen}; "
                                   "pass a smaller --seqlen or more text")
        n = min(nsamples, total // seqlen)
        logger.warning("%s: %d documents have ≥ %d tokens (need %d); packing the concatenated text into %d samples",
                       path, len(long), seqlen, nsamples, n)
        out = np.asarray(stream[: n * seqlen], np.int32).reshape(n, seqlen)
    if len(out) < nsamples:
        logger.warning("%s: only %d calibration samples of %d tokens (asked for %d)", path, len(out), seqlen, nsamples)
    if vocab_size is not None and out.size and (out.max() >= vocab_size or out.min() < 0):
        raise CalibrationError(f"{path}: token id {int(out.max())} is outside the model's vocabulary ({vocab_size})")
    return out


def _eos_id(tokenizer) -> int | None:
    for tok in ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>"):
        i = tokenizer.token_to_id(tok)
        if i is not None:
            return i
    return None


class IndexSampler:
    """auto-round's sampler: shuffled indices handed out in consecutive slices, reshuffled when too few remain
    (the tail is dropped). ``batch`` is clipped to ``n``."""

    def __init__(self, n: int, batch: int, seed: int = 42):
        self.n, self.batch = n, min(batch, n)
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.pos = 0

    def next_batch(self) -> list[int]:
        if self.pos + self.batch > len(self.order):
            self.order = list(range(self.n))
            self.rng.shuffle(self.order)
            self.pos = 0
        out = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return out
