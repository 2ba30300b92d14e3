"""Every bad input gets its status code and an OpenAI-shaped error, and the server keeps serving."""
from __future__ import annotations

import json
import time

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
    ("/v1/completions", {**COMPLETION, "logit_bias": {"49152": 5}}, 400, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {**COMPLETION, "logit_bias": {"12": 101}}, 400, "logit_bias.12"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"a token": 1}}, 400, "logit_bias.a token"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "bad_words": ["  "]}, 400, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [49152]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [2], "min_tokens": 1}, 400, "allowed_token_ids"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
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


# ---- the bad-input corpus: each input its precise 4xx, while a stream running beside them is served intact --------

def _raw(body: str | bytes) -> bytes:
    return body.encode() if isinstance(body, str) else body


CORPUS = [
    # (id, path, raw body, status, param named in the error, or None)
    ("truncated JSON", "/v1/completions", '{"model": "test-model", "prompt": "x",', 400, None),
    ("trailing garbage", "/v1/completions", '{"prompt": "x"} trailing', 400, None),
    ("empty body", "/v1/completions", "", 400, None),
    ("JSON null body", "/v1/chat/completions", "null", 400, None),
    ("prompt is a number", "/v1/completions", '{"prompt": 5}', 400, "prompt"),
    ("messages is a string", "/v1/chat/completions", '{"messages": "hi"}', 400, "messages"),
    ("max_tokens as a string", "/v1/completions", '{"prompt": "x", "max_tokens": "10"}', 400, "max_tokens"),
    ("stream as a string", "/v1/completions", '{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("fractional n", "/v1/completions", '{"prompt": "x", "n": 1.5}', 400, "n"),
    ("huge max_tokens", "/v1/completions", '{"prompt": "x", "max_tokens": 1000000000000000000000000000000}', 400,
     "max_tokens"),
    ("seed beyond int64", "/v1/completions", '{"prompt": "x", "seed": 18446744073709551616}', 400, "seed"),
    ("huge top_k", "/v1/completions", '{"prompt": "x", "top_k": 100000000000000000000}', 400, "top_k"),
    ("temperature overflows to inf", "/v1/completions", '{"prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("negative max_tokens", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
     400, "max_tokens"),
    ("negative n", "/v1/completions", '{"prompt": "x", "n": -3}', 400, "n"),
    ("negative logprobs", "/v1/completions", '{"prompt": "x", "logprobs": -1}', 400, "logprobs"),
    ("negative presence_penalty", "/v1/completions", '{"prompt": "x", "presence_penalty": -3}', 400, "presence_penalty"),
    ("negative token id", "/v1/completions", '{"prompt": [1, -5]}', 400, "prompt.1"),
    ("NaN temperature", "/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("Infinity top_p", "/v1/completions", '{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("-Infinity repetition_penalty", "/v1/completions", '{"prompt": "x", "repetition_penalty": -Infinity}', 400,
     "repetition_penalty"),
    ("NaN token id", "/detokenize", '{"tokens": [NaN]}', 400, "tokens.0"),
    ("lone surrogate", "/v1/completions", '{"prompt": "a\\ud800b"}', 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400, None),
    ("overlong UTF-8", "/v1/completions", b'{"prompt": "\xc0\xaf"}', 400, None),
    ("no messages", "/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("content parts empty", "/v1/chat/completions", '{"messages": [{"role": "user", "content": []}]}', 400,
     "messages.0.content"),
    ("message without content", "/v1/chat/completions", '{"messages": [{"role": "user"}]}', 400, "messages.0.content"),
    ("empty token list prompt", "/v1/completions", '{"prompt": [[]]}', 400, "prompt.0"),
    ("n beyond 128", "/v1/completions", '{"prompt": "x", "n": 129}', 400, "n"),
    ("chat n beyond 128", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "n": 129}', 400,
     "n"),
    ("logprobs beyond 20", "/v1/completions", '{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    ("top_logprobs beyond 20", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', 400, "top_logprobs"),
    ("5000 stop strings", "/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * 5000}), 400, "stop"),
    ("a 2000-character stop string", "/v1/completions", json.dumps({"prompt": "x", "stop": ["a" * 2000]}), 400,
     "stop.0"),
    ("4 prompts x n=100 beyond the waiting limit (266 blocks of bfloat16 KV in 96 MiB)", "/v1/completions",
     json.dumps({"prompt": ["x", "y", "z", "w"], "n": 100, "max_tokens": 1}), 400, "n"),
    ("token id beyond the vocabulary", "/detokenize", '{"tokens": [49152]}', 400, "tokens"),
    ("temperature beyond 1e6", "/v1/completions", '{"prompt": "x", "temperature": 1e308}', 400, "temperature"),
    ("repetition_penalty below 0.01", "/v1/completions", '{"prompt": "x", "repetition_penalty": 1e-300}', 400,
     "repetition_penalty"),
    ("logprobs with a grammar", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "structured_outputs": {"choice": ["a"]}}),
     400, "logprobs"),
]


