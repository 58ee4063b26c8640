"""``qjax generate`` and ``qjax chat``: text in, text streamed out as the model produces it.

    qjax generate [--model DIR] "It is a truth"          continue a text
    qjax generate --chat [--no-think] "Who are you?"     one user turn through the chat template
    qjax chat [--model DIR] [--system TEXT] [--no-think] an interactive conversation (stdin may be a pipe)

Without ``--model`` both use the built-in model. Stop tokens come from the tokenizer (generation_config.json's eos ids,
the tokenizer's eos, ``<|im_end|>``, ``<|endoftext|>``); unset sampling flags from generation_config.json. Bad input is
one ``error: ...`` line and exit status 2; Ctrl-C ends with status 130.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import numpy as np

from qjax.cli.options import add_dtype_argument

# chat prompts are left-padded to a multiple of this, so that turns of similar length reuse the compiled prefill and
# decode step (their shapes depend on the prompt length); left pads are exact no-ops in qjax's cached generation
CHAT_PAD_MULTIPLE = 128
CHAT_MAX_NEW_TOKENS = 512


def render_conversation(tokenizer, history: Sequence[Mapping], *, system: str | None = None,
                        enable_thinking: bool | None = None) -> str:
    """The prompt for the next assistant turn: ``system`` (if any), then ``history`` (alternating user/assistant
    messages, the last one the user's), rendered with the tokenizer's chat template and its generation prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)


class ContextError(ValueError):
    """The prompt and the answer do not fit the model's context; the message names the numbers."""


def check_fits(n_prompt: int, max_new_tokens: int, context: int, config_path: str) -> None:
    """Raise ContextError when ``n_prompt`` tokens plus ``max_new_tokens`` exceed the model's ``context``."""
    if n_prompt >= context:
        raise ContextError(f"the prompt is {n_prompt} tokens but the model's context is {context} positions "
                         f"(max_position_embeddings in {config_path})")
    if n_prompt + max_new_tokens > context:
        raise ContextError(f"the prompt ({n_prompt} tokens) plus --max-new-tokens {max_new_tokens} needs "
                         f"{n_prompt + max_new_tokens} positions but the model's context is {context} "
                         f"(max_position_embeddings in {config_path}); use --max-new-tokens {context - n_prompt} "
                         "or less")


def check_max_new_tokens(n: int) -> None:
    if n < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {n}")


