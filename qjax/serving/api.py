"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of a running :class:`~qjax.serving.engine.Engine`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's tokenizer routes ``GET /tokenizer_info``,
``POST /tokenize``, ``POST /detokenize`` (lm-eval's ``local-completions`` tokenizes through them when asked to).
Every refusal is OpenAI's error object with its status (400 for a malformed or invalid request, 401 without the
``--api-key``, 404 for an unknown model or route); the server keeps serving after each.

Chat messages may carry images (``image_url`` parts with a ``data:`` URI, or a ``file://`` path under
``--allowed-local-media-path``; qjax never fetches a remote URL). They are decoded, preprocessed and run through the
vision tower on a worker thread (the tower one request at a time), never on the event loop; the request then enters
the engine as its expanded prompt (one token per merged patch, what ``usage.prompt_tokens`` counts) with the
features and M-RoPE positions (:class:`~qjax.serving.engine.ImageInput`).

The engine runs on its own thread; each HTTP request submits its choices there and awaits their outputs on an
asyncio queue. A client that goes away (a closed stream, a dropped connection) aborts its requests: their slots
are free at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..multimodal.images import ImageError, decode_image_url, num_image_tokens
from ..multimodal.positions import PromptError, expand_image_tokens
from ..multimodal.prompt import check_vision, image_processor
from ..tokenizer import TokenizerError
from ..validation import parse_json
from .engine import Engine, EngineError, ImageInput, encode_images
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Defaults,
    ImagePart,
    ReasoningStream,
    TextAssembler,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    envelope,
    new_id,
    sampling_params,
    split_reasoning,
    usage,
    validation_message,
)

logger = logging.getLogger("qjax.serving")

MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused before it is read


