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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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


def spawn_serve(args: Sequence[str], log_prefix: str = "deepinfer-serve-", cls: type = ServerProcess,
                **popen: Any) -> ServerProcess:
    """Starts `deepinfer serve` on a free loopback port with these arguments, its output in a log file."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix=log_prefix, suffix=".log", delete=False) as log:
        cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"), **popen)
    return cls(f"http://127.0.0.1:{port}", process, log.name)


def wait_healthy(server: ServerProcess, deadline: float) -> None:
    """Until /health answers 200; fails with the log's tail if the process exits or the deadline passes."""
    while True:
        if server.process.poll() is not None:
            pytest.fail(f"{server.url} exited with {server.process.returncode} during start-up:\n{server.log()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            pytest.fail(f"{server.url} not healthy in time:\n{server.log()[-4000:]}")
        time.sleep(0.2)


def terminate(processes: Sequence[subprocess.Popen], timeout_s: float, group: bool = False) -> None:
    """SIGTERM to every live process (each drains), then waits; whatever outlives timeout_s is killed (its whole
    process group with `group`)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL) if group else process.kill()
            process.wait()


@contextlib.contextmanager
def running_server(*extra_args: str) -> Iterator[ServerProcess]:
    server = spawn_serve(["--served-model-name", MODEL, *ENGINE_ARGS, *extra_args])
    try:
        wait_healthy(server, time.monotonic() + STARTUP_TIMEOUT_S)
        yield server
    finally:
        terminate([server.process], 60)


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
