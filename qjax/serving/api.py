"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of a running :class:`~qjax.serving.engine.Engine`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
vLLM's tokenizer routes ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize`` (lm-eval's
``local-completions`` tokenizes through them when asked to), and the open routes ``GET /health``, ``/ping``,
``/version``, ``/metrics`` (Prometheus) and ``/openapi.json`` (the request bodies with this server's ranges,
:mod:`.schema`). With ``--api-key`` every other route needs ``Authorization: Bearer KEY``. Every refusal is OpenAI's
error object with its status (400 for a malformed or invalid request, naming the field; 401 without the key; 404 for
an unknown model or route; 413 for a body over 32 MiB; 503 when busy or shutting down); the server keeps serving
after each.

Untrusted clients: request bodies are typed strictly (no coercion of ``"2"`` to 2; text that UTF-8 cannot encode is
refused), a client's own chat template is refused unless ``--trust-request-chat-template``, a prompt longer than the
context can hold is refused from its length before it is tokenized, and the work a request costs the host — parsing
a large body, rendering the template, tokenizing, decoding images (one at a time) — runs on worker threads, never on
the event loop, so one request cannot stall health checks or other streams. Memory a large request used is handed
back to the system when it ends (``malloc_trim``).

Chat messages may carry images (``image_url`` parts with a ``data:`` URI, or a ``file://`` path under
``--allowed-local-media-path``; qjax never fetches a remote URL). They are decoded, preprocessed and run through the
vision tower on a worker thread (the tower one request at a time), never on the event loop; the request then enters
the engine as its expanded prompt (one token per merged patch, what ``usage.prompt_tokens`` counts) with the
features and M-RoPE positions (:class:`~qjax.serving.engine.ImageInput`).

The engine runs on its own thread; each HTTP request submits its choices there and awaits their outputs on an
asyncio queue. A client that goes away (a closed stream, a dropped connection) aborts its requests: their slots
are free at the engine's next step. Shutting down (:meth:`ServerState.begin_shutdown`, on SIGTERM / Ctrl-C) refuses
new requests with 503, ends every request in flight at the engine's next step, answers each waiting non-streaming
request with a 503 error object and ends each stream with a final chunk (``finish_reason: "abort"``) and
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
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

from .. import xla_env
from ..multimodal.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, decode_image_url, num_image_tokens
from ..multimodal.positions import PromptError, expand_image_tokens
from ..multimodal.prompt import check_vision, image_processor
from ..tokenizer import TokenizerError
from ..validation import parse_json
from . import schema
from .engine import Engine
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Defaults,
    DetokenizeRequest,
    ImagePart,
    ReasoningStream,
    TextAssembler,
    TokenizeCompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    envelope,
    new_id,
    sampling_params,
    split_reasoning,
    template_kwargs,
    unencodable,
    usage,
    validation_message,
)
from .requests import EngineError, ImageInput, encode_images

logger = logging.getLogger("qjax.serving")

MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused before it is read
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # --max-image-bytes: an image's encoded bytes (data: URI base64 or file)
OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/openapi.json")  # no API key needed: they do no work
WORKERS = 4  # requests whose host work (parsing, templates, tokenizing, images) runs at once; the rest wait
TOKENIZE_WORKERS = 2  # /tokenize and /detokenize requests at once (any length: they must not hold the others' workers)
PROBE_CHARS_PER_TOKEN = 8  # a prompt longer than max_model_len × this is first tokenized from its beginning alone
PROBE_MARGIN = 64  # tokens
LARGE_BODY = 1 << 20  # bodies from this size are parsed on a worker thread and trigger a memory release after
TRIM_INTERVAL = 2.0  # seconds between two memory releases at most


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
    trust_request_chat_template: bool = False  # --trust-request-chat-template: run templates clients send
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # --max-image-pixels: an image's decoded width × height
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # --max-image-bytes
    version: str = "0"
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # one request's images at a time, from decoding through the vision tower: a decoded image is up to
    # max_image_pixels × 4 bytes (several times over while it is converted and resized), and the tower's program is
    # as large as its images
    vision_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stopping: bool = False  # set by begin_shutdown: new requests get 503, in-flight ones end
    # False while the engine's programs compile (qjax serve binds its port first): /health answers 503 with
    # ``startup`` (programs compiled so far, of how many), every other working route 503
    ready: bool = True
    startup: dict = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)
    runs: set = dataclasses.field(default_factory=set)  # the _Run of every request in flight
    last_trim: float = 0.0  # when memory was last handed back (_release_memory)
    trim_pending: bool = False

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text that can fit in ``max_model_len`` tokens (a token is at most
        ``max_token_chars`` characters): longer texts are refused without tokenizing them."""
        return self.max_model_len * self.tokenizer.max_token_chars

    def model_name(self, asked: str | None) -> str:
        if asked is None or asked in self.served_names:
            return asked or self.served_names[0]
        raise ApiError(404, f"The model `{asked}` does not exist.", param="model", kind="NotFoundError")

    def mark_ready(self) -> None:
        self.startup = {}
        self.ready = True

    def health(self) -> Response:
        """``/health`` (and ``/ping``): 200 when requests are served (vLLM's meaning), else 503 with a JSON body
        saying why: starting (with the compile progress) or stopping."""
        if self.ready and not self.stopping:
            return Response(status_code=200)
        status = "stopping" if self.stopping else "starting"
        body = {"status": status, "seconds": round(time.monotonic() - self.started, 1), **self.startup}
        return JSONResponse(body, status_code=503)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end the ones in flight (each at the engine's next step; see the module
        docstring). Safe to call from a signal handler on the event loop's thread."""
        self.stopping = True
        for run in list(self.runs):
            run.abort_unfinished()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="qjax serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    work, tokenizing = asyncio.Semaphore(WORKERS), asyncio.Semaphore(TOKENIZE_WORKERS)
    limits = {"max_model_len": state.max_model_len, "max_logprobs": state.engine.config.max_logprobs,
              "max_token_id": state.engine.vocab_size - 1, "served_names": list(state.served_names)}
    app.openapi = lambda: app.openapi_schema or setattr(app, "openapi_schema", schema.openapi(
        app, limits, state.version)) or app.openapi_schema

    async def offload(fn, *args, pool=work):
        """``fn(*args)`` on a worker thread, at most :data:`WORKERS` at once (``pool``: another bound)."""
        async with pool:
            return await asyncio.to_thread(fn, *args)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error(ApiError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}"))
        path = request.url.path
        if state.api_key and path not in OPEN_ROUTES and not _authorized(request, state.api_key):
            return _error(ApiError(401, "missing or wrong API key (Authorization: Bearer …)"))
        if state.stopping and path not in OPEN_ROUTES:
            return _error(ApiError(503, "the server is shutting down"))
        if not state.ready and path not in OPEN_ROUTES:
            done = state.startup
            where = (f" ({done.get('compiled', 0)} of {done['programs']} programs compiled)" if "programs" in done
                     else "")
            return _error(ApiError(503, f"the server is starting: compiling its programs{where}; retry when /health "
                                        "answers 200"))
        response = await call_next(request)
        if _is_large(request):  # answered or refused: its body's memory is garbage now
            _release_memory(state)
        return response

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

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        # a bug: OpenAI's error object for the client (the traceback goes to the server's log, as uvicorn logs it)
        return _error(ApiError(500, f"internal error ({type(e).__name__}); see the server's log"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), kind="NotFoundError" if e.status_code == 404 else None))

    @app.get("/health")
    async def health():
        return state.health()

    @app.get("/ping")
    async def ping():
        return state.health()

    @app.post("/ping")
    async def ping_post():  # SageMaker's health check is a POST
        return state.health()

    @app.get("/version")
    async def version():
        return {"version": state.version}

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

    @app.post("/tokenize", openapi_extra=schema.request_body("/tokenize"))
    async def tokenize(request: Request):
        body = await _json_object(request)
        if "messages" in body:
            req = _parse(ChatCompletionRequest, body)
            state.model_name(req.model)
            ids, images = await offload(_chat_prompt, state, req, False, pool=tokenizing)
            if images:  # the expanded count, as the request would use it (the tower does not run)
                ids = await offload(_count_image_tokens, state, ids, images, pool=tokenizing)
        else:
            req = _parse(TokenizeCompletionRequest, body)
            state.model_name(req.model)
            ids = await offload(state.tokenizer.encode, req.prompt, req.add_special_tokens, pool=tokenizing)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", openapi_extra=schema.request_body("/detokenize"))
    async def detokenize(request: Request):
        req = _parse(DetokenizeRequest, await _json_object(request))
        state.model_name(req.model)
        _check_ids(req.tokens, state.engine.vocab_size, "tokens")
        return {"prompt": await offload(state.tokenizer.decode, req.tokens, pool=tokenizing)}

    @app.post("/v1/completions", openapi_extra=schema.request_body("/v1/completions"))
    async def completions(request: Request):
        body = await _json_object(request)
        req = _parse(CompletionRequest, body)
        model = state.model_name(req.model)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        count = len(req.prompt) if isinstance(req.prompt, list) and req.prompt and not isinstance(
            req.prompt[0], int) else 1
        _check_room(state, count * req.n)
        prompts = await offload(completion_prompts, req, lambda s, where: _encode(state, s, where,
                                                                                  req.add_special_tokens))
        for i, ids in enumerate(prompts):
            _check_ids(ids, state.engine.vocab_size, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        texts = ([req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
                 if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) else None)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else (
            req.logprobs if req.echo and req.logprobs is not None else None)
        run = _Run(state, request, model, req, prompts, max_tokens=max_tokens, logprobs=req.logprobs,
                   prompt_logprobs=prompt_lp)
        run.prompt_texts = texts
        return await run.respond(run.stream_completion, run.completion)

    @app.post("/v1/chat/completions", openapi_extra=schema.request_body("/v1/chat/completions"))
    async def chat(request: Request):
        body = await _json_object(request)
        req = _parse(ChatCompletionRequest, body)
        model = state.model_name(req.model)
        _check_room(state, req.n)
        ids, images = await offload(_chat_prompt, state, req, True)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        image_input = None
        if images:
            try:
                ids, image_input = await _image_prompt(state, ids, images, max_tokens, offload)
            finally:  # the decoded images are garbage now, whatever the outcome
                _release_memory(state)
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
        return await run.respond(run.stream_chat, run.chat)

    return app


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode())


