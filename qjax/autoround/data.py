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

from qjax.validation import MAX_TOKENIZER_BYTES, confined, parse_json, read_regular

logger = logging.getLogger("qjax.autoround")

# A calibration file is read whole: auto-round's default (pile-10k: 10,000 documents, ~50 MB of JSONL) with room to
# spare; 512 samples of 2,048 tokens need a few MB of text.
MAX_DATASET_BYTES = 256 << 20


class CalibrationError(ValueError):
    pass


def read_documents(path: str | os.PathLike, *, vocab_size: int | None = None) -> list[str | list[int]]:
    """Documents of ``path``: strings, or token-id lists from ``input_ids`` fields (each id below ``vocab_size``,
    when given: an id outside it is an error naming the line or record)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise CalibrationError(f"--dataset {path}: no such file (qjax reads calibration text from a local "
                               ".txt, .jsonl or .json file)")
    # a regular file (a FIFO would block the read) of at most MAX_DATASET_BYTES, read whole
    raw = read_regular(path, what="a calibration data file", max_bytes=MAX_DATASET_BYTES, error=CalibrationError,
                       where="--dataset")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                docs.append(_doc(parse_json(line.encode(), f"{path}:{n}", error=CalibrationError), f"{path}:{n}",
                                 vocab_size))
    elif ext == ".json":
        data = parse_json(raw, path, error=CalibrationError)
        if not isinstance(data, list):
            raise CalibrationError(f"{path}: expected a JSON list of strings or objects")
        docs = [_doc(d, f"{path}[{i}]", vocab_size) for i, d in enumerate(data)]
    else:
        docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    docs = [d for d in docs if len(d)]
    if not docs:
        raise CalibrationError(f"{path}: no documents")
    return docs


def _doc(obj, where: str, vocab_size: int | None = None) -> str | list[int]:
    """One document; ``where``: ``file:line`` (.jsonl) or ``file[record]`` (.json)."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict) and "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CalibrationError(f"{where}: input_ids must be a list of integers")
        bad = next((j for j, i in enumerate(ids) if not 0 <= i < 2**31), None)
        if bad is not None:
            raise CalibrationError(f"{where}: input_ids holds {ids[bad]} (position {bad}), not a token id")
        bad = next((j for j, i in enumerate(ids) if vocab_size is not None and i >= vocab_size), None)
        if bad is not None:
            raise CalibrationError(f"{where}: input_ids holds token id {ids[bad]} (position {bad}), outside the "
                                   f"model's vocabulary ({vocab_size} tokens)")
        return ids
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return obj["text"]
    raise CalibrationError(f"{where}: expected a string or an object with 'text' or 'input_ids'")


def load_tokenizer(model_dir: str | os.PathLike):
    """The ``tokenizers`` tokenizer of a model folder (its tokenizer.json)."""
    path = confined(os.fspath(model_dir), "tokenizer.json", what=os.fspath(model_dir), error=CalibrationError)
    if not os.path.lexists(path):
        raise CalibrationError(f"{model_dir}: no tokenizer.json, so text calibration data cannot be tokenized; "
                               "add the tokenizer files or pass a .jsonl whose lines hold 'input_ids'")
    # bounded and regular before the tokenizers library parses it (as qjax.tokenizer reads it)
    data = read_regular(path, what="tokenizer.json", max_bytes=MAX_TOKENIZER_BYTES, error=CalibrationError)
    try:
        return Tokenizer.from_buffer(data)
    except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
        raise CalibrationError(f"{path}: cannot load ({e})") from None


def calibration_ids(path, tokenizer, *, nsamples: int, seqlen: int, seed: int = 42,
                    vocab_size: int | None = None, tuned: bool = True) -> np.ndarray:
    """``[n, seqlen]`` int32 calibration samples, ``n = min(nsamples, what the file holds)``. Fewer samples than asked
    (or packed ones) are a warning when the samples are ``tuned`` on, an info line otherwise (an RTN run uses them
    for its imatrix at most)."""
    if nsamples < 1 or seqlen < 2:
        raise CalibrationError(f"nsamples ({nsamples}) must be ≥ 1 and seqlen ({seqlen}) ≥ 2")
    level = logging.WARNING if tuned else logging.INFO
    docs = read_documents(path, vocab_size=vocab_size)
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
        logger.log(level, "%s: %d documents have ≥ %d tokens (need %d); packing the concatenated text into %d "
                   "samples", path, len(long), seqlen, nsamples, n)
        out = np.asarray(stream[: n * seqlen], np.int32).reshape(n, seqlen)
    if len(out) < nsamples:
        logger.log(level, "%s: only %d calibration samples of %d tokens (asked for %d)", path, len(out), seqlen,
                   nsamples)
    if vocab_size is not None and out.size and (out.max() >= vocab_size or out.min() < 0):  # the tokenizer's ids
        raise CalibrationError(f"{path}: the tokenizer gives token id {int(out.max())}, outside the model's "
                               f"vocabulary ({vocab_size} tokens)")
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
