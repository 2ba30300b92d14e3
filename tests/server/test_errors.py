"""Every bad input gets its status code and an OpenAI-shaped error, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}

CASES = [
    # (path, body, status, param named in the error, or None)
    ("/v1/completions", {**COMPLETION, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1] * 1100}, 400, "prompt"),  # longer than max_model_len
    ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("/v1/chat/completions", {**CHAT, "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
def test_bad_request_gets_status_and_error_body(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_malformed_json_and_non_object_bodies(http):
    for raw in (b"{not json", b"[1, 2]"):
        response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()


def test_api_key_is_required_on_v1_but_not_on_health_or_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_route_is_an_openai_error(http):
    response = http.get("/v1/engines")
    assert response.status_code == 404 and "error" in response.json()


def test_still_serving_after_errors(http):
    response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200
