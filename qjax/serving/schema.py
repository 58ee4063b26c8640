"""The OpenAPI document a running server serves at ``/openapi.json``: its routes, their request bodies, and the ranges
of every field as this server enforces them.

The request bodies are the pydantic models of :mod:`.protocol` (the routes parse bodies themselves, to bound their
size and name the part at fault, so FastAPI does not see them): their JSON schemas are written into the document's
components once. Fields whose range is the server's own — ``max_tokens`` up to ``--max-model-len``, log-probability
counts up to ``--max-logprobs``, token ids below the vocabulary size — carry a ``x-qjax-limit`` mark in the models
and get this server's number here, so a client (or a fuzzer) reads the limits the server applies.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import (
    LIMIT_MARK,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)

# route → the body it takes (several: any of them)
BODIES: dict[str, tuple[type, ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, ChatCompletionRequest),
    "/detokenize": (DetokenizeRequest,),
}


def request_body(path: str) -> dict:
    """A route's ``openapi_extra``: its JSON body, by reference to the components :func:`openapi` adds."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in BODIES[path]]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi(app: FastAPI, limits: dict[str, Any], version: str) -> dict:
    """The OpenAPI document of ``app``: its routes (FastAPI's), the request models' schemas, and ``limits``
    (``max_model_len``, ``max_logprobs``, ``max_token_id``, ``served_names``) in place of the marked ranges."""
    doc = get_openapi(title=app.title, version=version, routes=app.routes,
                      description="OpenAI-compatible API of qjax serve (vLLM's routes and extensions)")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for models in BODIES.values():
        for model in models:
            s = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(s.pop("$defs", {}))
            schemas[model.__name__] = s
    _apply_limits(doc, limits)
    return doc


def _apply_limits(node: Any, limits: dict[str, Any]) -> None:
    """Give every schema that carries a limit mark the server's value (the mark is removed): a number's
    ``maximum``, or the ``enum`` of names a string field (its string branch, when it may also be null) takes."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            name = x.pop(LIMIT_MARK, None)
            if name is not None:
                value = limits[name]
                if isinstance(value, list):
                    for branch in x.get("anyOf", [x]):
                        if branch.get("type") == "string":
                            branch["enum"] = value
                else:
                    x["maximum"] = value
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