@dataclasses.dataclass
class ServerState:
    """What the routes share: the engine (already started), the tokenizer, names and limits."""

    engine: Engine
    tokenizer: object  # qjax.tokenizer.Tokenizer
    served_names: tuple[str, ...]
    root: str  # the model folder (``/v1/models``' ``root``)
    metrics: ServerMetrics
    defaults: Defaults = Defaults()
    api_key: str | None = None
    reasoning_parser: str | None = None  # "qwen3" (deepseek_r1 behaves the same for these tags)
    max_waiting: int = 1024  # engine requests (prompts × n) queued at most; beyond it a request gets 503
    image_limit: int | None = None  # --limit-mm-per-prompt's image count (None: no limit; 0: the tower not loaded)
    media_path: str | None = None  # --allowed-local-media-path, resolved (None: file:// URLs refused)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # one vision-tower call at a time (each is a device program as large as its images)
    vision_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def model_name(self, asked: str | None) -> str:
        if asked is None or asked in self.served_names:
            return asked or self.served_names[0]
        raise ApiError(404, f"The model `{asked}` does not exist.", param="model", kind="NotFoundError")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="qjax serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error(ApiError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}"))
        if state.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return _error(ApiError(401, "missing or wrong API key (Authorization: Bearer …)"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return _error(ApiError(400, f"malformed JSON body: {errors[0].get('ctx', {}).get('error', 'invalid')}"))
        parts = []
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return _error(ApiError(400, "; ".join(parts), param=None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), kind="NotFoundError" if e.status_code == 404 else None))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "qjax", "root": state.root,
             "parent": None, "max_model_len": state.max_model_len} for name in state.served_names]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = state.tokenizer
        info = {k: v for k, v in tok.special_tokens.items()}
        info.update({"tokenizer_class": "qjax.tokenizer.Tokenizer", "model_max_length": state.max_model_len,
                     "chat_template": tok.get_chat_template() if tok.chat_template is not None else None})
        info.setdefault("eos_token", None)
        return info

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json_object(request)
        if "messages" in body:
            req = _parse(ChatCompletionRequest, body)
            ids, images = _chat_prompt(state, req)
            if images:  # the expanded count, as the request would use it (the tower does not run)
                pil = await asyncio.to_thread(_decode_images, state, images)
                ids = _expand(state, ids, pil)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt: a string is required", param="prompt")
            ids = state.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json_object(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "tokens: a list of token ids is required", param="tokens")
        _check_ids(tokens, state.engine.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _json_object(request))
        model = state.model_name(req.model)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        prompts = completion_prompts(
            req, lambda s: state.tokenizer.encode(s, add_special_tokens=req.add_special_tokens))
        for ids in prompts:
            _check_ids(ids, state.engine.vocab_size, "prompt")
        texts = ([req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
                 if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) else None)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else (
            req.logprobs if req.echo and req.logprobs is not None else None)
        run = _Run(state, request, model, req, prompts, max_tokens=max_tokens, logprobs=req.logprobs,
                   prompt_logprobs=prompt_lp)
        run.prompt_texts = texts
        run.submit()
        if req.stream:
            return _sse(run.stream_completion())
        await run.wait()
        return run.completion()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatCompletionRequest, await _json_object(request))
        model = state.model_name(req.model)
        ids, images = _chat_prompt(state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        image_input = None
        if images:
            ids, image_input = await _image_prompt(state, ids, images, max_tokens)
        if max_tokens is None:
            max_tokens = max(state.max_model_len - len(ids), 0)
            if max_tokens == 0:
                raise ApiError(400, f"the prompt is {len(ids)} tokens, which leaves no room in max_model_len "
                                    f"{state.max_model_len}", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        run = _Run(state, request, model, req, [ids], max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=None,
                   images=[image_input])
        kwargs = req.chat_template_kwargs or {}
        run.thinking = state.reasoning_parser is not None and kwargs.get("enable_thinking", True) is not False
        run.submit()
        if req.stream:
            return _sse(run.stream_chat())
        await run.wait()
        return run.chat()

    return app


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json_object(request: Request) -> dict:
    """The request's JSON object, read at most :data:`MAX_BODY_BYTES` (whether or not it declares its length) and
    parsed with qjax.validation's bounds (UTF-8, nesting)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        body = parse_json(b"".join(chunks), "request body", error=ValueError)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse(cls, body: dict):
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, validation_message(e)) from None


def _check_ids(ids, vocab: int, field: str) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", param=field)


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], list[ImagePart]]:
    """The rendered prompt's ids (one image placeholder per image) and the request's images, which this server
    must be able to take (:func:`_check_images`)."""
    messages, images = chat_messages(req)
    if images:
        _check_images(state, images)
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   tools=req.tools, **kwargs)
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    ids = state.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "messages: the rendered prompt is empty", param="messages")
    return ids, images


# ---------------------------------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------------------------------
def _check_images(state: ServerState, images: list[ImagePart]) -> None:
    """Refuse a request's images before any is read: the server's limit, a model without its tower, speculation."""
    where = images[0].where
    if state.image_limit == 0:
        raise ApiError(400, f"{where}: image input is disabled on this server (--limit-mm-per-prompt image 0: the "
                            "vision tower is not loaded)", param="messages")
    if state.image_limit is not None and len(images) > state.image_limit:
        raise ApiError(400, f"messages: {len(images)} images in one request, more than the {state.image_limit} "
                            f"per prompt that --limit-mm-per-prompt allows", param="messages")
    try:
        check_vision(state.engine.model)
    except PromptError as e:
        raise ApiError(400, f"{where}: image input is unavailable: {e}; only text parts are supported",
                       param="messages") from None
    if state.engine.k:
        raise ApiError(400, f"{where}: image input with MTP speculative decoding (--speculative-config) is not "
                            "supported; serve without it to take images", param="messages")


def _decode_images(state: ServerState, images: list[ImagePart]) -> list:
    """The decoded images (a worker thread's job: Pillow, file reads); an :class:`ApiError` naming the part."""
    try:
        return [decode_image_url(_local_url(state, im), where=im.where) for im in images]
    except ImageError as e:
        raise ApiError(400, str(e), param="messages") from None


def _local_url(state: ServerState, im: ImagePart) -> str:
    """``im.url``; a ``file://`` URL only under ``--allowed-local-media-path`` (symbolic links resolved; vLLM's
    rule), given on as the resolved path's URL so that the file checked is the file read."""
    if im.url[:5].lower() != "file:":
        return im.url
    if state.media_path is None:
        raise ImageError(f"{im.where}: file:// image URLs are refused: this server reads local images only under "
                         "--allowed-local-media-path DIR; send the image as a data: URI")
    parts = urllib.parse.urlsplit(im.url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or not path.startswith("/") \
            or "\x00" in path:
        return im.url  # decode_image_url names what is wrong with it
    real = os.path.realpath(path)
    if os.path.commonpath([real, state.media_path]) != state.media_path:
        raise ImageError(f"{im.where}: {path} is not under --allowed-local-media-path {state.media_path}")
    return "file://" + urllib.parse.quote(real)


def _expand(state: ServerState, ids: list[int], pil: list) -> list[int]:
    """``ids`` with each image placeholder widened to its image's merged-patch count."""
    model = state.engine.model
    proc = image_processor(model)
    counts = []
    for i, im in enumerate(pil):
        try:
            counts.append(num_image_tokens(im.height, im.width, proc))
        except ImageError as e:
            raise ApiError(400, f"image {i}: {e}", param="messages") from None
    try:
        return expand_image_tokens(ids, counts, model.vision_config.image_token_id)
    except PromptError as e:
        raise ApiError(400, f"messages: {e} (each image part renders one <|image_pad|>)", param="messages") from None


async def _image_prompt(state: ServerState, ids: list[int], images: list[ImagePart],
                        max_tokens: int | None) -> tuple[list[int], ImageInput]:
    """Decode, check the expanded length, then preprocess and encode the images (worker threads; the tower under
    the server's lock): the expanded prompt and its :class:`ImageInput`."""
    pil = await asyncio.to_thread(_decode_images, state, images)
    expanded = _expand(state, ids, pil)
    n, limit = len(expanded), state.max_model_len
    if max_tokens is not None and n + max_tokens > limit:
        raise ApiError(400, f"prompt ({n} tokens with its images) + max_tokens ({max_tokens}) = {n + max_tokens} "
                            f"exceeds max_model_len {limit}", param="messages")
    if max_tokens is None and n >= limit:
        raise ApiError(400, f"the prompt is {n} tokens with its images, which leaves no room in max_model_len "
                            f"{limit}", param="messages")

    def encode():
        with state.vision_lock:
            return encode_images(state.engine.model, ids, pil)

    try:
        out_ids, image_input = await asyncio.to_thread(encode)
    except (ImageError, PromptError) as e:
        raise ApiError(400, _name_image(str(e), images), param="messages") from None
    return out_ids, image_input


def _name_image(message: str, images: list[ImagePart]) -> str:
    """A preprocessing error's ``images[i]`` / ``image i`` prefix replaced by the request part it came from."""
    for i, im in enumerate(images):
        for prefix in (f"images[{i}]: ", f"image {i}: "):
            if message.startswith(prefix):
                return f"{im.where}: {message[len(prefix):]}"
    return f"messages: {message}"


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@dataclasses.dataclass
class _Choice:
    index: int
    prompt: int  # which prompt
    request_id: str
    asm: TextAssembler
    streamed_lp: int = 0  # logprob entries already streamed
    role_sent: bool = False


class _Run:
    """One HTTP request's engine requests (prompts × n) and how their outputs become a response."""

    def __init__(self, state: ServerState, request: Request, model: str, req, prompts: list[list[int]], *,
                 max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                 images: list[ImageInput | None] | None = None):
        self.state, self.request, self.model, self.req, self.prompts = state, request, model, req, prompts
        self.images = images or [None] * len(prompts)
        self.id = new_id("cmpl" if isinstance(req, CompletionRequest) else "chatcmpl")
        self.created = int(time.time())
        self.logprobs = logprobs
        self.prompt_texts: list[str] | None = None
        self.thinking = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.choices: list[_Choice] = []
        self.params = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                sp = sampling_params(req, state.defaults, max_tokens=max_tokens, logprobs=logprobs,
                                     prompt_logprobs=prompt_logprobs, seed=seed)
                try:
                    state.engine.validate(ids, sp, self.images[p])
                except EngineError as e:
                    which = f"prompt[{p}] " if len(prompts) > 1 else ""
                    raise ApiError(400, f"{which}{e}") from None
                asm = TextAssembler(state.tokenizer, stops=req.stop_strings(),
                                    include_stop=req.include_stop_str_in_output,
                                    skip_special_tokens=req.skip_special_tokens)
                self.choices.append(_Choice(len(self.choices), p, f"{self.id}-{len(self.choices)}", asm))
                self.params.append(sp)
        waiting = state.engine.num_pending
        if waiting + len(self.choices) > state.max_waiting:
            raise ApiError(503, f"the server is busy: {waiting} requests are waiting and this one adds "
                                f"{len(self.choices)} (limit --max-waiting-requests {state.max_waiting}); retry "
                                "later")

    def submit(self) -> None:
        def deliver(i: int, out) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))
            except RuntimeError:  # the event loop is gone (the server stopped): nobody waits for this output
                pass

        for ch, sp in zip(self.choices, self.params):
            self.state.engine.add_request(ch.request_id, self.prompts[ch.prompt], sp,
                                          lambda out, i=ch.index: deliver(i, out), images=self.images[ch.prompt])

    def abort_unfinished(self) -> None:
        for ch in self.choices:
            if not ch.asm.finished:
                self.state.engine.abort(ch.request_id)

    async def _next(self) -> int:
        """Wait for the next engine output and apply it; returns the choice it belongs to. Polls the connection so
        a client that went away aborts its requests."""
        while True:
            try:
                i, out = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    raise ApiError(499, "client disconnected")
                continue
            ch = self.choices[i]
            if ch.asm.add(out):  # a stop string ended it: the engine need not go on
                self.state.engine.abort(ch.request_id)
            return i

    async def wait(self) -> None:
        try:
            while not all(ch.asm.finished for ch in self.choices):
                await self._next()
        finally:
            self.abort_unfinished()

    def _usage(self) -> dict:
        return usage(sum(len(p) for p in self.prompts), sum(len(ch.asm.token_ids) for ch in self.choices))

    def _prompt_text(self, ch: _Choice) -> str:
        if self.prompt_texts is not None:
            return self.prompt_texts[ch.prompt]
        return self.state.tokenizer.decode(self.prompts[ch.prompt])

    def _extras(self, ch: _Choice) -> dict:
        extra = {"stop_reason": ch.asm.stop_reason}
        if self.req.return_token_ids:
            extra.update(token_ids=ch.asm.token_ids, prompt_token_ids=self.prompts[ch.prompt])
        return extra

    # -- completions ----------------------------------------------------------------------------------------------
    def completion(self) -> dict:
        echo = self.req.echo
        choices = []
        for ch in self.choices:
            prompt_text = self._prompt_text(ch) if echo else ""
            lp = None
            if self.logprobs is not None:
                lp = completion_logprobs(ch.asm, self.prompts[ch.prompt] if echo else None, prompt_text, self.logprobs)
            choice = {"index": ch.index, "text": prompt_text + ch.asm.text, "logprobs": lp,
                      "finish_reason": ch.asm.finish_reason, **self._extras(ch)}
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(ch.asm, self.req.prompt_logprobs)
            choices.append(choice)
        return envelope("text_completion", self.id, self.model, self.created, choices=choices, usage=self._usage())

    async def stream_completion(self) -> AsyncIterator[dict]:
        try:
            if self.req.echo:
                for ch in self.choices:
                    yield self._chunk_completion(ch, self._prompt_text(ch), None)
            while not all(ch.asm.finished for ch in self.choices):
                i = await self._next()
                ch = self.choices[i]
                piece = ch.asm.delta()
                lp = None
                if self.logprobs is not None:
                    n = len(ch.asm.logprobs)
                    lp = completion_logprobs(ch.asm, None, "", self.logprobs, start=ch.streamed_lp)
                    ch.streamed_lp = n
                if piece or ch.asm.finished or (lp and lp["tokens"]):
                    yield self._chunk_completion(ch, piece, lp, ch.asm.finish_reason)
            if self.req.include_usage():
                yield envelope("text_completion", self.id, self.model, self.created, choices=[], usage=self._usage())
        finally:
            self.abort_unfinished()

    def _chunk_completion(self, ch: _Choice, text: str, lp, finish: str | None = None) -> dict:
        choice = {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            choice.update(self._extras(ch))
        return envelope("text_completion", self.id, self.model, self.created, choices=[choice])

    # -- chat -----------------------------------------------------------------------------------------------------
    def _message(self, ch: _Choice) -> dict:
        if self.state.reasoning_parser is None:
            return {"role": "assistant", "content": ch.asm.text, "tool_calls": []}
        reasoning, content = split_reasoning(ch.asm.text, thinking=self.thinking)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning, "reasoning": reasoning,
                "tool_calls": []}

    def chat(self) -> dict:
        choices = []
        for ch in self.choices:
            lp = chat_logprobs(ch.asm, self.logprobs) if self.logprobs is not None else None
            choices.append({"index": ch.index, "message": self._message(ch), "logprobs": lp,
                            "finish_reason": ch.asm.finish_reason, **self._extras(ch)})
        return envelope("chat.completion", self.id, self.model, self.created, choices=choices, usage=self._usage())

    async def stream_chat(self) -> AsyncIterator[dict]:
        parsers = {ch.index: ReasoningStream(thinking=self.thinking) for ch in self.choices}
        try:
            for ch in self.choices:
                yield self._chunk_chat(ch, {"role": "assistant", "content": ""})
            while not all(ch.asm.finished for ch in self.choices):
                i = await self._next()
                ch = self.choices[i]
                piece = ch.asm.delta()
                delta = {}
                if self.state.reasoning_parser is not None:
                    reasoning, content = parsers[i].push(piece, final=ch.asm.finished)
                    if reasoning:
                        delta.update(reasoning_content=reasoning, reasoning=reasoning)
                    if content:
                        delta["content"] = content
                elif piece:
                    delta["content"] = piece
                lp = None
                if self.logprobs is not None and len(ch.asm.logprobs) > ch.streamed_lp:
                    lp = chat_logprobs(ch.asm, self.logprobs, start=ch.streamed_lp)
                    ch.streamed_lp = len(ch.asm.logprobs)
                if delta or lp or ch.asm.finished:
                    yield self._chunk_chat(ch, delta, lp, ch.asm.finish_reason)
            if self.req.include_usage():
                yield envelope("chat.completion.chunk", self.id, self.model, self.created, choices=[],
                               usage=self._usage())
        finally:
            self.abort_unfinished()

    def _chunk_chat(self, ch: _Choice, delta: dict, lp=None, finish: str | None = None) -> dict:
        choice = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            choice.update(self._extras(ch))
        return envelope("chat.completion.chunk", self.id, self.model, self.created, choices=[choice])


def _vllm_prompt_logprobs(asm: TextAssembler, k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt position ``{token_id: {logprob, rank, decoded_token}}`` (first None)."""
    out = []
    for lp in asm.prompt_logprobs or []:
        if lp is None:
            out.append(None)
            continue
        entry = {}
        for rank, (i, v) in enumerate(lp.top[:k], start=1):
            entry[str(i)] = {"logprob": v, "rank": rank, "decoded_token": asm.token_text(i)}
        if str(lp.token_id) not in entry:
            rank = 1 + sum(v > lp.logprob for _, v in lp.top)
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": rank,
                                       "decoded_token": asm.token_text(lp.token_id)}
        out.append(entry)
    return out
