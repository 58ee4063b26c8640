"""lm-evaluation-harness model ``qjax``: loglikelihood, loglikelihood_rolling and generate_until on a qjax checkpoint.

Command line::

    python -m qjax.evaluation.lm_eval_adapter --model qjax --model_args pretrained=DIR,dtype=bfloat16,batch_size=8 \\
        --tasks hellaswag [any other lm-eval flag]
    qjax lm-eval --model qjax ...           # the same

Python::

    import lm_eval, qjax.evaluation.lm_eval_adapter  # the import registers "qjax"
    lm_eval.simple_evaluate(model="qjax", model_args="pretrained=DIR", tasks=[...])

How lm-eval finds the model, and why a ``python -m`` wrapper: lm-eval 0.4.13 resolves ``--model NAME`` in its model
registry, which is filled only by its own ``lm_eval.models.MODEL_MAPPING`` and by ``@register_model`` decorators that
have run in the process. It reads no entry-point group and has no flag that imports user code (``--include_path``
loads task YAMLs only), so a plain ``lm_eval --model qjax`` cannot see a model defined outside its source tree. Running
lm-eval's own CLI entry point (``lm_eval.__main__.cli_evaluate``) from this module, after the decorator below has
registered the class, gives exactly ``lm_eval``'s command line and behaviour with ``qjax`` available. (Upstream
merged entry-point plugins for models after 0.4.13; once a release ships them, a ``[project.entry-points...]`` table
naming ``qjax.evaluation.lm_eval_adapter:QJaxLM`` makes the bare ``lm_eval`` command work too.)

``model_args``: ``pretrained`` (checkpoint folder with tokenizer.json; default the built-in model), ``dtype``
(``float32``/``bfloat16``/``float16``/``float64``; default the checkpoint's), ``batch_size`` (wins over
``--batch_size``, whose default of 1 lm-eval always passes), ``max_length`` (default min(max_position_embeddings,
4096)), ``max_gen_toks`` (default 256), ``seed`` (sampling), ``prefix_token_id`` (the token scored text is conditioned
on when it has no context; default the tokenizer's end-of-text token, as HFLM does without a BOS), ``enable_thinking``
(passed to the chat template under ``--apply_chat_template``). Text goes through :class:`qjax.tokenizer.Tokenizer` (the
folder's tokenizer.json, its special tokens and chat template).

Scoring follows HFLM: context and continuation are encoded together and split at the context's length (trailing
context spaces move to the continuation), the window is left-truncated to ``max_length + 1`` tokens, and a batch of
requests sorted by length is right-padded — a causal model's scores at real positions never see the pads. Sequence
lengths are rounded up to a few buckets (multiples of 64, then four per octave) and batches filled to ``batch_size``
so a task compiles a handful of programs, not one per request.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.model.dtypes import MODEL_DTYPES
from qjax.tokenizer import Tokenizer

logger = logging.getLogger("qjax")

DEFAULT_MAX_LENGTH = 4096
DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_BATCH_SIZE = 8  # when lm-eval asks for "auto" and gives no --max_batch_size
SCORE_CHUNK = 64  # positions whose [B, chunk, vocab] logits exist at once while scoring
# generation keys lm-eval may hand over that mean "plain decoding" and need no support
NEUTRAL_GEN_KWARGS = {"num_beams": 1, "num_return_sequences": 1}


def bucket_length(n: int) -> int:
    """Padded length for ``n`` tokens: a multiple of 64 up to 256, then four steps per octave (≤ 25 % padding), so
    lengths 1..4096 share 24 compiled shapes. Every bucket is a multiple of 64, the GDN chunk size."""
    if n <= 256:
        return max(64, -(-n // 64) * 64)
    step = 1 << (math.floor(math.log2(n - 1)) - 2)
    return -(-n // step) * step


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, ids, targets):
    """Per-position log p(target) and whether target is the argmax, for ``ids/targets [B, T]`` (T a multiple of
    SCORE_CHUNK): logits are made SCORE_CHUNK positions at a time, never as one [B, T, vocab] array."""
    model = nnx.merge(graphdef, state)
    h = model.forward(ids, last_only=True).hidden  # post-final-norm hidden of every position
    b, t, d = h.shape
    n = t // SCORE_CHUNK
    hs = h.reshape(b, n, SCORE_CHUNK, d).swapaxes(0, 1)
    ts = targets.reshape(b, n, SCORE_CHUNK).swapaxes(0, 1)

    def one(args):
        hc, tc = args
        logits = model.logits_from_hidden(hc)  # the accumulation dtype: float32 (float64 for a float64 model)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp, tc[..., None], axis=-1)[..., 0]
        return lp, jnp.argmax(logits, axis=-1) == tc

    lp, greedy = jax.lax.map(one, (hs, ts))
    return lp.swapaxes(0, 1).reshape(b, t), greedy.swapaxes(0, 1).reshape(b, t)


@register_model("qjax")
class QJaxLM(TemplateLM):
    """A qjax checkpoint as an lm-eval model (see the module docstring for ``model_args``)."""

    def __init__(self, pretrained: str | None = None, dtype: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0, prefix_token_id: int | None = None,
                 enable_thinking: bool | None = None, device: str | None = None, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"qjax model_args: unsupported option(s) {sorted(unknown)}; supported: pretrained, "
                             "dtype, batch_size, max_length, max_gen_toks, seed, prefix_token_id, enable_thinking")
        if device not in (None, "", "auto"):
            logger.info("qjax: --device %s ignored; JAX runs on its default backend (%s)", device,
                        jax.default_backend())
        self.pretrained = os.fspath(pretrained) if pretrained else default_model_dir()
        if not os.path.isfile(os.path.join(self.pretrained, "config.json")):
            raise FileNotFoundError(f"pretrained={self.pretrained}: no config.json (a qjax/HF checkpoint folder)")
        if dtype in (None, "", "auto"):
            jdtype = None
        elif str(dtype) in MODEL_DTYPES:
            jdtype = str(dtype)  # load_model checks it (float64 switches x64 on)
        else:
            raise ValueError(f"qjax model_args dtype={dtype!r}: expected one of {list(MODEL_DTYPES)} or auto")
        self._tok = Tokenizer.from_folder(self.pretrained)  # first: TokenizerError names a missing tokenizer.json
        self.model = qjax.load_model(self.pretrained, dtype=jdtype, text_only=True)
        self._graphdef, self._state = nnx.split(self.model)
        cfg = self.model.config
        eos = [i for i in (self._tok.eos_token_id, *cfg.eos_token_id, *self._tok.stop_token_ids) if i is not None]
        if not eos:
            raise ValueError(f"{self.pretrained}: no end-of-text token (eos_token in tokenizer_config.json, "
                             "eos_token_id in config.json or generation_config.json)")
        self._eot = int(eos[0])
        self._stop_ids = tuple(dict.fromkeys(int(i) for i in eos))  # generation ends on any of them
        self._enable_thinking = enable_thinking
        self.vocab_size = cfg.vocab_size
        self._batch_size = self._resolve_batch_size(batch_size, max_batch_size)
        self._max_length = int(max_length) if max_length else min(cfg.max_position_embeddings, DEFAULT_MAX_LENGTH)
        self._max_gen_toks = int(max_gen_toks)
        if self._max_length < 2 or self._max_gen_toks < 1:
            raise ValueError(f"qjax model_args: max_length={self._max_length} must be ≥ 2 and "
                             f"max_gen_toks={self._max_gen_toks} ≥ 1")
        self._seed = int(seed)
        self._prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self._warned_truncation = False

    # -- construction from lm-eval's arguments ------------------------------------------------------------------------
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "QJaxLM":
        """``model_args`` win over lm-eval's own ``--batch_size``/``--device`` (always passed, 1 by default), so
        ``model_args=...,batch_size=8`` works instead of failing with a duplicate keyword."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "QJaxLM":
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @staticmethod
    def _resolve_batch_size(batch_size, max_batch_size) -> int:
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            size = int(max_batch_size) if max_batch_size else DEFAULT_BATCH_SIZE
            logger.info("qjax: batch_size=%s → %d (no automatic search; set batch_size or --max_batch_size)",
                        batch_size, size)
            return size
        try:
            size = int(batch_size)
        except (TypeError, ValueError):
            raise ValueError(f"qjax model_args batch_size={batch_size!r}: expected a positive integer") from None
        if size < 1:
            raise ValueError(f"qjax model_args batch_size={size}: expected a positive integer")
        return size

    # -- lm-eval properties -------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self._prefix_token_id is None else self._prefix_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return os.path.abspath(self.pretrained).replace("/", "__")

    def get_model_info(self) -> dict:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self._state))
        return {"model_num_parameters": n, "model_dtype": str(self.model.dtype), "pretrained": self.pretrained}

    # -- tokenization -------------------------------------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        # HF tokenizers add special tokens unless told not to; qjax's Tokenizer.encode defaults to not adding them
        ids = self._tok.encode(string, add_special_tokens=add_special_tokens is not False)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- chat (--apply_chat_template) ---------------------------------------------------------------------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template source lm-eval records (and hashes into its request cache); None when not applying one."""
        if chat_template is False or chat_template is None:
            return None
        return self._tok.get_chat_template(None if chat_template is True else chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render as HFLM does: without a generation prompt the last (assistant) message stays open, so that a
        continuation scored or generated after it extends that message (transformers' continue_final_message)."""
        extra = {} if self._enable_thinking is None else {"enable_thinking": bool(self._enable_thinking)}
        text = self._tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt, **extra)
        if not add_generation_prompt and chat_history:
            final = str(chat_history[-1].get("content", ""))
            at = text.rfind(final.strip()) if final.strip() else -1
            if at < 0:
                raise ValueError("chat template: the final message does not appear verbatim in the rendered prompt, "
                                 "so it cannot be left open for the continuation")
            # transformers keeps the message's own trailing spaces when the template preserved them
            keep = final.lstrip() if text[at:at + len(final.lstrip())] == final else final.strip()
            text = text[:at + len(keep)]
        return text

    # -- scoring ------------------------------------------------------------------------------------------------------
    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Score ≤ batch_size (input, target) rows of equal length per row, right-padded into one bucketed batch."""
        t = bucket_length(max(len(inp) for inp, _ in rows))
        ids = np.full((self.batch_size, t), self.eot_token_id, np.int32)
        tgt = np.zeros((self.batch_size, t), np.int32)
        for r, (inp, target) in enumerate(rows):
            ids[r, :len(inp)] = inp
            tgt[r, :len(target)] = target
        lp, greedy = _score(self._graphdef, self._state, jnp.asarray(ids), jnp.asarray(tgt))
        return np.asarray(lp), np.asarray(greedy)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), every continuation token greedy) per (key, context ids, continuation ids)."""
        rows = []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("loglikelihood request with an empty context or continuation after tokenization")
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            whole = (ctx + cont)[-(self.max_length + 1):]
            if len(ctx) + len(cont) > self.max_length + 1 and not self._warned_truncation:
                logger.warning("qjax: context + continuation longer than max_length=%d; left-truncating",
                               self.max_length)
                self._warned_truncation = True
            rows.append((whole[:-1], whole[1:], len(cont)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        with tqdm(total=len(rows), disable=disable_tqdm, desc="qjax loglikelihood") as bar:
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                lp, greedy = self._score_rows([(rows[i][0], rows[i][1]) for i in idx])
                for r, i in enumerate(idx):
                    n, k = len(rows[i][0]), rows[i][2]
                    answer = (float(np.sum(lp[r, n - k:n], dtype=np.float64)), bool(np.all(greedy[r, n - k:n])))
                    out[i] = answer
                    key = requests[i][0]
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(len(idx))
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log likelihood: disjoint max_length windows, each conditioned on the tokens before it (the
        first on ``prefix_token_id``), as HFLM does."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------------------------------
    def _sampling(self, gen_kwargs: dict) -> tuple[list[str], int, dict]:
        """lm-eval gen_kwargs → (stop strings, max new tokens, qjax sampling options). Unset options are lm-eval's
        defaults (greedy), never the checkpoint's generation_config.json."""
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        max_gen = int(kw.pop("max_gen_toks"))
        do_sample = bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        top_k = int(kw.pop("top_k", 0) or 0)
        top_p = float(kw.pop("top_p", 1.0) or 1.0)
        for key, neutral in NEUTRAL_GEN_KWARGS.items():
            if key in kw and kw[key] == neutral:
                kw.pop(key)
        if kw:
            raise ValueError(f"qjax generate_until: unsupported generation option(s) {kw}; supported: until, "
                             "max_gen_toks, do_sample, temperature, top_k, top_p")
        if not do_sample or temperature <= 0.0:  # temperature 0 means greedy in lm-eval
            opts = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
        else:
            opts = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        return [u for u in until if u], max_gen, opts

    def _generate_batch(self, contexts: list[str], until: list[str], max_gen: int, opts: dict, seed: int) -> list[str]:
        max_ctx = self.max_length - max_gen
        if max_ctx < 1:
            raise ValueError(f"max_gen_toks={max_gen} leaves no room for a prompt within max_length={self.max_length}")
        encs = [self.tok_encode(c, left_truncate_len=max_ctx) or [self.prefix_token_id] for c in contexts]
        t = bucket_length(max(len(e) for e in encs))
        ids = np.full((self.batch_size, t), self.eot_token_id, np.int32)
        mask = np.zeros((self.batch_size, t), np.int32)
        for r in range(self.batch_size):  # rows past the real ones repeat the first: they add no decode steps
            e = encs[r] if r < len(encs) else encs[0]
            ids[r, t - len(e):], mask[r, t - len(e):] = e, 1
        stop_ids = set(self._stop_ids)
        n = len(encs)
        gen: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        for step in qjax.stream(self.model, ids, attention_mask=mask, max_new_tokens=max_gen, seed=seed,
                                eos_token_id=list(self._stop_ids), pad_token_id=self.eot_token_id, **opts):
            for r in range(n):
                if done[r]:
                    continue
                tok = int(step[r])
                if tok in stop_ids:
                    done[r] = True
                    continue
                gen[r].append(tok)
                # stop strings are checked on the text (they need not be whole tokens); decoding a few hundred
                # tokens costs far less than a decode step
                if until and any(u in self.tok_decode(gen[r]) for u in until):
                    done[r] = True
            if all(done):
                break
        return [postprocess_generated_text(self.tok_decode(g), until, None) for g in gen]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per the request's gen_kwargs) continuations cut at the first stop string or eos.
        Requests are grouped by gen_kwargs and batched by prompt length."""
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (_, gen_kwargs) in enumerate(args):
            groups[json.dumps(gen_kwargs, sort_keys=True, default=str)].append(i)
        out: list[str | None] = [None] * len(args)
        batch_no = 0
        with tqdm(total=len(args), disable=disable_tqdm, desc="qjax generate_until") as bar:
            for idx in groups.values():
                until, max_gen, opts = self._sampling(args[idx[0]][1])
                lengths = {i: len(self.tok_encode(args[i][0])) for i in idx}
                idx = sorted(idx, key=lambda i: -lengths[i])
                for start in range(0, len(idx), self.batch_size):
                    chunk = idx[start:start + self.batch_size]
                    texts = self._generate_batch([args[i][0] for i in chunk], until, max_gen, opts,
                                                 self._seed + batch_no)
                    batch_no += 1
                    for i, text in zip(chunk, texts):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", args[i], text)
                    bar.update(len(chunk))
        return out  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's own command line, with ``--model qjax`` registered (module docstring)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
