"""Backpressure (503 + Retry-After) and the SIGTERM drain, on a server of their own."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import MODEL, running_server

pytestmark = pytest.mark.slow


def _data(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_backpressure_then_sigterm_drains_and_exits_zero():
    args = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--drain-timeout", "120")
    with running_server(*args) as server, httpx.Client(base_url=server.url, timeout=300) as http:
        # A runs long enough (300 tokens, ~1 s at batch 1 here) that B still waits behind it when C arrives
        running = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True, "stream": True,
                   "temperature": 0}
        with http.stream("POST", "/v1/completions", json=running) as a:
            a_lines = a.iter_lines()
            first = next(line for line in a_lines if line.startswith("data: "))  # A is running
            with http.stream("POST", "/v1/completions", json={**running, "max_tokens": 2}) as b:
                assert b.status_code == 200  # B is queued: the one waiting slot is taken
                refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "overloaded"

                server.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while http.get("/health").status_code != 503:
                    assert time.monotonic() < deadline, "health never turned 503 after SIGTERM"
                    time.sleep(0.05)
                late = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "draining"

                a_events = _data([first, *a_lines])
                b_events = _data(b.iter_lines())
        for events in (a_events, b_events):
            assert events[-1] == "[DONE]"
            finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c.get("choices")]
            assert finishes[-1] in ("length", "stop")  # ran to its end (not "abort") although SIGTERM came mid-way
        assert server.process.wait(timeout=120) == 0, server.log()[-3000:]
        assert "drained" in server.log()