def stream_text(model, tokenizer, ids: Sequence[int], out: TextIO, *, stop_ids: Sequence[int], pad_to: int = 1,
                verbose: bool = False, **sampling) -> list[int]:
    """Generate after the prompt ``ids`` and write the text to ``out`` piece by piece as it decodes.

    ``pad_to``: left-pad the prompt to a multiple of this many tokens (masked, no effect on the result).
    ``verbose``: a :func:`report_line` on stderr at the end. Returns the generated ids without the stop token.
    """
    import qjax

    n = len(ids)
    width = -(-n // pad_to) * pad_to
    pad = tokenizer.pad_token_id or 0
    prompt = np.full((1, width), pad, np.int32)
    prompt[0, width - n:] = ids
    mask = np.zeros((1, width), np.int32)
    mask[0, width - n:] = 1
    stop = set(stop_ids)
    dec = tokenizer.stream_decoder()
    got: list[int] = []
    stats = _stats(sampling, verbose)
    t0 = time.perf_counter()
    for step in qjax.stream(model, prompt, attention_mask=mask, eos_token_id=list(stop_ids), stats=stats,
                            **sampling):
        tok = int(step[0])
        if tok in stop:
            break
        got.append(tok)
        piece = dec.push(tok)
        if piece:
            out.write(piece)
            out.flush()
    out.write(dec.flush())
    out.flush()
    if verbose:
        report_line(len(got), time.perf_counter() - t0, stats)
    return got


def _stats(sampling: dict, verbose: bool):
    """A stats object for a verbose speculative stream (None otherwise: nothing to count)."""
    if not verbose or sampling.get("speculative") is None:
        return None
    from qjax.runtime.speculative import SpeculativeStats

    return SpeculativeStats(num_speculative_tokens=sampling["num_speculative_tokens"])


def report_line(n_tokens: int, seconds: float, stats) -> None:
    """One line on stderr: tokens, time, tokens per second (prefill included), and what speculation accepted."""
    line = f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tok/s"
    if stats is not None:
        per = " ".join(f"{x:.2f}" for x in stats.acceptance_per_position)
        line += (f"; mtp k={stats.num_speculative_tokens}: {stats.rounds} verify calls, mean accepted length "
                 f"{stats.mean_accepted_length:.2f}, acceptance per position {per}")
    sys.stderr.write(line + "]\n")
    sys.stderr.flush()


def _show_prompt(text: str, n_tokens: int) -> None:
    sys.stderr.write(f"--- prompt ({n_tokens} tokens) ---\n{text}\n--- end of prompt ---\n")
    sys.stderr.flush()


def _user_facing(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Ctrl-C → newline and status 130; a closed stdout (``| head``) → quiet exit."""

    @functools.wraps(run)
    def wrapper(a: argparse.Namespace) -> int:
        try:
            return run(a)
        except KeyboardInterrupt:
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass
            return 130
        except BrokenPipeError:
            # stop Python's exit-time flush from failing again on the closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return wrapper


def _sampling_kwargs(a: argparse.Namespace) -> dict:
    kw = dict(max_new_tokens=a.max_new_tokens, do_sample=a.do_sample, temperature=a.temperature, top_k=a.top_k,
              top_p=a.top_p)
    if a.speculative is not None:
        kw.update(speculative=a.speculative, num_speculative_tokens=a.num_speculative_tokens)
    return kw


def _load(folder: str, a: argparse.Namespace):
    import jax.numpy as jnp

    import qjax

    return qjax.load_model(folder, dtype=jnp.dtype(a.dtype) if a.dtype else None, mesh=a.mesh or None,
                           verify=a.verify)


def _tokenizer(folder: str, hint: str = ""):
    from qjax.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_folder(folder)
    except TokenizerError as e:
        raise TokenizerError(f"{e}{hint}") from None


# ---------------------------------------------------------------------------------------------------------------------
# qjax generate
# ---------------------------------------------------------------------------------------------------------------------
@_user_facing
def run_generate(a: argparse.Namespace) -> int:
    """``qjax generate``: a text (or ``--ids``) prompt, or one chat turn with ``--chat``; the answer streamed."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.model.config import TextConfig

    check_max_new_tokens(a.max_new_tokens)
    if not a.chat and (a.no_think or a.system is not None):
        raise ValueError("--no-think and --system apply to chat prompts; add --chat")
    folder = a.model or default_model_dir()
    cfg = TextConfig.from_file(folder)
    tokenizer = None
    if a.ids is not None:
        if a.chat:
            raise ValueError("--chat renders a text prompt; it cannot be combined with --ids")
        ids = [int(x) for x in a.ids.replace(",", " ").split()]
    else:
        tokenizer = _tokenizer(folder, "; pass the prompt as token ids with --ids")
        if not a.prompt:
            raise ValueError("empty prompt: give PROMPT text (or token ids with --ids)")
        if a.chat:
            text = render_conversation(tokenizer, [{"role": "user", "content": a.prompt}], system=a.system,
                                       enable_thinking=False if a.no_think else None)
            ids = tokenizer.encode(text)
        else:
            text, ids = a.prompt, tokenizer.encode(a.prompt, add_special_tokens=True)
        if a.show_prompt:
            _show_prompt(text, len(ids))
    if not ids:
        raise ValueError("empty prompt")
    check_fits(len(ids), a.max_new_tokens, cfg.max_position_embeddings, os.path.join(folder, "config.json"))
    model = _load(folder, a)
    if tokenizer is not None:
        stream_text(model, tokenizer, ids, sys.stdout, stop_ids=tokenizer.stop_token_ids, seed=a.seed,
                    verbose=a.verbose, **_sampling_kwargs(a))
    else:
        import qjax

        sampling = _sampling_kwargs(a)
        stats = _stats(sampling, a.verbose)
        t0, n = time.perf_counter(), 0
        for step in qjax.stream(model, np.asarray([ids], np.int32), seed=a.seed, stats=stats, **sampling):
            sys.stdout.write(f"{int(step[0])} ")
            sys.stdout.flush()
            n += 1
        if a.verbose:
            sys.stdout.write("\n")
            report_line(n, time.perf_counter() - t0, stats)
            return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# qjax chat
# ---------------------------------------------------------------------------------------------------------------------
class ChatSession:
    """A conversation with one model: each turn re-renders the whole history with the chat template (templates may
    rewrite earlier turns — Qwen's drops old reasoning — so the new prompt need not extend the old one)."""

    def __init__(self, model, tokenizer, *, context: int, config_path: str, system: str | None = None,
                 enable_thinking: bool | None = None, seed: int = 0, show_prompt: bool = False, verbose: bool = False,
                 **sampling):
        self.model, self.tokenizer = model, tokenizer
        self.context, self.config_path = context, config_path
        self.system, self.enable_thinking = system, enable_thinking
        self.seed, self.show_prompt, self.verbose, self.sampling = seed, show_prompt, verbose, sampling
        self.history: list[dict] = []
        self.turns = 0

    def reset(self) -> None:
        self.history.clear()

    def reply(self, user_text: str, out: TextIO) -> str:
        """Stream the assistant's answer to ``out``; the exchange joins the history once the answer is complete."""
        asked = self.history + [{"role": "user", "content": user_text}]
        text = render_conversation(self.tokenizer, asked, system=self.system, enable_thinking=self.enable_thinking)
        ids = self.tokenizer.encode(text)
        if self.show_prompt:
            _show_prompt(text, len(ids))
        check_fits(len(ids), self.sampling["max_new_tokens"], self.context, self.config_path)
        got = stream_text(self.model, self.tokenizer, ids, out, stop_ids=self.tokenizer.stop_token_ids,
                          pad_to=CHAT_PAD_MULTIPLE, seed=self.seed + self.turns, verbose=self.verbose,
                          **self.sampling)
        # special tokens stay in the stored answer: templates find a reasoning trace by its </think>
        answer = self.tokenizer.decode(got)
        self.history = asked + [{"role": "assistant", "content": answer}]
        self.turns += 1
        return answer


@_user_facing
def run_chat(a: argparse.Namespace) -> int:
    """``qjax chat``: read user lines from stdin until EOF or an empty line; ``/reset`` forgets the conversation."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.model.config import TextConfig

    check_max_new_tokens(a.max_new_tokens)
    folder = a.model or default_model_dir()
    cfg = TextConfig.from_file(folder)
    tokenizer = _tokenizer(folder)
    session = ChatSession(_load(folder, a), tokenizer, context=cfg.max_position_embeddings,
                          config_path=os.path.join(folder, "config.json"), system=a.system,
                          enable_thinking=False if a.no_think else None, seed=a.seed, show_prompt=a.show_prompt,
                          verbose=a.verbose, **_sampling_kwargs(a))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {folder}: an empty line or Ctrl-D ends, /reset forgets the conversation",
              file=sys.stderr)
    status = 0
    while True:
        if interactive:
            try:
                line = input(">>> ")
            except EOFError:
                sys.stdout.write("\n")
                break
        else:
            line = sys.stdin.readline()
            if not line:
                break
        line = line.rstrip("\r\n")
        if not line.strip():
            break
        if line.strip() == "/reset":
            session.reset()
            if interactive:
                print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            session.reply(line, sys.stdout)
        except ContextError as e:  # the conversation no longer fits: this turn is dropped, the session goes on
            print(f"error: {e}; /reset starts a new conversation", file=sys.stderr)
            status = 2
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
    return status


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"default {max_new_tokens}")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy (default: generation_config.json)")
    p.add_argument("--temperature", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", choices=["mtp"], default=None,
                   help="speculative decoding with the checkpoint's MTP head: greedy gives the same tokens, "
                        "sampling the same distribution, in fewer main-model calls")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="drafts per main-model call (default 1)")
    p.add_argument("--verbose", action="store_true",
                   help="after each answer, print to stderr its tokens per second and, with --speculative, the "
                        "mean accepted length and the acceptance per draft position")
    add_dtype_argument(p)
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="run on several devices, e.g. tensor=2,expert=4 (axes data, tensor, expert; see README)")
    add_verify_argument(p)


def add_verify_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the check of tensor values while loading (NaN, infinity, zero scales)")


def add_chat_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``generate --chat`` and ``chat``."""
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-think", action="store_true",
                   help="pass enable_thinking=False to the chat template (Qwen3.5/3.6: answer without reasoning)")
    p.add_argument("--show-prompt", action="store_true",
                   help="write each rendered prompt (and its token count) to stderr")


def register(subparsers) -> None:
    c = subparsers.add_parser("chat", help="interactive chat with a checkpoint's chat template (stdin may be piped)",
                              description="Chat with a model: one user message per line of stdin; an empty line or "
                                          "EOF ends, /reset forgets the conversation.")
    c.add_argument("--model", default=None,
                   help="checkpoint folder (config.json, safetensors, tokenizer.json; default: the built-in model)")
    add_chat_prompt_arguments(c)
    add_sampling_arguments(c, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    c.set_defaults(func=run_chat)