async def _json_object(request: Request) -> dict:
    """The request's JSON object, read at most :data:`MAX_BODY_BYTES` (whether or not it declares its length),
    parsed with qjax.validation's bounds (UTF-8, nesting) — on a worker thread when large — with every string
    encodable as UTF-8 (JSON can write a lone surrogate; a tokenizer cannot take it)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    request.state.body_bytes = size
    data = b"".join(chunks)
    del chunks
    body = await asyncio.to_thread(_load, data) if size >= LARGE_BODY else _load(data)
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _load(data: bytes):
    try:
        body = parse_json(data, "request body", error=ValueError)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON: {e}") from None
    bad = unencodable(body)
    if bad is not None:
        raise ApiError(400, f"{bad}: text with an unpaired surrogate (a \\ud800-\\udfff escape not in a pair) cannot "
                            "be encoded as UTF-8", param=bad.split(".")[0].split("[")[0])
    return body


def _is_large(request: Request) -> bool:
    return getattr(request.state, "body_bytes", 0) >= LARGE_BODY


def _parse(cls, body: dict):
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, validation_message(e)) from None


def _check_ids(ids, vocab: int, field: str) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", param=field)


def _check_room(state: ServerState, choices: int) -> None:
    """503 before any work when the queue cannot take ``choices`` more engine requests."""
    waiting = state.engine.num_pending
    if waiting + choices > state.max_waiting:
        raise ApiError(503, f"the server is busy: {waiting} requests are waiting and this one adds {choices} (limit "
                            f"--max-waiting-requests {state.max_waiting}); retry later")


def _encode(state: ServerState, text: str, where: str, add_special_tokens: bool = False) -> list[int]:
    """``text``'s token ids, for a prompt that must fit the context: refused from its length alone when no
    tokenization could fit it (:attr:`ServerState.max_prompt_chars`), and, when it is long, from its beginning
    alone when that is already more tokens than the context holds — so a request's tokenizing work is bounded by
    the context, not by its body (~1 µs a character: a 30 MB prompt took half a minute)."""
    n = state.max_model_len
    limit = state.max_prompt_chars
    if len(text) > limit:
        raise ApiError(400, f"{where}: {len(text):,} characters cannot fit in max_model_len {n} tokens (at most "
                            f"{limit:,} characters: a token of this tokenizer is at most "
                            f"{state.tokenizer.max_token_chars} characters)", param=where.split("[")[0])
    head = n * PROBE_CHARS_PER_TOKEN
    if len(text) > head:
        # a prefix's token count is the whole text's up to the word it cuts (a few tokens): the margin covers it
        count = len(state.tokenizer.encode(text[:head], add_special_tokens=add_special_tokens))
        if count > n + PROBE_MARGIN:
            raise ApiError(400, f"{where}: longer than max_model_len {n} tokens (its first {head:,} of "
                                f"{len(text):,} characters alone are {count:,} tokens)", param=where.split("[")[0])
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _chat_prompt(state: ServerState, req: ChatCompletionRequest, bounded: bool) -> tuple[list[int], list[ImagePart]]:
    """The rendered prompt's ids (one image placeholder per image) and the request's images, which this server
    must be able to take (:func:`_check_images`); ``bounded``: refuse a prompt too long for the context before
    tokenizing it (``/tokenize`` counts any length). A worker thread's job."""
    messages, images = chat_messages(req)
    if images:
        _check_images(state, images)
    template, kwargs = template_kwargs(req, trust_templates=state.trust_request_chat_template)
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   tools=req.tools, chat_template=template, **kwargs)
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    ids = _encode(state, text, "messages") if bounded else state.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "messages: the rendered prompt is empty", param="messages")
    return ids, images


