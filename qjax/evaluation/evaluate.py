"""Evaluation of qjax models: perplexity of a text, and fidelity of a (quantized) model to its reference.

    nll, n = mean_nll(model, ids, seqlen=2048, batch=8)            # mean next-token NLL over n scored tokens
    report = fidelity(qdir, refdir, prompts, max_new_tokens=128)    # the model card's "fidelity to the original"

Perplexity (:func:`mean_nll`): the token stream is cut into non-overlapping windows of ``seqlen`` model inputs; window
k reads tokens ``[k·seqlen, (k+1)·seqlen)`` and predicts tokens ``[k·seqlen + 1, (k+1)·seqlen]``, so every token but
the first of the stream is scored exactly once, each from its own window's context only (a window's first prediction
sees one token). The tail shorter than a window is not scored. :func:`perplexity_of_file` scores a text shorter
than one window (fewer than ``seqlen + 1`` tokens, at least 2) as one window of its own length, ``N - 1`` inputs, and
says so in its report (``requested_seqlen``, ``note``), as perplexity tools do.

Fidelity (:func:`fidelity`), as quantized model cards measure it: for each prompt the reference model's greedy answer
(cached decode, stopped at a stop token or ``max_new_tokens``), then under the quantized model and under the reference
itself, with teacher forcing on ``prompt + answer``: the perplexity of the answer tokens (pooled over all prompts) and
the next-token top-1 agreement (the fraction of answer positions whose argmax is the reference's greedy token). The
reference's self-agreement is 100 % except where its teacher-forced forward (chunked delta rule, one pass) and its
cached greedy decode (recurrent delta rule, token by token) round a near-tie differently.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer as HFTokenizer
from tqdm.auto import tqdm

import qjax
from qjax.evaluation import PERPLEXITY_METHOD
from qjax.model.config import TextConfig
from qjax.tokenizer import Tokenizer


class EvalError(ValueError):
    """Bad evaluation input; the message names the file or option at fault."""


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr (a no-op object when ``enabled`` is False)."""

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------------
# text and tokenizers
# ---------------------------------------------------------------------------------------------------------------------
def load_tokenizer(folder: str, option: str = "--model"):
    """The :class:`qjax.tokenizer.Tokenizer` of a checkpoint folder; an :class:`EvalError` naming ``option`` and the
    folder when it has no tokenizer files."""

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise EvalError(f"{option} {folder}: no tokenizer.json, so text cannot be tokenized (copy the tokenizer files "
                        "of the original model into the folder)")
    return Tokenizer.from_folder(folder)


def _read(path: str, option: str) -> tuple[str, str]:
    """(contents, lower-case extension) of a UTF-8 text file named by ``option``."""
    if not os.path.isfile(path):
        raise EvalError(f"{option} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        return f.read(), os.path.splitext(path)[1].lower()


def read_texts(path: str, option: str = "--data") -> list[str]:
    """Documents of a text file: a ``.txt`` file is one document; ``.jsonl`` has one object with ``"text"`` (or a
    string) per line; ``.json`` is a list of strings or of such objects."""
    raw, ext = _read(path, option)
    if ext == ".jsonl":
        items = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                items.append((_json(line, f"{option} {path}:{n}"), f"{path}:{n}"))
    elif ext == ".json":
        data = _json(raw, f"{option} {path}")
        if not isinstance(data, list):
            raise EvalError(f"{option} {path}: expected a JSON list of strings or of objects with 'text'")
        items = [(d, f"{path}[{i}]") for i, d in enumerate(data)]
    else:
        items = [(raw, path)]
    texts = [_field(obj, "text", f"{option} {where}") for obj, where in items]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise EvalError(f"{option} {path}: no text in the file")
    return texts


def read_prompts(path: str, option: str = "--prompts") -> list[str]:
    """Prompts of a file: ``.txt`` one per non-empty line; ``.jsonl`` one object with ``"prompt"`` (or a string) per
    line; ``.json`` a list of strings or of such objects."""
    raw, ext = _read(path, option)
    if ext == ".jsonl":
        prompts = [_field(_json(line, f"{option} {path}:{n}"), "prompt", f"{option} {path}:{n}")
                   for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
    elif ext == ".json":
        data = _json(raw, f"{option} {path}")
        if not isinstance(data, list):
            raise EvalError(f"{option} {path}: expected a JSON list of strings or of objects with 'prompt'")
        prompts = [_field(d, "prompt", f"{option} {path}[{i}]") for i, d in enumerate(data)]
    else:
        prompts = [line for line in raw.splitlines() if line.strip()]
    if not prompts:
        raise EvalError(f"{option} {path}: no prompts in the file")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise EvalError(f"{option} {path}: prompt {i + 1} is empty")
    return prompts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise EvalError(f"{where}: not JSON ({e.msg})") from None


def _field(obj, key: str, where: str) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get(key), str):
        return obj[key]
    raise EvalError(f"{where}: expected a string or an object with a string {key!r}")


def tokenize_texts(texts: Sequence[str], tokenizer) -> np.ndarray:
    """One token stream ``[N]`` int32: the documents joined by a blank line (as a ``.txt`` file holds them), so a
    ``.jsonl`` of a text's paragraphs scores like the text itself."""
    return np.asarray(tokenizer.encode("\n\n".join(texts)), np.int32)


# ---------------------------------------------------------------------------------------------------------------------
# perplexity
# ---------------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _window_nll(graphdef, state, tokens):
    """``tokens [B, seqlen + 1]`` → summed NLL of tokens 1.. of each row ``[B]``."""
    model = nnx.merge(graphdef, state)
    logits = model.forward(tokens[:, :-1]).logits
    logp = jax.nn.log_softmax(logits, axis=-1)  # logits come in the accumulation dtype (float32, or float64)
    return -jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], axis=1)


