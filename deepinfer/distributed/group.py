"""Process groups for expert parallelism, as objects passed to whoever communicates: no torch.distributed default
group, so nothing global ties two engines in one host together.

The engine hosts the rendezvous store (`host_store`, a free port unless one is configured); each rank joins it
(`join_group`) and gets a gloo (CPU) or NCCL (CUDA) process group whose collectives fail after `timeout_s`.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def host_store(addr: str, port: int | None, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, served from this process; port None binds a free one (read it from `.port`)."""
    try:
        return dist.TCPStore(addr, port or 0, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # torch raises DistNetworkError (a RuntimeError) for a taken port
        raise ValueError(f"cannot serve the expert-parallel rendezvous on {addr}:{port or 'a free port'}: {e}") from e


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_group(addr: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """This rank's process group over the store at addr:port. Call from every rank; returns once all have joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
