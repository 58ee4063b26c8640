"""The OpenAI wire format (with vLLM's extensions) on one side, the engine's requests and outputs on the other.

Request bodies are validated with pydantic (unknown fields are accepted and ignored, as vLLM does: evaluation
clients send extra keys); every refusal is an :class:`ApiError` that the server turns into OpenAI's error object.
Responses are plain dicts in the shapes of ``openai-python``'s types (``Completion``, ``ChatCompletion``, their
streaming chunks). :class:`TextAssembler` turns a request's token stream into text: incremental detokenization,
stop strings (cut before the match, held back while streaming until they cannot match), log-probabilities.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .requests import TOP_K_MAX, RequestOutput, SamplingParams, TokenLogprob

# vLLM answers a -inf log-probability with this number (JSON has no infinity)
NEG_INF_LOGPROB = -9999.0


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and a message naming the request part at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "BadRequestError", 422: "BadRequestError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def validation_message(e: ValidationError) -> str:
    """One entry per field, e.g. ``max_tokens: Input should be a valid integer``, at most five. A field of several
    accepted shapes (``prompt``: a string, strings, token ids or lists of token ids) reports the error of the shape
    the value got furthest in (``prompt[0][1]: Input should be greater than or equal to 0``), or, when it matches
    none at all, the shapes it may take."""
    groups: dict[tuple, list[tuple[tuple, str | None, str]]] = {}
    for err in e.errors():
        loc = tuple(x for x in err.get("loc", ()) if x != "body")
        cut = next((i for i, x in enumerate(loc) if _is_branch(x)), None)
        key = loc if cut is None else loc[:cut]
        rest = () if cut is None else tuple(x for x in loc[cut + 1:] if not _is_branch(x))
        groups.setdefault(key, []).append((rest, None if cut is None else loc[cut], err.get("msg", "invalid")))
    parts = []
    for key, errs in groups.items():
        branches: dict[str | None, list] = {}
        for err in errs:
            branches.setdefault(err[1], []).append(err)
        # the closest shape: its errors reach deepest into the value, and there are fewest of them
        rank = {b: (max(len(r) for r, _, _ in es), -len(es)) for b, es in branches.items()}
        best = max(rank.values())
        closest = [b for b, r in rank.items() if r == best]
        if len(closest) == 1:
            rest, _, msg = max(branches[closest[0]], key=lambda x: len(x[0]))
            parts.append(f"{_path(key + rest)}: {msg}")
        else:
            shapes = list(dict.fromkeys(_shape(b) for b in branches if b is not None))
            parts.append(f"{_path(key)}: must be {', '.join(shapes[:-1])} or {shapes[-1]}")
    return "; ".join(parts[:5])


def _is_branch(x) -> bool:
    """Whether a pydantic error location element names a union's branch (``str``, ``list[constrained-int]``,
    ``StreamOptions``) rather than a field or an index."""
    return isinstance(x, str) and ("[" in x or "-" in x or x in ("str", "int", "float", "bool", "none", "dict")
                                   or x[:1].isupper())


def _shape(branch: str) -> str:
    """Words for a union branch: ``list[constrained-int]`` → ``a list of integers``."""
    words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "none": "null",
             "dict[str,any]": "an object"}
    b = branch.replace("constrained-", "")
    depth = 0
    while b.startswith("list[") and b.endswith("]"):
        b, depth = b[5:-1], depth + 1
    word = words.get(b, "an object" if b[:1].isupper() else b)
    for _ in range(depth):
        word = "a list of " + (word.split(" ", 1)[1] + "s" if not word.startswith("a list") else
                               "lists" + word[len("a list"):])
    return word


def _path(loc) -> str:
    """``messages[0].content`` from pydantic's ``("messages", 0, "content")``."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "body"


# ---------------------------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------------------------
# Ranges the request fields state in the server's OpenAPI schema (and pydantic enforces): every value that reaches the
# device fits its array's dtype. The server's own limits (max_model_len, max_logprobs, the vocabulary) are checked
# when the request is admitted and written into the schema it serves (qjax.serving.schema).
INT32_MAX = (1 << 31) - 1  # a count or an id in an int32 array
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 64  # stop strings per request (each is searched for after every token)
MAX_STOP_CHARS = 4096  # characters per stop string
MAX_CHOICES = 16  # n

