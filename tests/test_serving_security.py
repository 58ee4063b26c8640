"""``qjax serve`` against hostile clients, in-process (the app on its real engine; none of these requests needs a
compile, so they run in the fast loop): strict request types, text UTF-8 cannot encode, client templates, template
variables that collide with the server's, the API key on every working route, prompts too long to tokenize, the
OpenAPI document's ranges and schemathesis' schema-breaking bodies. The live-server side (the official ``openai``
client, a bad request inside a running batch, a size attack's memory and latency, a few hundred fuzzed requests,
SIGTERM with 64 requests in flight) is in tests/test_serving_api.py, on its server."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from starlette.testclient import TestClient

import qjax
from qjax.checkpoint.hub import default_model_dir
from qjax.serving.api import ServerState, create_app
from qjax.serving.engine import Engine, EngineConfig
from qjax.serving.metrics import ServerMetrics
from qjax.tokenizer import Tokenizer

KEY = "sk-qjax-security"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "qjax-sec"
MAX_LEN = 128
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model():
    return qjax.load_model(default_model_dir(), dtype=jnp.float32)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(default_model_dir())


def _app(model, tok, **state):
    """The server's app on a real engine (not started: these requests are refused before they reach it)."""
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=MAX_LEN, max_num_batched_tokens=64),
                    eos_token_ids=tuple(tok.stop_token_ids))
    return create_app(ServerState(engine=engine, tokenizer=tok, served_names=(NAME,), root="x",
                                  metrics=ServerMetrics(NAME), api_key=KEY, **state))


@pytest.fixture(scope="module")
def client(model, tok):
    with TestClient(_app(model, tok), raise_server_exceptions=False) as c:
        yield c


def _refused(r, status: int, *fragments: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    for f in fragments:
        assert f in message, (f, message)
    return message


# ---------------------------------------------------------------------------------------------------------------------
# strict types: each of these was coerced (and answered 200) before
# ---------------------------------------------------------------------------------------------------------------------
WRONG_TYPES = [
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2.0}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": "0.9"}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 5.0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "false"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": 0}, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4.0]]}, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": "8"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": 5}, "tools"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
]


@pytest.mark.parametrize("path,body,field", WRONG_TYPES, ids=[f"{p}-{f}-{json.dumps(b)[-24:]}" for p, b, f in
                                                              WRONG_TYPES])
def test_a_field_of_the_wrong_type_is_refused_not_coerced(client, path, body, field):
    message = _refused(client.post(path, json=body, headers=AUTH), 400, field)
    assert "\n" not in message


def test_values_out_of_the_devices_range_are_refused(client):
    for body, field in (({"top_k": 2 ** 63}, "top_k"), ({"top_k": 2 ** 32 + 5}, "top_k"), ({"seed": 2 ** 64}, "seed"),
                        ({"seed": -2 ** 63 - 1}, "seed"), ({"temperature": -0.5}, "temperature"),
                        ({"top_p": 0}, "top_p"), ({"n": 17}, "n"), ({"stop": [""]}, "stop[0]"),
                        ({"max_tokens": MAX_LEN + 1}, "max_model_len"), ({"logprobs": 21}, "logprobs"),
                        ({"stop_token_ids": [10 ** 9]}, "stop_token_ids")):
        _refused(client.post("/v1/completions", json={"prompt": "x", **body}, headers=AUTH), 400, field)
    _refused(client.post("/v1/completions", json={"prompt": [1, 10 ** 12]}, headers=AUTH), 400, "prompt[1]")


def test_text_utf8_cannot_encode_is_a_400_naming_its_place(client):
    raw = {"/v1/completions": (b'{"prompt": "ok \\ud800"}', "prompt"),
           "/v1/chat/completions": (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                                    b'"\\udfff"}]}]}', "messages[0].content[0].text"),
           "/tokenize": (b'{"prompt": "\\ud83d"}', "prompt")}
    for path, (body, where) in raw.items():
        r = client.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        _refused(r, 400, f"{where}: text with an unpaired surrogate")
    kw = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": ["\\ud800"]}}'
    _refused(client.post("/v1/chat/completions", content=kw, headers=AUTH), 400, "chat_template_kwargs.a[0]")
    pair = client.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers=AUTH)  # a pair is one character
    assert pair.status_code == 200 and pair.json()["count"] >= 1


