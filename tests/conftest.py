"""Fixtures every test directory shares: a throwaway redis-server on a free loopback port; the compiled ops' lower
builds started in the background when tests/ops runs."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


class RedisServer:
    """One redis-server process without persistence; stop() and start() keep the same port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


PREBUILD = pytest.StashKey[subprocess.Popen]()
PREBUILD_SCRIPT = """
from deepinfer.ops import cpu_ops
for isa in cpu_ops.lower_builds(cpu_ops.cpu_isa_flags()):
    cpu_ops.load(isa)
"""


def pytest_collection_finish(session: pytest.Session) -> None:
    """tests/ops compares every lower build of the compiled ops (portable, AVX2, AVX2 with AVX-VNNI) with the native
    one; each is a ~1-2 minute compile on 2 cores. They start here, in one process at the lowest priority, and
    compile while the tests before them wait on servers, sockets and subprocesses (the suite keeps the 2 cores ~55%
    busy), rather than in front of the tests that load them; a test that gets there first waits on torch's build
    lock for the build in progress. Nothing else changes: the tests load the same builds, and a failed background
    build fails nothing by itself (the test's own load reports it)."""
    if not any(item.nodeid.startswith("tests/ops/") for item in session.items):
        return
    session.stash[PREBUILD] = subprocess.Popen(
        [sys.executable, "-c", PREBUILD_SCRIPT], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The background build ends before the session: stopping it mid-compile would leave torch's lock file behind,
    and the next session's load would wait on it."""
    proc = session.stash.get(PREBUILD, None)
    if proc is not None:
        proc.wait()
