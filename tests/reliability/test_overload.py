"""The waiting queue is bounded by default: past the KV cache's block count (at least --max-num-seqs), a request is
answered 503 with Retry-After and costs the server nothing; what was accepted still completes, and the same request
succeeds once the queue drains. A request for more sequences than the queue could ever hold is a 400."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from deepinfer.engine.client import default_max_waiting
from tests.reliability.conftest import TINY_SERVER_ARGS
from tests.server.conftest import MODEL, running_server

pytestmark = pytest.mark.slow


def test_default_bound_is_the_kv_block_count_and_at_least_a_batch():
    assert default_max_waiting(num_blocks=4096, max_num_seqs=128) == 4096
    assert default_max_waiting(num_blocks=40, max_num_seqs=128) == 128


def test_overload_is_a_503_with_retry_after_and_loses_nothing(tiny_model):
    # 256 KiB of KV on the tiny model is 32 blocks: the default queue bound; one sequence runs at a time
    # the blocker decodes 480 tokens (the whole KV cache), so it still holds the slot while the test fills the queue
    args = (*TINY_SERVER_ARGS, "--kv-cache-memory", "256KiB", "--max-num-seqs", "1", "--max-model-len", "500")
    with running_server("--model", tiny_model, *args) as server:
        bound = int(re.search(r"at most (\d+) waiting sequences", server.log()).group(1))
        assert bound == 32
        url = f"{server.url}/v1/completions"
        results: dict = {}

        def queue_31() -> None:  # 31 sequences wait behind the running one
            response = httpx.post(url, json={"model": MODEL, "prompt": [f"prompt {i}" for i in range(31)],
                                             "max_tokens": 2}, timeout=300)
            results["queued"] = (response.status_code, sorted(c["index"] for c in response.json()["choices"]))

        blocker_body = {"model": MODEL, "prompt": "hold the only slot", "max_tokens": 480, "ignore_eos": True,
                        "stream": True}
        with httpx.stream("POST", url, json=blocker_body, timeout=300) as blocker:
            events = blocker.iter_lines()
            first = next(line for line in events if line.startswith("data: "))  # it runs: the slot is taken
            queued = threading.Thread(target=queue_31)
            queued.start()
            deadline = time.monotonic() + 60
            while server.metrics()["vllm:num_requests_waiting"] < 31:
                assert queued.is_alive() and time.monotonic() < deadline
                time.sleep(0.02)
            refused = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}, timeout=60)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "overloaded" and int(refused.headers["retry-after"]) >= 1
            too_big = httpx.post(url, json={"model": MODEL, "prompt": "x", "n": 33, "max_tokens": 1}, timeout=60)
            assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n", too_big.text
            rest = [first, *(line for line in events if line.startswith("data: "))]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]  # the blocker ran to its end
        queued.join(timeout=300)
        assert results["queued"] == (200, list(range(31)))  # every accepted sequence finished
        retried = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}, timeout=60)
        assert retried.status_code == 200 and len(retried.json()["choices"]) == 2
