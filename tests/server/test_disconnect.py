"""A client that goes away aborts its request: the KV blocks are freed at once, not after max_tokens."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess

pytestmark = pytest.mark.slow

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens: a visible share of the KV cache


def _abort_count(server: ServerProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:request_success"
               for s in f.samples if s.labels.get("finished_reason") == "abort" and s.name.endswith("_total"))


def _wait_idle(server: ServerProcess, timeout_s: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = server.metrics()
        idle = samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0
        if idle and samples["vllm:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_blocks(server, http):
    aborted = _abort_count(server)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 700, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)  # two tokens in: the request holds its blocks
        during = server.metrics()
        assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
    # leaving the block closed the connection mid-stream
    after = _wait_idle(server)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert _abort_count(server) == aborted + 1


def test_disconnect_before_first_token_frees_blocks(server, http):
    aborted = _abort_count(server)
    body = {"model": MODEL, "prompt": LONG_PROMPT + " again", "max_tokens": 700, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    after = _wait_idle(server)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert _abort_count(server) == aborted + 1
