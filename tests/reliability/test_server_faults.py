"""Faults around a real server process: a client that reads its stream very slowly, clients that disconnect mid-way,
SIGTERM under load (drain, then exit 0), and kill -9 with the disk tier (the cache survives the restart and nothing
corrupt is served). Each asserts that no request is lost and none is answered wrong: batch-invariant greedy answers
equal the answer the same prompt gets alone."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.conftest import SHARED_SERVER_ARGS, auth
from tests.server.conftest import MODEL, ServerProcess, running_server

pytestmark = pytest.mark.slow

# the shared server's options (batch-invariant: a greedy answer is the same bits whatever else runs) without keys
ARGS = SHARED_SERVER_ARGS
MAX_TOKENS = 60


def prompt(i: int) -> str:
    """About 50 tokens: three full KV blocks to cache."""
    return f"Request number {i}: " + f"tell me a story about the sea, the wind and the number {i * 7}. " * 3


def complete(url: str, i: int, headers: dict | None = None, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(response: httpx.Response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def streamed_text(events: list[str]) -> tuple[str, str | None]:
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), finish[-1]


def counters(server: ServerProcess) -> dict[tuple, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def wait_idle(server: ServerProcess, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = server.metrics()
        idle = samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
        if idle and samples["vllm:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


@pytest.fixture(scope="module")
def key(tenant_keys) -> str:
    return tenant_keys["globex"]


@pytest.fixture(scope="module")
def alone(tiny_server, key) -> dict[int, str]:
    """Each prompt's answer when it runs alone."""
    return {i: complete(tiny_server.url, i, auth(key))["choices"][0]["text"] for i in range(24)}


def slow_read(url: str, key: str, i: int, pause: float) -> bytes:
    """A raw HTTP/1.1 client with a 4 KiB receive buffer that reads 512 bytes per `pause` seconds; logprobs make
    the stream (~40 KB) larger than the socket buffers, so the server's writes really wait on this reader."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
                       "stream": True, "logprobs": 5}).encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while chunk := s.recv(512):
            received += chunk
            time.sleep(pause)
    return received


def test_a_very_slow_reader_gets_its_whole_answer_and_holds_nobody_up(tiny_server, key, alone):
    result: dict[str, bytes] = {}
    started = time.monotonic()
    reader = threading.Thread(target=lambda: result.setdefault("raw", slow_read(tiny_server.url, key, 0, 0.04)))
    reader.start()
    with ThreadPoolExecutor(8) as pool:
        fast = list(pool.map(lambda i: complete(tiny_server.url, i, auth(key))["choices"][0]["text"], range(1, 9)))
    fast_seconds = time.monotonic() - started
    assert fast == [alone[i] for i in range(1, 9)]
    reader.join(timeout=120)
    slow_seconds = time.monotonic() - started
    assert slow_seconds > fast_seconds, "the reader was not slower than the others: nothing was tested"
    head, _, payload = result["raw"].partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    events = [line[6:] for line in _dechunk(payload).decode().splitlines() if line.startswith("data: ")]
    assert streamed_text(events) == (alone[0], "length")
    print(f"\nslow reader: {slow_seconds:.1f} s to read its stream; 8 other requests finished in {fast_seconds:.1f} s")


def _dechunk(payload: bytes) -> bytes:
    """The body of a Transfer-Encoding: chunked response."""
    out, rest = b"", payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def test_clients_that_disconnect_mid_stream_lose_nobody_else_anything(tiny_server, key, alone):
    def one(i: int) -> tuple[int, str, str | None] | None:
        body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, headers=auth(key),
                          timeout=120) as response:
            if i % 2:  # leaves after a few events
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                for _ in range(1 + i % 5):
                    next(lines)
                return None
            return (i, *streamed_text(stream_events(response)))

    with ThreadPoolExecutor(24) as pool:
        finished = [r for r in pool.map(one, range(24)) if r is not None]
    assert [(i, text, reason) for i, text, reason in finished] == [(i, alone[i], "length") for i in range(0, 24, 2)]
    samples = wait_idle(tiny_server)
    assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_requests_running"] == 0, samples


def test_sigterm_under_load_drains_every_request_then_exits_zero(tiny_model):
    with running_server("--model", tiny_model, *ARGS, "--drain-timeout", "120") as server:
        reference = {i: complete(server.url, i)["choices"][0]["text"] for i in range(12)}
        results, started = {}, threading.Barrier(13)

        def one(i: int) -> None:
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait()
                results[i] = streamed_text([first[6:], *(line[6:] for line in lines if line.startswith("data: "))])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # every stream has its first token
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        late = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining" and late.headers["retry-after"]
        for t in threads:
            t.join(timeout=120)
        assert results == {i: (reference[i], "length") for i in range(12)}  # all 12 ran to the end, none aborted
        assert server.process.wait(timeout=60) == 0, server.log()[-3000:]
        assert "drained" in server.log()


def test_kill_9_with_the_disk_tier_restarts_warm_and_serves_nothing_corrupt(tiny_model, tmp_path):
    store = ("--kv-store", "disk", "--kv-store-path", str(tmp_path / "kv"))
    with running_server("--model", tiny_model, *ARGS, *store) as first:
        before = {i: complete(first.url, i)["choices"][0]["text"] for i in range(8)}
        deadline = time.monotonic() + 30  # the background saver writes the finished blocks
        while not list((tmp_path / "kv").rglob("*.kvb")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        burst = ThreadPoolExecutor(8)
        for i in range(8, 16):  # in flight, and saving, when the process dies
            burst.submit(lambda i=i: httpx.post(f"{first.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0}))
        time.sleep(0.5)
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait(timeout=30) == -signal.SIGKILL
        burst.shutdown(wait=True)
    blocks = sorted((tmp_path / "kv").rglob("*.kvb"))
    assert len(blocks) >= 8
    # what a crash without fsync can leave: a torn file and a flipped bit
    blocks[0].write_bytes(blocks[0].read_bytes()[: blocks[0].stat().st_size // 2])
    data = bytearray(blocks[1].read_bytes())
    data[-10] ^= 0xFF
    blocks[1].write_bytes(bytes(data))
    with running_server("--model", tiny_model, *ARGS, *store) as second:
        after = {i: complete(second.url, i) for i in range(8)}
        assert {i: out["choices"][0]["text"] for i, out in after.items()} == before
        cached = sum(out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in after.values())
        assert cached > 0  # the disk tier survived kill -9
        errors = counters(second)
        corrupt = sum(v for k, v in errors.items() if k[0] == "deepinfer:kv_store_errors_total" and ("kind", "corrupt") in k)
        assert corrupt >= 1  # the damaged files were caught by their checksum (at scan or load), not served
        print(f"\nkill -9: restarted warm ({cached} prompt tokens from disk), {corrupt:.0f} damaged block(s) refused")