# a field whose range is this server's own (qjax.serving.schema writes it in: the maximum of a number, the names a
# string may take): the limit's name
LIMIT_MARK = "x-qjax-limit"


def _limit(name: str) -> dict:
    return {"json_schema_extra": {LIMIT_MARK: name}}


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, **_limit("max_token_id"))]
LogprobCount = Annotated[int, Field(ge=0, le=INT32_MAX, **_limit("max_logprobs"))]
TokenCount = Annotated[int, Field(ge=0, le=INT32_MAX, **_limit("max_model_len"))]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    """Fields typed as OpenAI documents them, without coercion (``"2"`` is not an integer, ``1`` is not a boolean);
    unknown fields are accepted and ignored, as vLLM does (evaluation clients send extra keys)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(_Strict):
    model: str | None = Field(None, **_limit("served_names"))
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX, description="-1 or 0: off; above the vocabulary: all tokens")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # neutral values only: anything else would change the tokens and qjax does not implement it
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0)
    min_p: Number | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, Number] | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)

    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else ([self.stop] if isinstance(self.stop, str) else list(self.stop))

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_unsupported(self) -> None:
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                   "min_tokens": 0}
        for name, ok in neutral.items():
            v = getattr(self, name)
            if v is not None and v != ok:
                raise ApiError(400, f"{name}={v} is not supported by qjax serve (only {ok})", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by qjax serve", param="logit_bias")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16
    logprobs: LogprobCount | None = None
    echo: bool = False
    prompt_logprobs: LogprobCount | None = None
    add_special_tokens: bool = True
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    chat_template: str | None = Field(None, description="refused unless the server runs with "
                                                         "--trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``/tokenize`` body for text."""

    prompt: str
    model: str | None = Field(None, **_limit("served_names"))
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    tokens: list[TokenId]
    model: str | None = Field(None, **_limit("served_names"))


# Variables apply_chat_template sets itself: a request's chat_template_kwargs may not replace them (vLLM refuses the
# same); the template itself is its own field (chat_template) and needs --trust-request-chat-template.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "conversation", "tokenize",
                            "return_dict", "continue_final_message")


def template_kwargs(req: ChatCompletionRequest, *, trust_templates: bool) -> tuple[str | None, dict]:
    """The request's own chat template (None: the server's) and its template variables, checked: a request template
    only when the server trusts them, no reserved variable, ``enable_thinking`` a boolean. An :class:`ApiError`
    naming the field otherwise."""
    kwargs = dict(req.chat_template_kwargs or {})
    template = req.chat_template
    where = "chat_template"
    if "chat_template" in kwargs:
        if template is not None:
            raise ApiError(400, "chat_template and chat_template_kwargs.chat_template: give the template once",
                           param="chat_template")
        template, where = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
    if template is not None:
        if not trust_templates:
            raise ApiError(400, f"{where}: this server does not run templates sent by clients (start it with "
                                "--trust-request-chat-template to allow them)", param=where.split(".")[0])
        if not isinstance(template, str):
            raise ApiError(400, f"{where}: a string is required", param=where.split(".")[0])
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise ApiError(400, f"chat_template_kwargs.{key}: set by the server (a request field where one exists); "
                                "it cannot be a template variable", param="chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, f"chat_template_kwargs.enable_thinking: true or false is required, got "
                            f"{type(thinking).__name__}", param="chat_template_kwargs")
    return template, kwargs