def mean_nll(model, ids, seqlen: int = 256, batch: int = 8, *, progress: bool = False) -> tuple[float, int]:
    """Mean next-token NLL (nats) of ``ids`` in non-overlapping windows of ``seqlen`` inputs (module docstring).

    Args:
      ids: ``[N]`` token ids (any int array; flattened).
      batch: windows per forward call; the last call is padded with repeats of its first window (one compiled
        shape), which are not counted.
      progress: a progress bar on stderr.
    Returns:
      (mean NLL, number of scored tokens = windows · seqlen).
    """
    ids = np.asarray(ids, np.int32).reshape(-1)
    n_win = (ids.size - 1) // seqlen
    if n_win < 1:
        raise ValueError(f"need at least {seqlen + 1} tokens, got {ids.size}")
    wins = np.stack([ids[i * seqlen:i * seqlen + seqlen + 1] for i in range(n_win)])
    graphdef, state = nnx.split(model)
    total = 0.0
    with progress_bar(n_win, "perplexity windows", progress) as bar:
        for s in range(0, n_win, batch):
            chunk = wins[s:s + batch]
            n = chunk.shape[0]
            if n < batch:
                chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - n, axis=0)])
            total += float(np.sum(np.asarray(_window_nll(graphdef, state, jnp.asarray(chunk)), np.float64)[:n]))
            bar.update(n)
    n_tok = n_win * seqlen
    return total / n_tok, n_tok


def perplexity(model, ids, seqlen: int = 256, batch: int = 8) -> float:
    """``exp`` of :func:`mean_nll`."""
    return float(math.exp(mean_nll(model, ids, seqlen, batch)[0]))


@dataclasses.dataclass(frozen=True)
class PerplexityReport:
    model: str
    data: str
    seqlen: int  # inputs per window actually used (shorter than requested_seqlen for a text shorter than one window)
    data_tokens: int  # tokens of the data (after --max-tokens)
    windows: int
    scored_tokens: int
    unscored_tail: int  # tokens after the last whole window
    mean_nll: float
    ppl: float
    dtype: str
    requested_seqlen: int | None = None  # the --seqlen asked for, when the text was shorter than one such window
    note: str | None = None  # why the window is shorter than requested (``qjax eval ppl`` prints it on stderr)

    method = PERPLEXITY_METHOD

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in ("requested_seqlen", "note"):  # only when the window was shortened
            if d[key] is None:
                del d[key]
        return {**d, "method": self.method}

    def format(self) -> str:
        windows = f"{self.windows} window{'s' if self.windows != 1 else ''} of {self.seqlen}"
        if self.requested_seqlen is not None and self.requested_seqlen != self.seqlen:
            windows += f" (--seqlen {self.requested_seqlen} requested: fewer than {self.requested_seqlen + 1} tokens)"
        return "\n".join([
            f"perplexity of {self.data} under {self.model} ({self.dtype})",
            f"  method: {self.method}",
            f"  {self.data_tokens} tokens → {windows}; {self.scored_tokens} tokens "
            f"scored" + (f", {self.unscored_tail} tail tokens not scored" if self.unscored_tail else ""),
            f"  mean NLL {self.mean_nll:.5f} nats/token   ppl {self.ppl:.4f}",
        ])