# ---------------------------------------------------------------------------------------------------------------------
# chat templates and template variables
# ---------------------------------------------------------------------------------------------------------------------
def test_request_templates_are_refused_unless_trusted(client, model, tok):
    own = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    for body, where in (({"chat_template": own}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": own}}, "chat_template_kwargs.chat_template")):
        for path in ("/v1/chat/completions", "/tokenize"):
            _refused(client.post(path, json={"messages": CHAT, **body}, headers=AUTH), 400, where,
                     "--trust-request-chat-template")
    with TestClient(_app(model, tok, trust_request_chat_template=True), raise_server_exceptions=False) as trusting:
        r = trusting.post("/tokenize", json={"messages": CHAT, "chat_template": own}, headers=AUTH)
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode("[Hello]")
        # a trusted template still runs inside the budgets: three nested loops are stopped, not run for hours
        bomb = "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}{% endfor %}" \
               "{% endfor %}{% endfor %}"
        start = time.monotonic()
        _refused(trusting.post("/tokenize", json={"messages": CHAT, "chat_template": bomb}, headers=AUTH), 400,
                 "more than 1,000,000 steps")
        assert time.monotonic() - start < 60
        doubling = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        _refused(trusting.post("/tokenize", json={"messages": CHAT, "chat_template": doubling}, headers=AUTH), 400,
                 "too big")


@pytest.mark.parametrize("kwargs,fragment", [
    ({"add_generation_prompt": 5}, "chat_template_kwargs.add_generation_prompt"),
    ({"tools": 5}, "chat_template_kwargs.tools"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"documents": "x"}, "chat_template_kwargs.documents"),
    ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
])
def test_template_variables_that_collide_or_have_the_wrong_type_are_refused(client, kwargs, fragment):
    for path in ("/v1/chat/completions", "/tokenize"):
        _refused(client.post(path, json={"messages": CHAT, "chat_template_kwargs": kwargs}, headers=AUTH), 400,
                 fragment)


# ---------------------------------------------------------------------------------------------------------------------
# the API key, and bounded work
# ---------------------------------------------------------------------------------------------------------------------
def test_the_api_key_guards_every_route_that_does_work(client):
    for method, path, body in (("post", "/tokenize", {"prompt": "x"}), ("post", "/detokenize", {"tokens": [1]}),
                               ("get", "/tokenizer_info", None), ("get", "/v1/models", None),
                               ("post", "/v1/completions", {"prompt": "x", "n": 0})):  # with the key: a 400
        def call(headers):
            return client.request(method, path, json=body, headers=headers)

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            _refused(call(headers), 401, "API key")
        assert call(AUTH).status_code in (200, 400)
    for path in ("/health", "/ping", "/version", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert client.post("/ping").status_code == 200
    assert client.get("/version").json()["version"]


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(client, tok, monkeypatch):
    seen = []
    real = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a, **k: seen.append(len(text)) or real(
        self, text, *a, **k))
    longest = MAX_LEN * tok.max_token_chars
    _refused(client.post("/v1/completions", json={"prompt": "x" * (longest + 1)}, headers=AUTH), 400,
             f"{longest + 1:,} characters cannot fit in max_model_len {MAX_LEN}")
    _refused(client.post("/v1/completions", json={"prompt": ["ok", "y" * (longest + 1)]}, headers=AUTH), 400,
             "prompt[1]:")
    assert not any(n > longest for n in seen)
    # ordinary text under that bound but far over the context: only its beginning is tokenized
    text = ("It was the best of times, it was the worst of times. " * 200)[:longest - 100]
    _refused(client.post("/v1/completions", json={"prompt": text}, headers=AUTH), 400, "longer than max_model_len")
    assert max(seen) < len(text)
    seen.clear()
    _refused(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                         headers=AUTH), 400, "messages: longer than max_model_len")
    assert max(seen) < len(text)


# ---------------------------------------------------------------------------------------------------------------------
# the OpenAPI document and the fuzzer
# ---------------------------------------------------------------------------------------------------------------------
def test_the_openapi_document_states_this_servers_ranges(client, tok):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    comp = schemas["CompletionRequest"]["properties"]
    assert comp["max_tokens"]["anyOf"][0]["maximum"] == MAX_LEN
    assert comp["logprobs"]["anyOf"][0]["maximum"] == 20
    assert (comp["top_k"]["anyOf"][0]["minimum"], comp["top_k"]["anyOf"][0]["maximum"]) == (-1, 2 ** 31 - 1)
    assert comp["model"]["anyOf"][0]["enum"] == [NAME]
    ids = comp["prompt"]["anyOf"][2]["items"]
    assert ids["maximum"] == len(tok.backend.get_vocab(with_added_tokens=True)) - 1 or ids["maximum"] > 0
    assert not any("x-qjax-limit" in json.dumps(s) for s in schemas.values())
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def _operations(app):
    import schemathesis

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if op.method.upper() == "POST" and op.path != "/ping"]


def test_fuzzed_invalid_bodies_are_all_refused(client):
    """schemathesis' negative mode: bodies that break the schema (types, ranges, required fields) — each must be a
    4xx (never a 5xx, never a 200 that accepted it)."""
    from schemathesis import GenerationMode
    from schemathesis.checks import negative_data_rejection, not_a_server_error

    seen = {}
    for op in _operations(client.app):
        @settings(max_examples=8, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        def run(case):
            r = case.call_and_validate(session=client, headers=AUTH,
                                       checks=[not_a_server_error, negative_data_rejection])
            seen.setdefault(op.path, set()).add(r.status_code)

        run()
    assert set(seen) == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    assert all(400 <= s < 500 for codes in seen.values() for s in codes), seen


def test_the_cli_states_the_image_bounds_the_library_uses():
    # `qjax serve --help` must not import the serving stack, so the flags' defaults are written in the CLI too
    from qjax.cli import serve
    from qjax.multimodal.images import DEFAULT_MAX_IMAGE_PIXELS
    from qjax.serving.api import DEFAULT_MAX_IMAGE_BYTES

    assert (serve.DEFAULT_MAX_IMAGE_PIXELS, serve.DEFAULT_MAX_IMAGE_BYTES) == (DEFAULT_MAX_IMAGE_PIXELS,
                                                                               DEFAULT_MAX_IMAGE_BYTES)


def test_a_starting_server_answers_503_with_its_progress(client):
    state = client.app.state.server
    state.ready, state.startup = False, {"programs": 12, "compiled": 5, "last": "decode rows=1 kv_len=256"}
    try:
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "starting" and h.json()["compiled"] == 5
        assert client.get("/ping").status_code == 503 and client.get("/version").status_code == 200
        _refused(client.post("/v1/completions", json={"prompt": "x"}, headers=AUTH), 503,
                 "the server is starting: compiling its programs (5 of 12 programs compiled)")
    finally:
        state.mark_ready()
    assert client.get("/health").status_code == 200 and client.get("/health").text == ""
