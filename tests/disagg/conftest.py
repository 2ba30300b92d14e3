"""Real processes on loopback for the disaggregation tests: `deepinfer serve --role ...` replicas on the tiny model
(tests/reliability/tiny.py), started together, and routers run in this process (one uvicorn thread each)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from deepinfer.router.config import PoolConfig, RouterConfig
from deepinfer.router.proxy import build_router_app
from deepinfer.router.router import Router
from tests.reliability.tiny import make_tiny_model
from tests.server.conftest import ServerProcess, free_port, labelled_metrics, spawn_serve, terminate, wait_healthy

# small and fast to start; batch invariance on, so seeded sampling gives the same bits on every deployment
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--max-num-batched-tokens", "512",
               "--batch-invariant", "--num-threads", "1")
STARTUP_TIMEOUT_S = 180


@dataclass
class Replica(ServerProcess):
    def metrics(self) -> dict[tuple[str, tuple], float]:  # with their labels
        return labelled_metrics(self.url)

    def handoffs(self, outcome: str) -> float:
        return sum(v for (name, labels), v in self.metrics().items()
                   if name == "deepinfer:kv_handoffs_total" and ("outcome", outcome) in labels)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def replicas(model: str, *roles: tuple[str, ...]) -> Iterator[list[Replica]]:
    """One serve process per entry of `roles` (extra options each), started together; yields once all are healthy."""
    started: list[Replica] = []
    try:
        for extra in roles:
            started.append(spawn_serve(["--model", model, *ENGINE_ARGS, *extra], "deepinfer-pd-", Replica))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for replica in started:
            wait_healthy(replica, deadline)
        yield started
    finally:
        terminate([replica.process for replica in started], 30)


class RouterThread:
    """A router (router/proxy.py) on its own event loop in a thread of this process."""

    def __init__(self, pools: dict[str, list[str]], policy: str = "round_robin", model: str | None = None) -> None:
        config = RouterConfig(pools=tuple(PoolConfig(role, tuple(urls), policy) for role, urls in pools.items()),
                              model=model, poll_interval_s=0.1, probe_timeout_s=1.0)
        self.router = Router(config)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(build_router_app(self.router), host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> RouterThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"the router at {self.url} did not become healthy: {self.router.summary()}")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))
