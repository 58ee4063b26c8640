"""``qjax generate`` and ``qjax chat``: text in, text streamed out as the model produces it.

    qjax generate [--model DIR] "It is a truth"          continue a text
    qjax generate --chat [--no-think] "Who are you?"     one user turn through the chat template
    qjax generate --model DIR --image a.png "Describe this image."   one user turn: the images, then the text
    qjax chat [--model DIR] [--system TEXT] [--no-think] an interactive conversation (stdin may be a pipe)

Without ``--model`` both use the built-in model (text-only). Images need a checkpoint with its vision tower; in chat,
``/image PATH`` attaches an image to the next user message, and every later turn re-runs the conversation with all of
its images, in order (the history is re-rendered each turn, images included). Stop tokens come from the tokenizer
(generation_config.json's eos ids, the tokenizer's eos, ``<|im_end|>``, ``<|endoftext|>``); unset sampling flags from
generation_config.json. Bad input is one ``error: ...`` line and exit status 2; Ctrl-C ends with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from qjax.cli.options import (
    add_compile_cache_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    start_compile_cache,
)

# chat prompts are left-padded to a multiple of this, so that turns of similar length reuse the compiled prefill (its
# shape is the prompt's; the decode step's is the cache's, already in whole blocks: qjax.model.cache.cache_length);
# left pads are exact no-ops in qjax's cached generation
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
                verbose: bool = False, images: Sequence | None = None, **sampling) -> list[int]:
    """Generate after the prompt ``ids`` and write the text to ``out`` piece by piece as it decodes.

    ``pad_to``: left-pad the prompt to a multiple of this many tokens (masked, no effect on the result; not with
    ``images``: the prompt is re-laid out when its placeholders expand). ``images``: for the prompt's image
    placeholders, in order (:func:`qjax.generate`'s ``images``). ``verbose``: a :func:`report_line` on stderr at the
    end. Returns the generated ids without the stop token.
    """
    import qjax

    n = len(ids)
    width = n if images else -(-n // pad_to) * pad_to
    pad = tokenizer.pad_token_id or 0
    prompt = np.full((1, width), pad, np.int32)
    prompt[0, width - n:] = ids
    mask = np.zeros((1, width), np.int32)
    mask[0, width - n:] = 1
    if images:
        sampling = dict(sampling, images=list(images))
    stop = set(stop_ids)
    dec = tokenizer.stream_decoder()
    got: list[int] = []
    stats = _stats(sampling, verbose)
    t0 = time.perf_counter()
    first = None
    for step in qjax.stream(model, prompt, attention_mask=mask, eos_token_id=list(stop_ids), stats=stats,
                            **sampling):
        tok = int(step[0])
        if first is None:
            first = time.perf_counter() - t0
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
        report_line(len(got), time.perf_counter() - t0, stats, first)
    return got


def _stats(sampling: dict, verbose: bool):
    """A stats object for a verbose speculative stream (None otherwise: nothing to count)."""
    if not verbose or sampling.get("speculative") is None:
        return None
    from qjax.runtime.speculative import SpeculativeStats

    return SpeculativeStats(num_speculative_tokens=sampling["num_speculative_tokens"])


def report_line(n_tokens: int, seconds: float, stats, first: float | None = None) -> None:
    """One line on stderr: tokens, time, tokens per second (prefill included), the steady decode speed after the
    first token (``first``: seconds to it — prefill, and in a fresh process the compiles), and what speculation
    accepted."""
    line = f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tok/s"
    if first is not None and n_tokens > 1 and seconds > first:
        line += (f"; first token after {first:.2f} s, then {(n_tokens - 1) / (seconds - first):.1f} tok/s "
                 "(steady decode)")
    if stats is not None:
        per = " ".join(f"{x:.2f}" for x in stats.acceptance_per_position)
        line += (f"; mtp k={stats.num_speculative_tokens}: {stats.rounds} verify calls, mean accepted length "
                 f"{stats.mean_accepted_length:.2f}, acceptance per position {per}")
    sys.stderr.write(line + "]\n")
    sys.stderr.flush()


def _show_prompt(text: str, n_tokens: int, images: Sequence["Attachment"] = ()) -> None:
    """The rendered prompt on stderr; with images, ``n_tokens`` counts each image's tokens (what runs), not the one
    ``<|image_pad|>`` per image the text shows."""
    of = (f", of which {sum(a.tokens for a in images)} for {len(images)} image{'s' if len(images) != 1 else ''}"
          if images else "")
    sys.stderr.write(f"--- prompt ({n_tokens} tokens{of}) ---\n{text}\n--- end of prompt ---\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Attachment:
    """An image the user gave (``--image PATH``, ``/image PATH``), decoded once and reused for every turn."""

    name: str  # the path as given
    image: Any  # PIL.Image.Image
    tokens: int  # the prompt positions it takes (merged patches after the processor's resize)

    def describe(self) -> str:
        return f"{self.name} ({self.image.width}×{self.image.height}, {self.tokens} image tokens)"


def load_attachment(path: str, processor, *, where: str) -> Attachment:
    """Decode the image file ``path`` (an ImageError starting with ``where`` when it cannot be used) and count the
    tokens it takes with ``processor`` (an :class:`qjax.multimodal.images.ImageProcessorConfig`)."""
    from qjax.multimodal.images import ImageError, load_image, num_image_tokens

    if not path:
        raise ImageError(f"{where}: give an image file, e.g. {where} photo.png")
    image = load_image(os.path.expanduser(path), where=where)
    try:
        tokens = num_image_tokens(image.height, image.width, processor)
    except ImageError as e:
        raise ImageError(f"{where}: {path}: {e}") from None
    return Attachment(path, image, tokens)


def image_input_problem(folder: str, *, builtin: bool, has_config: bool, has_tower: bool) -> str | None:
    """Why a model cannot take images (None when it can): the built-in model, a text-only config.json, or a
    checkpoint (or load) without the tower's tensors."""
    if builtin and not (has_config and has_tower):
        return ("the built-in model is text-only: for image input give --model a Qwen3.5/3.6 checkpoint folder with "
                "its vision tower (vision_config in config.json, model.visual.* tensors)")
    if not has_config:
        return (f"{folder} is a text-only checkpoint (its config.json has no vision_config): image input needs a "
                "Qwen3.5/3.6 checkpoint with its vision tower (model.visual.* tensors)")
    if not has_tower:
        return (f"{folder} has no vision tower (config.json has a vision_config but the checkpoint stores no "
                "model.visual.* tensors): image input is unavailable")
    return None


def _check_folder_takes_images(folder: str, *, builtin: bool):
    """The folder's VisionConfig, from config.json and the safetensors headers alone (before minutes of loading); a
    PromptError naming what is missing otherwise."""
    from qjax.checkpoint.layout import VISUAL_PREFIX
    from qjax.checkpoint.view import Checkpoint
    from qjax.model.config import VisionConfig
    from qjax.multimodal.positions import PromptError

    vision = VisionConfig.from_file(folder)
    has_tower = False
    if vision is not None:
        ckpt = Checkpoint(folder)
        try:
            has_tower = any(k.startswith(VISUAL_PREFIX) for k in ckpt.keys())
        finally:
            ckpt.close()
    problem = image_input_problem(folder, builtin=builtin, has_config=vision is not None, has_tower=has_tower)
    if problem:
        raise PromptError(problem)
    return vision


def user_message(text: str, n_images: int = 0) -> dict:
    """A user turn: plain text, or (with images) the image parts first and the text after them, as the Qwen3.5/3.6
    model cards' examples and vLLM's OpenAI messages put them; the chat template writes each image part as
    ``<|vision_start|><|image_pad|><|vision_end|>``."""
    if not n_images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"}] * n_images + ([{"type": "text", "text": text}]
                                                                          if text else [])}


