"""A real `deepinfer serve` process on a free 127.0.0.1 port, shared by the server tests."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key"
MODEL = "test-model"
# Small KV cache and context: start-up stays fast, and "prompt too long" is cheap to provoke.
ENGINE_ARGS = ["--kv-cache-memory", "96MiB", "--max-model-len", "1024", "--max-num-batched-tokens", "1024"]
STARTUP_TIMEOUT_S = 300


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Samples of vllm:* metrics, keyed by name (labels dropped: one model per server)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if not s.labels.get("finished_reason") and not s.name.endswith(("_bucket",))}


def labelled_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by (name, sorted label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*extra_args: str) -> Iterator[ServerProcess]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="deepinfer-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, *ENGINE_ARGS, *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log.name)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def _wait_healthy(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode} during start-up:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    with running_server("--api-key", API_KEY) as s:
        yield s


@pytest.fixture
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180) as c:
        yield c


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=180) as c:
        yield c