def perplexity_of_file(model_dir: str, data: str, *, seqlen: int = 2048, batch: int = 8, max_tokens: int | None = None,
                       dtype=None, progress: bool = False, tokenizer_dir: str | None = None) -> PerplexityReport:
    """Perplexity of the text file ``data`` under the checkpoint ``model_dir`` (its own tokenizer, or
    ``tokenizer_dir``'s).

    A text (after ``max_tokens``) shorter than one window — fewer than ``seqlen + 1`` tokens — is scored as one window
    of its own length (``N - 1`` inputs); the report's ``seqlen`` is that length, ``requested_seqlen`` the one asked
    for, and ``note`` a sentence saying so. Fewer than 2 tokens is an :class:`EvalError` naming the file.
    """

    if seqlen < 1:
        raise EvalError(f"--seqlen must be ≥ 1, got {seqlen}")
    if batch < 1:
        raise EvalError(f"--batch-size must be ≥ 1, got {batch}")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be ≥ 2, got {max_tokens}")

    TextConfig.from_file(model_dir)  # a wrong --model fails here, naming its config.json, before any work
    texts = read_texts(data)
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    ids = tokenize_texts(texts, tokenizer)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.size < 2:  # --max-tokens is ≥ 2, so the text itself is this short
        raise EvalError(f"--data {data} holds {ids.size} token{'' if ids.size == 1 else 's'}; perplexity needs at "
                        "least 2 (one to read, one to predict)")
    requested, note = None, None
    if ids.size < seqlen + 1:
        where = f"--max-tokens {max_tokens} keeps" if max_tokens is not None and max_tokens < seqlen + 1 else \
            f"{data} has"
        requested, seqlen = seqlen, int(ids.size - 1)
        note = f"{where} {ids.size} tokens, fewer than --seqlen {requested} + 1: scored as one window of {seqlen}"
    model = qjax.load_model(model_dir, dtype=dtype, text_only=True)
    _check_ids(ids, model.config.vocab_size, f"--data {data}")
    nll, n = mean_nll(model, ids, seqlen, batch, progress=progress)
    windows = n // seqlen
    return PerplexityReport(model=model_dir, data=data, seqlen=seqlen, data_tokens=int(ids.size), windows=windows,
                            scored_tokens=n, unscored_tail=int(ids.size - 1 - n), mean_nll=nll, ppl=math.exp(nll),
                            dtype=str(model.dtype), requested_seqlen=requested, note=note)


def _check_ids(ids: np.ndarray, vocab: int, where: str) -> None:
    if ids.size and (ids.max() >= vocab or ids.min() < 0):
        raise EvalError(f"{where}: token id {int(ids.max())} is outside the model's vocabulary ({vocab}); the "
                        "tokenizer does not belong to this model")


# ---------------------------------------------------------------------------------------------------------------------
# fidelity
# ---------------------------------------------------------------------------------------------------------------------
def encode_prompts(prompts: Sequence[str], tokenizer, *, chat: bool, enable_thinking: bool | None = None
                   ) -> list[list[int]]:
    """Token ids of each prompt: as a user message rendered by the chat template (with the assistant's generation
    prompt), or the plain text."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             enable_thinking=enable_thinking) if chat else p
        ids = list(tokenizer.encode(text))
        if not ids:
            raise EvalError(f"--prompts: prompt {p!r} encodes to no tokens")
        out.append(ids)
    return out


def _left_pad(rows: Sequence[Sequence[int]], length: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``[batch, length]`` ids and mask with each row right-aligned; missing rows repeat the first (not counted)."""
    rows = list(rows) + [rows[0]] * (batch - len(rows))
    ids = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), np.int32)
    for i, r in enumerate(rows):
        ids[i, length - len(r):] = r
        mask[i, length - len(r):] = 1
    return ids, mask