def _release_memory(state: ServerState) -> None:
    """Hand the heap's free memory back to the system soon (glibc keeps what Python and Pillow freed for reuse: a
    30 MB prompt or a few large images would otherwise stay in the server's resident size): one release at a time,
    at most every :data:`TRIM_INTERVAL` seconds, on a worker thread; one asked for meanwhile waits for its turn."""
    if state.trim_pending or not xla_env.malloc_trim():
        return
    state.trim_pending = True

    async def release():
        await asyncio.sleep(max(0.0, state.last_trim + TRIM_INTERVAL - time.monotonic()))
        state.trim_pending = False
        state.last_trim = time.monotonic()
        await asyncio.to_thread(xla_env.malloc_trim(), 0)

    asyncio.get_running_loop().create_task(release())


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
    """The decoded images (a worker thread's job: Pillow, file reads), each within ``--max-image-bytes`` encoded and
    ``--max-image-pixels`` decoded (checked on its header, before its pixels are decoded); an :class:`ApiError`
    naming the part. The caller holds ``state.vision_lock``: one request's images are in memory at a time."""
    try:
        return [decode_image_url(_local_url(state, im), where=im.where, max_bytes=state.max_image_bytes,
                                 max_image_pixels=state.max_image_pixels) for im in images]
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


def _count_image_tokens(state: ServerState, ids: list[int], images: list[ImagePart]) -> list[int]:
    """``/tokenize``'s count: the prompt with its images' placeholders widened (the tower does not run)."""
    with state.vision_lock:
        return _expand(state, ids, _decode_images(state, images))


async def _image_prompt(state: ServerState, ids: list[int], images: list[ImagePart], max_tokens: int | None,
                        offload) -> tuple[list[int], ImageInput]:
    """Decode, check the expanded length, then preprocess and encode the images — one request's images at a time,
    on a worker thread (``offload``), under the server's vision lock, so memory holds one request's decoded images
    at most: the expanded prompt and its :class:`ImageInput`."""
    def work():
        with state.vision_lock:
            pil = _decode_images(state, images)
            expanded = _expand(state, ids, pil)
            n, limit = len(expanded), state.max_model_len
            if max_tokens is not None and n + max_tokens > limit:
                raise ApiError(400, f"prompt ({n} tokens with its images) + max_tokens ({max_tokens}) = "
                                    f"{n + max_tokens} exceeds max_model_len {limit}", param="messages")
            if max_tokens is None and n >= limit:
                raise ApiError(400, f"the prompt is {n} tokens with its images, which leaves no room in "
                                    f"max_model_len {limit}", param="messages")
            try:
                return encode_images(state.engine.model, ids, pil)
            except (ImageError, PromptError) as e:
                raise ApiError(400, _name_image(str(e), images), param="messages") from None

    return await offload(work)


def _name_image(message: str, images: list[ImagePart]) -> str:
    """A preprocessing error's ``images[i]`` / ``image i`` prefix replaced by the request part it came from."""
    for i, im in enumerate(images):
        for prefix in (f"images[{i}]: ", f"image {i}: "):
            if message.startswith(prefix):
                return f"{im.where}: {message[len(prefix):]}"
    return f"messages: {message}"


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events of ``events``, then ``[DONE]``. An error after the stream started is an ``error`` event
    (OpenAI's error object) before ``[DONE]``: the status line is already sent. A client that went away gets
    nothing more."""
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except ApiError as e:
            if e.status == 499:
                return
            yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"
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
        _check_room(state, len(self.choices))

    async def respond(self, stream, whole):
        """Submit the request and answer it: ``stream()``'s events as SSE when the request streams, else the
        response ``whole()`` builds once every choice finished."""
        self.state.runs.add(self)
        self.submit()
        if self.req.stream:
            async def events():
                try:
                    async for event in stream():
                        yield event
                    self._raise_failure()
                finally:
                    self._done()
            return _sse(events())
        try:
            await self.wait()
            self._raise_failure()
            return whole()
        finally:
            self._done()

    def _done(self) -> None:
        self.abort_unfinished()
        self.state.runs.discard(self)

    def _raise_failure(self) -> None:
        """The error a finished request answers instead of its output: a choice the engine failed on (500, its
        message), or one the server's shutdown stopped (503)."""
        failed = next((ch for ch in self.choices if ch.asm.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"the engine failed on this request: {failed.asm.error or 'internal error'}")
        if self.state.stopping and not self.req.stream and any(
                ch.asm.finish_reason == "abort" for ch in self.choices):
            raise ApiError(503, "the server is shutting down: the request was stopped before it finished")

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