@pytest.fixture
def max_model_len(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]


def test_bad_input_corpus_each_a_precise_4xx_while_a_stream_beside_them_is_served_intact(http, server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    reference = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    results: list = []
    with httpx.Client(base_url=server.url, headers=http.headers, timeout=180) as other:
        with other.stream("POST", "/v1/completions", json={**body, "stream": True}) as beside:
            lines = beside.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for name, path, raw, status, param in CORPUS:
                response = http.post(path, content=_raw(raw), headers={"content-type": "application/json"})
                results.append((name, response, status, param))
            rest = [first, *lines]
    for name, response, status, param in results:
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (name, error)
        if param is not None:
            assert error["param"] == param, (name, error)
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == reference


def test_unicode_edge_cases_are_served(http):
    for text in ("emoji 👩‍👩‍👧‍👦 and 🏳️‍🌈", "RTL שלום עולם and مرحبا", "zero\u200bwidth\u200djoiner", "e\u0301\u0301",
                 "NUL \u0000 inside", "\ufeffBOM first", "ｆｕｌｌｗｉｄｔｈ", "\U0010ffff last plane"):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2})
        assert response.status_code == 200, (text, response.text)
        assert response.json()["usage"]["completion_tokens"] == 2
    chat = {"model": MODEL, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
            "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200  # empty contents are valid


def test_prompts_at_and_past_the_context(http, max_model_len):
    def complete(prompt, max_tokens: int) -> httpx.Response:
        return http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                    "ignore_eos": True})  # sampled: EOS would end it with "stop"

    fits = complete([198] * (max_model_len - 2), 2)  # the prompt and exactly two generated tokens
    assert fits.status_code == 200, fits.text
    choice = fits.json()["choices"][0]
    assert fits.json()["usage"]["completion_tokens"] == 2 and choice["finish_reason"] == "length"
    for length in (max_model_len, max_model_len + 1):
        refused = complete([198] * length, 16)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
        assert str(max_model_len) in refused.json()["error"]["message"]
    # as vLLM and OpenAI answer: the prompt fits, but not with max_tokens after it (text prompts counted too)
    text = " the" * (max_model_len - 10)
    count = http.post("/tokenize", json={"prompt": text}).json()["count"]
    for prompt, n in (([198] * (max_model_len - 2), max_model_len - 2), (text, count)):
        refused = complete(prompt, 16)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "max_tokens", refused.text
        assert f"context is {max_model_len} tokens and the prompt has {n}" in error["message"]
    # vLLM's truncate_prompt_tokens: the prompt's last tokens only, counted as such
    cut = http.post("/v1/completions", json={"model": MODEL, "prompt": [198] * (max_model_len + 5), "max_tokens": 16,
                                              "truncate_prompt_tokens": max_model_len - 16, "ignore_eos": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == max_model_len - 16, cut.text


def test_oversized_bodies_get_413_whether_declared_or_chunked(http):
    big = json.dumps({"model": MODEL, "prompt": "x" * (17 << 20)}).encode()
    declared = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large", declared.text

    def chunks():
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    chunked = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "16777216" in chunked.json()["error"]["message"], chunked.text


def test_wrong_method_is_405_with_allow(http):
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST" and "error" in response.json()


def test_nothing_left_running_after_the_corpus(server):
    deadline = time.monotonic() + 30
    while True:
        samples = server.metrics()
        idle = samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
        if idle and samples["vllm:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and samples["vllm:kv_cache_usage_perc"] == 0, samples