def greedy_answers(model, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                   batch: int = 8, progress: bool = False, desc: str = "reference: greedy answers"
                   ) -> list[list[int]]:
    """Each prompt's greedy continuation, up to and including its first stop token (or ``max_new_tokens`` tokens).

    Prompts run in left-padded batches of ``batch``, all padded to the longest prompt, so generation compiles once.
    """

    width = max(len(p) for p in prompt_ids)
    answers: list[list[int]] = []
    stops = set(int(s) for s in stop_ids)
    with progress_bar(len(prompt_ids), desc, progress) as bar:
        for s in range(0, len(prompt_ids), batch):
            group = prompt_ids[s:s + batch]
            ids, mask = _left_pad(group, width, batch)
            out = qjax.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=sorted(stops))
            for row in out[:len(group), width:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
                answers.append(row[:cut])
            bar.update(len(group))
    return answers


@functools.partial(jax.jit, static_argnums=(0, 4))
def _answer_scores(graphdef, state, ids, mask, k: int):
    """NLL and argmax at the positions predicting the last ``k`` tokens of each row: ``[B, k]`` each."""
    model = nnx.merge(graphdef, state)
    # last_only skips the full-sequence logits (V-wide for every prompt position); only the answer span is projected
    hidden = model.forward(ids, attention_mask=mask, last_only=True).hidden
    logits = model.logits_from_hidden(hidden[:, -k - 1:-1])
    logp = jax.nn.log_softmax(logits, axis=-1)  # logits come in the accumulation dtype (float32, or float64)
    target = ids[:, -k:]
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AnswerScores:
    nll: list[float]  # summed NLL of each answer (nats)
    agree: list[int]  # answer positions whose argmax is the answer token
    tokens: list[int]  # answer lengths

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / sum(self.tokens))

    @property
    def agreement(self) -> float:
        return sum(self.agree) / sum(self.tokens)


def score_answers(model, prompt_ids: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
                  max_new_tokens: int, batch: int = 8, progress: bool = False, desc: str = "scoring"
                  ) -> AnswerScores:
    """Teacher-forced NLL and top-1 agreement of each ``answer`` given its prompt.

    Rows ``prompt + answer`` are left-padded to one width (longest prompt + ``max_new_tokens``), so the answer
    tokens are always among the last ``max_new_tokens`` positions and one compiled shape serves every batch.
    """
    width = max(len(p) for p in prompt_ids) + max_new_tokens
    graphdef, state = nnx.split(model)
    nll, agree, tokens = [], [], []
    with progress_bar(len(prompt_ids), desc, progress) as bar:
        for s in range(0, len(prompt_ids), batch):
            rows = [list(p) + list(a) for p, a in zip(prompt_ids[s:s + batch], answers[s:s + batch])]
            ids, mask = _left_pad(rows, width, batch)
            row_nll, top1 = _answer_scores(graphdef, state, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens)
            row_nll, top1 = np.asarray(row_nll, np.float64), np.asarray(top1)
            for i, a in enumerate(answers[s:s + batch]):
                n = len(a)
                nll.append(float(row_nll[i, -n:].sum()))
                agree.append(int(np.sum(top1[i, -n:] == np.asarray(a))))
                tokens.append(n)
            bar.update(len(rows))
    return AnswerScores(nll=nll, agree=agree, tokens=tokens)


@dataclasses.dataclass(frozen=True)
class FidelityReport:
    model: str
    reference: str
    prompts: int
    chat: bool
    max_new_tokens: int
    dtype: str
    scored_tokens: int
    ppl: float  # the model's perplexity of the reference's answers
    reference_ppl: float
    agreement: float  # the model's top-1 agreement with the reference's greedy tokens
    reference_agreement: float  # the reference's own (teacher-forced vs cached greedy decode)
    answers: list[list[int]]  # the reference's greedy answer ids, per prompt

    @property
    def ppl_change(self) -> float:
        """Relative change of the perplexity against the reference's (0.001 = +0.1 %)."""
        return self.ppl / self.reference_ppl - 1.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ppl_change": self.ppl_change}

    def format(self) -> str:
        return "\n".join([
            f"fidelity of {self.model} to the reference {self.reference} ({self.dtype})",
            f"  {self.prompts} prompts ({'chat template' if self.chat else 'plain text, no chat template'}), the "
            f"reference's greedy answers (≤ {self.max_new_tokens} tokens): {self.scored_tokens} answer tokens scored "
            f"by teacher forcing",
            f"  perplexity of the answers   model {self.ppl:.4f}   reference {self.reference_ppl:.4f}   change "
            f"{100 * self.ppl_change:+.2f} %",
            f"  next-token top-1 agreement  model {100 * self.agreement:.1f} %   reference (self) "
            f"{100 * self.reference_agreement:.1f} %",
            "  (self-agreement is 100 % unless the reference's one-pass forward and its token-by-token greedy decode "
            "break a near-tie differently)",
        ])