def expanded_length(ids: Sequence[int], images: Sequence[Attachment], image_token_id: int) -> int:
    """The length of the prompt that runs: each image's placeholder becomes its image's tokens. Raises a
    PromptError when the rendered prompt does not hold one placeholder per image (a template that drops images)."""
    from qjax.multimodal.positions import PromptError

    n = sum(1 for t in ids if t == image_token_id)
    if n != len(images):
        raise PromptError(f"the rendered prompt has {n} image placeholder{'s' if n != 1 else ''} (token "
                          f"{image_token_id}) but {len(images)} image{'s were' if len(images) != 1 else ' was'} "
                          "given: the chat template does not render the image parts")
    return len(ids) - n + sum(a.tokens for a in images)


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
def _compile_cache(a: argparse.Namespace, command: str) -> None:
    """The persistent compilation cache on (``--compile-cache``), named on stderr with ``--verbose``."""
    path = start_compile_cache(a.compile_cache)
    if a.verbose:
        print(f"qjax {command}: compile cache {path or 'off'}", file=sys.stderr, flush=True)


@_user_facing
def run_generate(a: argparse.Namespace) -> int:
    """``qjax generate``: a text (or ``--ids``) prompt, or one chat turn with ``--chat``; the answer streamed. With
    ``--image`` (repeatable) the turn is the images then the text; the images are decoded and the checkpoint's tower
    checked before the model loads, and the context check counts each image's tokens."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.model.config import TextConfig

    check_max_new_tokens(a.max_new_tokens)
    _compile_cache(a, "generate")
    image_paths = list(getattr(a, "image", None) or [])
    chat = a.chat or bool(image_paths)  # an image prompt only exists as a chat turn: --image implies --chat
    if not chat and (a.no_think or a.system is not None):
        raise ValueError("--no-think and --system apply to chat prompts; add --chat")
    if image_paths and a.ids is not None:
        raise ValueError("--image makes a chat turn of the images and PROMPT text; it cannot be combined with --ids")
    if image_paths and a.speculative is not None:
        raise ValueError("--speculative does not take image input yet; leave out --speculative or --image")
    folder = a.model or default_model_dir()
    cfg = TextConfig.from_file(folder)
    tokenizer = None
    images: list[Attachment] = []
    n_run = 0
    if image_paths:  # every image checked before the model loads (minutes for a real checkpoint)
        from qjax.multimodal.images import ImageProcessorConfig

        vision = _check_folder_takes_images(folder, builtin=a.model is None)
        processor = ImageProcessorConfig.from_folder(folder, patch_size=vision.patch_size,
                                                     temporal_patch_size=vision.temporal_patch_size,
                                                     merge_size=vision.spatial_merge_size)
        images = [load_attachment(path, processor, where="--image") for path in image_paths]
    if a.ids is not None:
        if a.chat:
            raise ValueError("--chat renders a text prompt; it cannot be combined with --ids")
        ids = [int(x) for x in a.ids.replace(",", " ").split()]
        n_run = len(ids)
    else:
        tokenizer = _tokenizer(a.tokenizer or folder, "; pass the prompt as token ids with --ids")
        if not a.prompt and not images:
            raise ValueError("empty prompt: give PROMPT text (or token ids with --ids)")
        if chat:
            text = render_conversation(tokenizer, [user_message(a.prompt or "", len(images))], system=a.system,
                                       enable_thinking=False if a.no_think else None)
            ids = tokenizer.encode(text)
        else:
            text, ids = a.prompt, tokenizer.encode(a.prompt, add_special_tokens=True)
        n_run = expanded_length(ids, images, vision.image_token_id) if images else len(ids)
        if a.show_prompt:
            _show_prompt(text, n_run, images)
    if not ids:
        raise ValueError("empty prompt")
    # with images, the prompt that runs: each image's placeholder widened to its tokens
    check_fits(n_run, a.max_new_tokens, cfg.max_position_embeddings, os.path.join(folder, "config.json"))
    model = _load(folder, a)
    if images:
        from qjax.multimodal.prompt import check_vision

        check_vision(model)
    if tokenizer is not None:
        stream_text(model, tokenizer, ids, sys.stdout, stop_ids=tokenizer.stop_token_ids, seed=a.seed,
                    verbose=a.verbose, images=[x.image for x in images], **_sampling_kwargs(a))
    else:
        import qjax

        sampling = _sampling_kwargs(a)
        stats = _stats(sampling, a.verbose)
        t0, n, first = time.perf_counter(), 0, None
        for step in qjax.stream(model, np.asarray([ids], np.int32), seed=a.seed, stats=stats, **sampling):
            if first is None:
                first = time.perf_counter() - t0
            sys.stdout.write(f"{int(step[0])} ")
            sys.stdout.flush()
            n += 1
        if a.verbose:
            sys.stdout.write("\n")
            report_line(n, time.perf_counter() - t0, stats, first)
            return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# qjax chat
# ---------------------------------------------------------------------------------------------------------------------
class ChatSession:
    """A conversation with one model: each turn re-renders the whole history with the chat template (templates may
    rewrite earlier turns — Qwen's drops old reasoning — so the new prompt need not extend the old one) and runs it
    from the start, with every image of the conversation in the order its placeholders appear."""

    def __init__(self, model, tokenizer, *, context: int, config_path: str, system: str | None = None,
                 enable_thinking: bool | None = None, seed: int = 0, show_prompt: bool = False, verbose: bool = False,
                 folder: str = "", builtin: bool = False, **sampling):
        self.model, self.tokenizer = model, tokenizer
        self.context, self.config_path = context, config_path
        self.system, self.enable_thinking = system, enable_thinking
        self.seed, self.show_prompt, self.verbose, self.sampling = seed, show_prompt, verbose, sampling
        self.folder, self.builtin = folder, builtin
        self.history: list[dict] = []
        self.images: list[Attachment] = []  # the history's images, in prompt order
        self.pending: list[Attachment] = []  # attached with /image, for the next user message
        self.turns = 0

    def reset(self) -> None:
        self.history.clear()
        self.images.clear()
        self.pending.clear()

    def image_problem(self) -> str | None:
        """Why this session cannot take images (None when it can)."""
        problem = image_input_problem(self.folder or "this checkpoint", builtin=self.builtin,
                                      has_config=getattr(self.model, "vision_config", None) is not None,
                                      has_tower=getattr(self.model, "visual", None) is not None)
        if problem is None and self.sampling.get("speculative") is not None:
            problem = "--speculative does not take image input yet; restart without --speculative to attach images"
        return problem

    def attach(self, path: str) -> Attachment:
        """Decode the image at ``path`` for the next user message (a PromptError or ImageError, one line, when it
        cannot be used: the session is unchanged)."""
        from qjax.multimodal.positions import PromptError
        from qjax.multimodal.prompt import image_processor

        problem = self.image_problem()
        if problem:
            raise PromptError(f"/image: {problem}")
        att = load_attachment(path, image_processor(self.model), where="/image")
        self.pending.append(att)
        return att

    def reply(self, user_text: str, out: TextIO) -> str:
        """Stream the assistant's answer to ``out``; the exchange (with the images attached to it) joins the history
        once the answer is complete."""
        asked = self.history + [user_message(user_text, len(self.pending))]
        images = self.images + self.pending
        text = render_conversation(self.tokenizer, asked, system=self.system, enable_thinking=self.enable_thinking)
        ids = self.tokenizer.encode(text)
        n_run = expanded_length(ids, images, self.model.vision_config.image_token_id) if images else len(ids)
        if self.show_prompt:
            _show_prompt(text, n_run, images)
        check_fits(n_run, self.sampling["max_new_tokens"], self.context, self.config_path)
        got = stream_text(self.model, self.tokenizer, ids, out, stop_ids=self.tokenizer.stop_token_ids,
                          pad_to=CHAT_PAD_MULTIPLE, seed=self.seed + self.turns, verbose=self.verbose,
                          images=[x.image for x in images], **self.sampling)
        # special tokens stay in the stored answer: templates find a reasoning trace by its </think>
        answer = self.tokenizer.decode(got)
        self.history = asked + [{"role": "assistant", "content": answer}]
        self.images, self.pending = images, []
        self.turns += 1
        return answer


@_user_facing
def run_chat(a: argparse.Namespace) -> int:
    """``qjax chat``: read user lines from stdin until EOF or an empty line; ``/reset`` forgets the conversation,
    ``/image PATH`` attaches an image to the next user message."""
    from qjax.checkpoint.hub import default_model_dir
    from qjax.model.config import TextConfig
    from qjax.multimodal.images import ImageError
    from qjax.multimodal.positions import PromptError

    check_max_new_tokens(a.max_new_tokens)
    _compile_cache(a, "chat")
    folder = a.model or default_model_dir()
    cfg = TextConfig.from_file(folder)
    tokenizer = _tokenizer(a.tokenizer or folder)
    session = ChatSession(_load(folder, a), tokenizer, context=cfg.max_position_embeddings,
                          config_path=os.path.join(folder, "config.json"), system=a.system,
                          enable_thinking=False if a.no_think else None, seed=a.seed, show_prompt=a.show_prompt,
                          verbose=a.verbose, folder=folder, builtin=a.model is None, **_sampling_kwargs(a))
    interactive = sys.stdin.isatty()
    if interactive:
        images = ("/image PATH attaches an image to your next message" if session.image_problem() is None else
                  "(no /image: this model takes text only)")
        print(f"chatting with {folder}: an empty line or Ctrl-D ends, /reset forgets the conversation, {images}",
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
        command, _, rest = line.strip().partition(" ")
        if command == "/image":
            try:
                att = session.attach(_unquote(rest.strip()))
            except (ImageError, PromptError) as e:  # one line; the conversation goes on without it
                print(f"error: {e}", file=sys.stderr)
                status = 2
                continue
            print(f"attached {att.describe()}", file=sys.stderr)
            continue
        try:
            session.reply(line, sys.stdout)
        except (ContextError, PromptError, ImageError) as e:
            # the conversation no longer fits (or its images cannot run): this turn is dropped, with the images
            # attached to it, and the session goes on
            dropped = len(session.pending)
            session.pending.clear()
            also = f" (its {dropped} attached image{'s' if dropped != 1 else ''} dropped too)" if dropped else ""
            print(f"error: {e}; /reset starts a new conversation{also}", file=sys.stderr)
            status = 2
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
    return status


def _unquote(path: str) -> str:
    """``/image "my photo.png"`` → ``my photo.png`` (a terminal's drag-and-drop quotes paths with spaces)."""
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        return path[1:-1]
    return path


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
    add_compile_cache_argument(p)
    add_tokenizer_argument(p)


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
                                          "EOF ends, /reset forgets the conversation, /image PATH attaches an image "
                                          "to the next user message (repeat for several; needs a checkpoint with its "
                                          "vision tower; later turns keep the conversation's images).")
    c.add_argument("--model", default=None,
                   help="checkpoint folder (config.json, safetensors, tokenizer.json; default: the built-in model)")
    add_chat_prompt_arguments(c)
    add_sampling_arguments(c, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    c.set_defaults(func=run_chat)