def unencodable(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in a parsed JSON body that is not valid Unicode (a
    lone surrogate such as ``"\\ud800"``: JSON can write it, UTF-8 cannot encode it), or None."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and unencodable(k) is not None:
                    return f"{at}.{k!a}" if at else ascii(k)
                stack.append((x, f"{at}.{k}" if at else str(k)))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
    return None


@dataclasses.dataclass(frozen=True)
class ImagePart:
    """An image a chat request sends: ``where`` names its request part (``messages[0].content[1].image_url``),
    ``url`` is its ``data:`` URI or ``file://`` path (or anything else, refused when it is decoded)."""

    where: str
    url: str


# OpenAI / vLLM content part types (a part without "type" is typed by its key, as vLLM and the templates do)
TEXT_PARTS = ("text", "input_text")
IMAGE_PARTS = ("image_url", "input_image", "image")
VIDEO_PARTS = ("video_url", "input_video", "video")
AUDIO_PARTS = ("audio_url", "input_audio", "audio")


def _part_type(part: dict) -> Any:
    kind = part.get("type")
    if kind is None:
        kind = next((k for k in ("text", *IMAGE_PARTS, *VIDEO_PARTS, *AUDIO_PARTS) if k in part), None)
    return kind


def chat_messages(req: ChatCompletionRequest) -> tuple[list[dict], list[ImagePart]]:
    """The request's messages as the chat template takes them, and its images in prompt order.

    Text parts become ``{"type": "text", "text": …}``; each image part (``image_url`` with ``{"url": …}`` or a
    string, ``input_image``, ``image``) becomes ``{"type": "image"}``, which the Qwen templates render as
    ``<|vision_start|><|image_pad|><|vision_end|>``. Video and audio parts, and part types qjax does not know, are
    an :class:`ApiError` naming the part."""
    messages: list[dict] = []
    images: list[ImagePart] = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                at = f"messages[{i}].content[{j}]"
                kind = _part_type(part)
                if kind in TEXT_PARTS:
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, f"{at}.text: a string is required", param="messages")
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in IMAGE_PARTS:
                    images.append(_image_part(part, at))
                    parts.append({"type": "image"})
                elif kind in VIDEO_PARTS:
                    raise ApiError(400, f"{at}: video input is not supported (qjax serves text and image input)",
                                   param="messages")
                elif kind in AUDIO_PARTS:
                    raise ApiError(400, f"{at}: audio input is not supported (qjax serves text and image input)",
                                   param="messages")
                else:
                    raise ApiError(400, f"{at}: content part type {kind!r} is not supported (text, image_url)",
                                   param="messages")
            content = parts
        messages.append({**m.model_dump(exclude_none=True), "content": content if content is not None else ""})
    return messages, images


