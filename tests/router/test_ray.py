"""`deepinfer serve --ray`: a local Ray cluster of two node processes (ray.cluster_utils, one CPU each) on
loopback, the replicas placed one per node (STRICT_SPREAD fails rather than share a node), the router in front.

Where Ray is not installed or its cluster cannot start, the test is skipped with the reason; under CI (CI=true, where
`pip install -e .[test]` installs ray) it fails instead, so the Ray path never goes untested silently.
"""
from __future__ import annotations

import os

import httpx
import pytest

from tests.router.conftest import running_cluster


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI installs ray and must run this test", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def ray_cluster(monkeypatch):
    # every address stays on loopback: Ray would otherwise swap 127.0.0.1 for the machine's outward address
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    try:
        from ray.cluster_utils import Cluster
    except ImportError as e:
        _unavailable(f"ray is not installed ({e}); pip install 'ray>=2.9'")
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        cluster.wait_for_nodes()
    except Exception as e:  # noqa: BLE001 - whatever stops Ray from starting is the skip reason
        _unavailable(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_the_ray_path_places_replicas_on_two_nodes_and_serves(ray_cluster, tiny_model):
    with running_cluster("--model", tiny_model, "--ray", "--address", ray_cluster.address, "--data-parallel-size",
                         "2", "--ray-placement", "STRICT_SPREAD", "--ray-cpus-per-replica", "1") as served:
        replicas = served.replicas()
        assert len(replicas) == 2 and all(r["url"].startswith("http://127.0.0.1:") for r in replicas)
        assert "2 replicas on Ray" in served.log()
        with httpx.Client(base_url=served.url, timeout=60) as http:
            answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
            with http.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 4,
                                                              "stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2