def check_same_vocabulary(model_dir: str, reference_dir: str) -> None:
    """The model must score the reference's token ids: same vocabulary size and, when the model folder has its own
    tokenizer.json, the same token → id map."""


    v_model = TextConfig.from_file(model_dir).vocab_size
    v_ref = TextConfig.from_file(reference_dir).vocab_size
    if v_model != v_ref:
        raise EvalError(f"--model {model_dir} has a vocabulary of {v_model} tokens and --reference {reference_dir} "
                        f"one of {v_ref}: the model cannot score the reference's tokens")
    mine = os.path.join(model_dir, "tokenizer.json")
    theirs = os.path.join(reference_dir, "tokenizer.json")
    if os.path.isfile(mine) and os.path.isfile(theirs):
        if HFTokenizer.from_file(mine).get_vocab(True) != HFTokenizer.from_file(theirs).get_vocab(True):
            raise EvalError(f"--model {mine} and --reference {theirs} map tokens to different ids: the model was not "
                            "made from this reference")


def fidelity(model_dir: str, reference_dir: str, prompts: Sequence[str], *, max_new_tokens: int = 128,
             chat: bool | None = None, enable_thinking: bool | None = None, batch: int = 8, dtype=None,
             progress: bool = False) -> FidelityReport:
    """Fidelity of ``model_dir`` (e.g. a quantized build) to ``reference_dir`` on ``prompts`` (module docstring).

    The two models are never in memory together: the reference generates and is scored, then is freed before the
    model is loaded. ``chat`` None: use the reference's chat template when it has one.
    """

    if max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens must be ≥ 1, got {max_new_tokens}")
    if batch < 1:
        raise EvalError(f"--batch-size must be ≥ 1, got {batch}")
    check_same_vocabulary(model_dir, reference_dir)
    tokenizer = load_tokenizer(reference_dir, "--reference")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        chat = has_template
    elif chat and not has_template:
        raise EvalError(f"--chat: --reference {reference_dir} has no chat template (pass --no-chat)")
    prompt_ids = encode_prompts(prompts, tokenizer, chat=chat, enable_thinking=enable_thinking)

    reference = qjax.load_model(reference_dir, dtype=dtype, text_only=True)
    for ids in prompt_ids:
        _check_ids(np.asarray(ids), reference.config.vocab_size, "--prompts")
    stop = set(tokenizer.stop_token_ids) | set(reference.generation_config.eos_token_id)
    answers = greedy_answers(reference, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=sorted(stop), batch=batch,
                             progress=progress)
    ref_scores = score_answers(reference, prompt_ids, answers, max_new_tokens=max_new_tokens, batch=batch,
                               progress=progress, desc="reference: scoring")
    model_dtype = str(reference.dtype)
    del reference
    gc.collect()
    model = qjax.load_model(model_dir, dtype=dtype, text_only=True)
    scores = score_answers(model, prompt_ids, answers, max_new_tokens=max_new_tokens, batch=batch,
                           progress=progress, desc="model: scoring")
    if str(model.dtype) != model_dtype:
        model_dtype = f"reference {model_dtype}, model {model.dtype}"
    return FidelityReport(model=model_dir, reference=reference_dir, prompts=len(prompts), chat=bool(chat),
                          max_new_tokens=max_new_tokens, dtype=model_dtype, scored_tokens=sum(scores.tokens),
                          ppl=scores.ppl, reference_ppl=ref_scores.ppl, agreement=scores.agreement,
                          reference_agreement=ref_scores.agreement, answers=[list(a) for a in answers])
