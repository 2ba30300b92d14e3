"""Shared by the reliability, fuzz and tenant tests: the tiny model (tests/reliability/tiny.py) and one server on it.

The shared server is batch-invariant (a greedy answer is the same bits whatever else runs, so a wrong answer is
exact to detect), takes two tenants' keys from a key file, runs up to 256 sequences at once and queues at most 200:
the soak's 200 streams are never refused (a step admits only max-num-batched-tokens of prompts, so arrivals do
wait), and a request for more sequences is a cheap 400, so every request the fuzzer gets accepted stays cheap.
"""
from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from tests.reliability.tiny import make_tiny_model

# A small context and cache: every request is cheap, so hundreds of them fit in seconds.
TINY_SERVER_ARGS = ("--max-model-len", "128", "--kv-cache-memory", "32MiB", "--num-threads", "1")
SHARED_SERVER_ARGS = (*TINY_SERVER_ARGS, "--batch-invariant", "--max-num-seqs", "256", "--max-waiting-requests", "200")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def tenant_keys() -> dict[str, str]:
    return {"acme": f"sk-acme-{secrets.token_urlsafe(18)}", "globex": f"sk-globex-{secrets.token_urlsafe(18)}"}


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tenant_keys, tmp_path_factory) -> Iterator:
    from tests.server.conftest import running_server

    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# tenant key\n" + "".join(f"{tenant} {key}  # {tenant}'s key\n"
                                                  for tenant, key in tenant_keys.items()))
    with running_server("--model", tiny_model, *SHARED_SERVER_ARGS, "--api-key-file", str(key_file)) as server:
        yield server


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def require_root_mounts() -> None:
    """Skips where tmpfs cannot be mounted (not root); under CI (CI=true) fails instead, so nothing hides there."""
    reason = None
    if os.geteuid() != 0:
        reason = "mounting a tmpfs needs root"
    elif subprocess.run(["mount", "--version"], capture_output=True).returncode != 0:
        reason = "no mount command"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI runs as root and must run this test", pytrace=False)
        pytest.skip(reason)