def _image_part(part: dict, at: str) -> ImagePart:
    """The URL of one image part: ``{"image_url": {"url": …}}`` or ``{"image_url": "…"}`` (``image_url``,
    ``input_image``), ``{"image": "…"}`` or ``{"url": "…"}`` (``image``)."""
    for key in ("image_url", "image", "url"):
        if key in part:
            value = part[key]
            where = f"{at}.{key}"
            break
    else:
        raise ApiError(400, f"{at}: an image part needs image_url.url (a data: URI or a file:// path)",
                       param="messages")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where}: the image URL must be a non-empty string (a data: URI or a file:// path)",
                       param="messages")
    return ImagePart(where, value)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Server-side sampling defaults for fields a request leaves out (vLLM: the model's generation_config)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_generation_config(cls, gc) -> "Defaults":
        """``qjax.GenerationConfig`` → defaults; ``do_sample: false`` means greedy (temperature 0)."""
        if gc is None:
            return cls()
        return cls(temperature=float(gc.temperature) if gc.do_sample else 0.0, top_p=float(gc.top_p),
                   top_k=int(gc.top_k))


def sampling_params(req: _Request, defaults: Defaults, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None, seed: int | None) -> SamplingParams:
    req.check_unsupported()
    top_k = defaults.top_k if req.top_k is None else req.top_k
    for name in ("temperature", "top_p"):
        v = getattr(req, name)
        if v is not None and not math.isfinite(v):
            raise ApiError(400, f"{name} must be a finite number", param=name)
    return SamplingParams(
        max_tokens=max_tokens, temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p, top_k=0 if top_k == -1 else top_k, seed=seed,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)


def completion_prompts(req: CompletionRequest, encode) -> list[list[int]]:
    """The request's prompts as token id lists (``encode(text, where) → ids``, ``where`` naming the request part:
    ``prompt`` or ``prompt[i]``); an empty prompt is refused."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [encode(p, "prompt")]
    elif not p:
        raise ApiError(400, "prompt: empty", param="prompt")
    elif isinstance(p[0], str):
        prompts = [encode(s, f"prompt[{i}]") for i, s in enumerate(p)]
    elif isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"prompt{'' if len(prompts) == 1 else f'[{i}]'}: empty (no tokens)", param="prompt")
    return prompts


# ---------------------------------------------------------------------------------------------------------------------
# outputs → text
# ---------------------------------------------------------------------------------------------------------------------
def clamp(lp: float) -> float:
    return lp if math.isfinite(lp) else NEG_INF_LOGPROB


class TextAssembler:
    """One choice's output: token ids, their text (special tokens skipped unless asked), stop strings, logprobs."""

    def __init__(self, tokenizer, *, stops: list[str], include_stop: bool = False, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
        self.stops = stops
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters already streamed
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # finish_reason "error": what the engine said

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: RequestOutput) -> bool:
        """Take one engine output; True when a stop string ended the choice here (the caller aborts the request)."""
        if self.finished:
            return False
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for i, t in enumerate(out.new_token_ids):
            self.token_ids.append(t)
            if out.new_logprobs is not None:
                self.logprobs.append(out.new_logprobs[i])
            start = max(0, len(self.text) - self.holdback)
            self.text += self.decoder.push(t)
            if self.stops and self._cut(start):
                return True
        if out.finished:
            start = max(0, len(self.text) - self.holdback)
            self.text += self.decoder.flush()
            if self.stops and self._cut(start):
                return True
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.error = getattr(out, "error", None)
        return False

    def _cut(self, start: int) -> bool:
        hits = [(self.text.find(s, start), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def delta(self) -> str:
        """Text not streamed yet that no stop string can still change."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - (self.holdback if self.stops
                                                                                    else 0))
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])


def completion_logprobs(a: TextAssembler, prompt_ids: list[int] | None, prompt_text: str, k: int,
                        start: int = 0, offset0: int = 0) -> dict:
    """The ``logprobs`` object of a completion choice: tokens, token_logprobs, top_logprobs, text_offset (with
    echo, the prompt's entries first; entry 0 has no log-probability)."""
    entries: list[tuple[int, TokenLogprob | None]] = []
    if prompt_ids is not None:
        plp = a.prompt_logprobs or [None] * len(prompt_ids)
        entries += [(t, plp[i] if i < len(plp) else None) for i, t in enumerate(prompt_ids)]
    entries += [(lp.token_id, lp) for lp in a.logprobs]
    entries = entries[start:]
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = offset0
    for t, lp in entries:
        s = a.token_text(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(clamp(lp.logprob))
        top = {a.token_text(i): clamp(v) for i, v in lp.top[:k]}
        top.setdefault(s, clamp(lp.logprob))  # the chosen token is always listed, as vLLM does
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(a: TextAssembler, k: int, start: int = 0) -> dict:
    """``choices[i].logprobs`` of a chat completion: one entry per generated token."""
    def entry(t, lp):
        s = a.token_text(t)
        return {"token": s, "logprob": clamp(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(i, v) for i, v in lp.top[:k]]) for lp in a.logprobs[start:]],
            "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, rid: str, model: str, created: int | None = None, **fields: Any) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()) if created is None else created, "model": model,
            **fields}


# ---------------------------------------------------------------------------------------------------------------------
# Qwen3 reasoning parser (vLLM's --reasoning-parser qwen3)
# ---------------------------------------------------------------------------------------------------------------------
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, *, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: a leading ``<think>`` is dropped; text before ``</think>`` is the
    reasoning, after it the content; without ``</think>`` it is all reasoning when thinking was on (the answer was
    cut short) and all content when it was off. Empty parts are None."""
    if text.startswith(THINK_START):
        text = text[len(THINK_START):]
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
    elif thinking:
        reasoning, content = text, ""
    else:
        reasoning, content = "", text
    return reasoning or None, content or None


class ReasoningStream:
    """The streaming form of :func:`split_reasoning`: text deltas in, (reasoning delta, content delta) out."""

    def __init__(self, *, thinking: bool):
        self.in_reasoning = thinking
        self.buf = ""
        self.started = False

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if not self.started:
            if len(self.buf) < len(THINK_START) and THINK_START.startswith(self.buf) and not final:
                return "", ""
            if self.buf.startswith(THINK_START):
                self.buf = self.buf[len(THINK_START):]
                self.in_reasoning = True
            self.started = True
        if self.in_reasoning:
            at = self.buf.find(THINK_END)
            if at >= 0:
                reasoning, rest = self.buf[:at], self.buf[at + len(THINK_END):]
                self.in_reasoning, self.buf = False, ""
                content = rest
            else:
                keep = 0 if final else _partial_suffix(self.buf, THINK_END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        else:
            content, self.buf = self.buf, ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back: it may complete)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
