"""Real processes on loopback for the router tests: `deepinfer serve --data-parallel-size 2` on the tiny model
(tests/reliability/tiny.py: SmolLM2's tokenizer and chat template, a model that runs thousands of tokens a second),
which starts two pinned replicas and the router in front of them."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.reliability.tiny import make_tiny_model
from tests.server.conftest import ServerProcess, labelled_metrics, spawn_serve, terminate

# a context long enough for multi-turn prompts, a small cache: start-up stays fast
REPLICA_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "512")
STARTUP_TIMEOUT_S = 180


@dataclass
class Cluster(ServerProcess):
    def state(self) -> dict:
        return httpx.get(f"{self.url}/router/state", timeout=10).json()

    def replicas(self) -> list[dict]:
        return self.state()["pools"]["both"]["replicas"]

    def metrics(self) -> dict[tuple[str, tuple], float]:  # the router's, with their labels
        return labelled_metrics(self.url)

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the launcher exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if predicate():
                    return
            time.sleep(0.2)
        pytest.fail(f"not {what} after {timeout_s}s:\n{self.log()[-4000:]}")


@contextlib.contextmanager
def running_cluster(*extra: str) -> Iterator[Cluster]:
    cluster = spawn_serve([*REPLICA_ARGS, *extra], "deepinfer-dp-", Cluster, start_new_session=True)
    try:
        cluster.wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200
                           and all(r["health"] == "ok" for r in cluster.replicas()), STARTUP_TIMEOUT_S, "serving")
        yield cluster
    finally:
        terminate([cluster.process], 60, group=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[Cluster]:
    with running_cluster("--model", tiny_model, "--data-parallel-size", "2") as c:
        yield c
