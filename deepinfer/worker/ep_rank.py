"""One expert-parallel rank: a worker process that runs the whole model on every step's plan while holding only the
routed experts of its slots (distributed/expert_parallel.py). worker/ep_executor.py starts and drives it.

Requests over the pipe, each answered ("ok", payload) or ("error", (exception type, message, traceback)):
  ("init", num_blocks, layout)   allocate the KV cache (every rank holds the whole cache: attention is replicated)
  ("step", plan)                 run it; rank 0 answers (StepResult, exchange bytes), the others (sampled, bytes)
  ("place", layer, row)          move one MoE layer's expert weights to its new slot -> expert row
  ("stop",)                      leave
Before any request, a rank answers once on its own: ("ok", RankInfo) when its model is built and sharded.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from deepinfer.config import Compute, EngineConfig
from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.distributed.eplb import Placement, balanced_placement
from deepinfer.distributed.expert_parallel import ShardedExperts, shard_experts
from deepinfer.distributed.group import join_group
from deepinfer.layers.moe import MoEStep, moe_step
from deepinfer.models.loader import ModelFiles
from deepinfer.worker.executor import InProcessExecutor


@dataclass(frozen=True)
class RankArgs:
    rank: int
    config: EngineConfig
    files: ModelFiles
    max_model_len: int
    compute: Compute
    store_port: int
    backend: str


@dataclass(frozen=True)
class RankInfo:
    kv_specs: list[KVCacheSpec]
    placement: Placement  # the first one, the same on every rank


def first_placement(num_layers: int, num_experts: int, num_slots: int, num_ranks: int) -> Placement:
    """Before any load is measured: the balanced policy on equal loads (extra slots replicate the lowest experts)."""
    return balanced_placement(np.ones((num_layers, num_experts)), num_slots, num_ranks)


def rank_main(args: RankArgs, conn: Connection) -> None:
    """The rank process: build, shard, then answer requests until "stop" or until the engine's end of the pipe
    closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the engine stops us
    pc = args.config.parallel
    world = pc.expert_parallel_size
    torch.set_num_threads(args.config.num_threads or max(1, (os.cpu_count() or 1) // world))
    try:
        compute = args.compute
        if compute.device.startswith("cuda"):  # one GPU per rank
            compute = dataclasses.replace(compute, device=f"cuda:{args.rank}")
            torch.cuda.set_device(args.rank)
        group = join_group(pc.master_addr, args.store_port, args.rank, world, args.backend, pc.dist_timeout_s)
        worker = InProcessExecutor(args.config, args.files, args.max_model_len, compute)
        model = worker.model
        if not callable(getattr(model, "moe_layers", None)) or not model.moe_layers():
            raise ValueError(f"expert_parallel_size > 1 needs a MoE model; {type(model).__name__} has no MoE layers")
        first = model.moe_layers()[0].experts
        num_slots = first.num_experts + pc.num_redundant_experts
        if num_slots % world:
            raise ValueError(f"{first.num_experts} experts + num_redundant_experts={pc.num_redundant_experts} = "
                             f"{num_slots} slots, not divisible by expert_parallel_size={world}")
        placement = first_placement(len(model.moe_layers()), first.num_experts, num_slots, world)
        del first  # the full expert weights go once sharded
        shards = shard_experts(model, placement, args.rank, group)
        conn.send(("ok", RankInfo(worker.kv_cache_specs(), placement)))
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it and stops every rank
        conn.send(("error", _error(e)))
        _wait_for_stop(conn)  # exiting now would read as a crash, not as this error
        return
    with torch.inference_mode():
        _serve(args.rank, worker, shards, conn)


def _serve(rank: int, worker: InProcessExecutor, shards: list[ShardedExperts], conn: Connection) -> None:
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            return
        kind = request[0]
        if kind == "stop":
            return
        try:
            payload: Any = None
            if kind == "init":
                worker.initialize_cache(request[1], request[2], None)
            elif kind == "step":
                with moe_step(MoEStep()) as moe:  # the runner itself, as InProcessExecutor.execute would run it
                    result = worker.runner.execute(request[1])
                result.expert_counts = moe.counts()
                result.expert_rank_loads = [moe.rank_loads[i] for i in sorted(moe.rank_loads)] or None
                payload = (result if rank == 0 else result.sampled, moe.exchange_bytes)
            elif kind == "place":
                payload = shards[request[1]].reassign(request[2])
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", payload))
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            try:
                conn.send(("error", _error(e)))
            except OSError:
                return


def _wait_for_stop(conn: Connection) -> None:
    try:
        while conn.recv()[0] != "stop":
            pass
    except (EOFError, OSError):
        pass


def _error(e: Exception) -> tuple[str, str, str]:
    return type(e).__name__, str(e), traceback.format_exc()
