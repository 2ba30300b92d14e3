"""`deepinfer serve --data-parallel-size N` on one machine: N replica processes and the router in front of them.

Each replica is a `deepinfer serve` process on a free loopback port, with the engine options given. When the
machine has at least N usable cores, replica i is pinned to its own block of len(cores) // N cores
(os.sched_setaffinity) and runs that many torch threads, so replicas never compete for a core; the router, light,
stays unpinned. With fewer cores than replicas nothing is pinned and each replica runs one thread: they time-share.
On a 2-core machine N=2 gives one core and one thread to each replica. With --device cuda, replica i sees GPU
i mod (visible GPUs). A replica that fails (exits other than 0, or is killed) is started again on its port (after 1 s,
doubling to 30 s while it keeps failing); the router routes around it meanwhile. SIGINT / SIGTERM stops the
router, then drains the replicas.

    python -m deepinfer.router.launch    # a replica process: reads (args, cores) pickled on stdin
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

logger = logging.getLogger("deepinfer.router")

MAX_BACKOFF_S = 30.0


def plan_cores(cores: list[int], n: int) -> list[list[int]] | None:
    """Disjoint, equal blocks of cores, one per replica (the remainder left to the router); None if there are
    fewer cores than replicas."""
    if n < 1:
        raise ValueError(f"the number of replicas must be >= 1, got {n}")
    if len(cores) < n:
        return None
    per = len(cores) // n
    return [cores[i * per:(i + 1) * per] for i in range(n)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_args(args: argparse.Namespace, host: str, port: int, threads: int | None) -> argparse.Namespace:
    """The serve options of one replica: the user's engine and server options on its own address."""
    out = argparse.Namespace(**vars(args))
    out.host, out.port = host, port
    out.data_parallel_size, out.ray = 1, False
    if out.num_threads is None and threads is not None:
        out.num_threads = threads
    return out


def start_replica(args: argparse.Namespace, cores: list[int] | None, env: dict[str, str] | None = None,
                  log_file: int | None = None) -> subprocess.Popen:
    """A replica process (this module's main) serving `args`, pinned to `cores` if given."""
    payload = pickle.dumps((argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"}), cores))
    process = subprocess.Popen([sys.executable, "-m", "deepinfer.router.launch"], stdin=subprocess.PIPE,
                               env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
    process.stdin.write(payload)
    process.stdin.close()
    return process


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM (each replica drains), then SIGKILL what is still running after timeout_s."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class LocalReplica:
    args: argparse.Namespace
    cores: list[int] | None
    env: dict[str, str] | None
    process: subprocess.Popen | None = None
    restarts: int = 0
    backoff_s: float = 1.0
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def start(self) -> None:
        self.process = start_replica(self.args, self.cores, self.env)
        self.started = time.monotonic()


def local_replicas(args: argparse.Namespace) -> list[LocalReplica]:
    n = args.data_parallel_size
    cores = sorted(os.sched_getaffinity(0))
    blocks = plan_cores(cores, n)
    if blocks is None:
        logger.warning("%d replicas on %d cores: not pinned, one thread each; they time-share the cores", n,
                       len(cores))
    else:
        logger.info("%d replicas pinned to cores %s, %d thread(s) each", n, blocks, len(blocks[0]))
    gpus = _visible_gpus(args)
    replicas = []
    for i in range(n):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpus[i % len(gpus)])) if gpus else None
        replica = replica_args(args, "127.0.0.1", free_port(), len(blocks[i]) if blocks else 1)
        replicas.append(LocalReplica(replica, blocks[i] if blocks else None, env))
    return replicas


def _visible_gpus(args: argparse.Namespace) -> list[int]:
    if not str(args.device).startswith("cuda"):
        return []
    import torch

    return list(range(torch.cuda.device_count()))


async def supervise(replicas: list[LocalReplica]) -> None:
    """Starts every replica that is not running, again and again, backing off while one keeps failing."""
    while True:
        for r in replicas:
            code = r.process.poll() if r.process else None
            if code is None or code == 0:  # running, or drained on request (exit 0): not restarted
                continue
            if time.monotonic() - r.started > 60:
                r.backoff_s = 1.0  # it had been up a while: not a crash loop
            logger.warning("replica %s exited with %s; restarting in %.0fs", r.url, code, r.backoff_s)
            await asyncio.sleep(r.backoff_s)
            r.backoff_s = min(MAX_BACKOFF_S, r.backoff_s * 2)
            r.restarts += 1
            r.start()
        await asyncio.sleep(0.5)


def run_data_parallel(args: argparse.Namespace) -> int:
    from deepinfer.router.serve import router_config, serve_router

    replicas = local_replicas(args)
    for r in replicas:
        r.start()
    config = router_config(router_options(args), [r.url for r in replicas])
    try:
        asyncio.run(serve_router(config, args.host, args.port, args.uvicorn_log_level, lambda _: supervise(replicas)))
    finally:
        stop_processes([r.process for r in replicas if r.process], args.drain_timeout + 10)
    return 0


def router_options(args: argparse.Namespace) -> argparse.Namespace:
    """serve's options as the router reads them: the same model and keys as the replicas."""
    out = argparse.Namespace(**vars(args))
    out.replica = []
    return out


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (the launcher, a Ray actor) dies, so replicas never outlive it."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main() -> int:
    args, cores = pickle.load(sys.stdin.buffer)
    _die_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [replica :{args.port}]: %(message)s")
    from deepinfer.server.serve import run_server

    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
