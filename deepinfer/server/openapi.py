"""The OpenAPI document at /openapi.json: each route's request schema, its responses and every error it can answer.

Routes read and validate their own bodies (to answer 400 with an OpenAI-style error, not FastAPI's 422), so FastAPI
cannot see the models; this module states them. The request schemas are the pydantic models themselves, with the
ranges, lengths, enums and required fields the server enforces. What a static schema cannot say (a prompt longer
than the context, a token id beyond the vocabulary, two fields that exclude each other) is a documented 400.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deepinfer.server.responses import (
    ChatCompletion, Completion, DetokenizeResponse, ErrorResponse, HealthResponse, ModelList, TokenizeResponse,
)

_ERRORS = {
    400: "invalid request: malformed JSON, a field out of its range, a prompt longer than the context, ...",
    401: "missing or unknown API key",
    404: "unknown model",
    405: "method not allowed on this route",
    413: "request body larger than --max-request-bytes",
    503: "overloaded (too many waiting requests), loading or shutting down; retry after Retry-After seconds",
}

# path -> (method, request model, 200 response model, streams, errors beyond 405, needs the API key)
_ROUTES: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel] | None, bool, tuple[int, ...], bool]] = {
    "/v1/completions": ("post", CompletionRequest, Completion, True, (400, 401, 404, 413, 503), True),
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletion, True, (400, 401, 404, 413, 503), True),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, False, (400, 401, 404, 413, 503), True),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, False, (400, 401, 404, 413, 503), True),
    "/v1/models": ("get", None, ModelList, False, (401,), True),
    "/health": ("get", None, HealthResponse, False, (503,), False),
    "/metrics": ("get", None, None, False, (), False),
}


# With stream: true: server-sent events (OpenAPI 3.1: the schema describes one event), each data a chunk object as
# JSON (or an error object), and the last one "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"},
                             "event": {"type": "string"}}}


def _bound_token_ids(node: Any, vocab_size: int | None) -> Any:
    """Every schema marked x-token-id gets the vocabulary's last id as its maximum."""
    if isinstance(node, list):
        return [_bound_token_ids(item, vocab_size) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _bound_token_ids(value, vocab_size) for key, value in node.items() if key != "x-token-id"}
    if node.get("x-token-id") and vocab_size is not None:
        out["maximum"] = vocab_size - 1
    return out


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(app: FastAPI, require_key: bool, vocab_size: int | None = None) -> dict[str, Any]:
    """vocab_size: the loaded model's, the bound of every token id (None while the model loads)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of deepinfer. Errors: {\"error\": {message, type, param, code}}.")
    requests = [(m, "validation") for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)]
    responses = [(m, "serialization") for m in (Completion, ChatCompletion, TokenizeResponse, DetokenizeResponse,
                                                 ModelList, HealthResponse, ErrorResponse)]
    _, defs = models_json_schema(requests + responses, ref_template="#/components/schemas/{model}")
    components = doc.setdefault("components", {})
    components["schemas"] = {**components.get("schemas", {}), **_bound_token_ids(defs.get("$defs", {}), vocab_size)}
    if require_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    retry_after = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
    for item in doc["paths"].values():  # routes FastAPI validates answer 400 in OpenAI's shape (api.py), not 422
        for op in item.values():
            if op.get("responses", {}).pop("422", None) is not None:
                op["responses"]["400"] = {"description": _ERRORS[400],
                                          "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    for path, (method, body, ok, streams, errors, keyed) in _ROUTES.items():
        op = doc["paths"].setdefault(path, {}).setdefault(method, {})
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
        if ok is None:
            success = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
        else:
            success = {"description": "OK", "content": {"application/json": {"schema": _ref(ok)}}}
            if streams:
                success["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
        op["responses"] = {"200": success}
        for status in (*errors, 405):
            op["responses"][str(status)] = {"description": _ERRORS[status],
                                            "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            if status == 503:
                op["responses"]["503"]["headers"] = retry_after
        if path == "/health":  # its 503 says loading or draining, in the health body
            op["responses"]["503"]["content"]["application/json"]["schema"] = _ref(HealthResponse)
        if require_key and keyed:
            op["security"] = [{"bearer": []}]
    return doc
