"""Expert parallelism behind the executor seam: N rank processes (worker/ep_rank.py) joined by torch.distributed.

All ranks are subprocesses; the engine process holds no model and no process group, only the rendezvous store,
one pipe per rank and the EPLB bookkeeping. Every step's plan is sent to every rank; every rank runs the whole
model on all of the step's tokens (attention, dense layers, shared experts and the LM head replicated), and only the
routed experts are sharded (distributed/expert_parallel.py); rank 0's StepResult is the step's result. Subprocesses
rather than rank 0 in the engine: the engine never blocks inside a collective, so it can watch every rank the same
way (a dead rank, an error or a timeout is an exception naming the rank, within about a second of a death), and
the scheduler's process stays free of the model's threads and memory.

Load balancing: every `eplb_interval` steps a new placement is computed from the moving average of the expert counts
(distributed/eplb.py) and, when it differs, the ranks move expert weights one MoE layer per step boundary (no request
is dropped; a step waits at most for one layer's weights). moe_lb is measured from the per-rank loads the ranks
report (`load_stats`).
"""
from __future__ import annotations

import collections
import multiprocessing
import pickle
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from deepinfer.config import Compute, EngineConfig
from deepinfer.core.kv_layout import KVCacheSpec, KVLayout
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.distributed.eplb import ExpertLoadTracker, Placement, TrackerConfig, balanced_placement, moe_lb
from deepinfer.distributed.group import default_backend, host_store
from deepinfer.models.loader import ModelFiles
from deepinfer.worker.ep_rank import RankArgs, RankInfo, rank_main
from deepinfer.worker.executor import Executor, InProcessExecutor

if TYPE_CHECKING:
    from deepinfer.kvstore.connector import KVStoreConnector

_GRACE_S = 2.0  # after a rank reports an error: how long the others may still answer, or be found dead


@dataclass(frozen=True)
class MoELoadStats:
    """Expert-parallel load balance (EngineStats.moe_load), measured over the last `window_steps` steps."""

    moe_lb: float  # mean over MoE layers of: busiest rank's (token, expert) rows / mean rows per rank; 1.0 balanced
    moe_lb_worst: float  # the worst layer's value
    window_steps: int
    rebalances: int  # placement changes started since start-up
    experts_moved: int  # expert copies sent between ranks by them
    longest_move_s: float  # the longest pause between two steps of the last one (it moves one layer per pause)
    exchange_bytes_per_step: float  # combine all_gather: bytes one rank received per step, mean over the window


def make_executor(config: EngineConfig, files: ModelFiles, max_model_len: int, compute: Compute) -> Executor:
    if config.parallel.expert_parallel_size > 1:
        return EPExecutor(config, files, max_model_len, compute)
    return InProcessExecutor(config, files, max_model_len, compute)


class EPExecutor(Executor):
    """`expert_parallel_size` rank processes; see the module docstring."""

    def __init__(self, config: EngineConfig, files: ModelFiles, max_model_len: int, compute: Compute) -> None:
        pc = config.parallel
        if config.kv_store.kinds:
            raise ValueError("kv_store is not supported with expert_parallel_size > 1 yet (every rank would need the "
                             "loaded blocks)")
        backend = pc.dist_backend or default_backend(compute.device)
        if (backend == "nccl") != compute.device.startswith("cuda"):
            raise ValueError(f"dist_backend={backend!r} does not fit device={compute.device!r} (gloo: CPU, "
                             f"nccl: CUDA)")
        self.config, self.num_ranks, self._timeout = config, pc.expert_parallel_size, pc.dist_timeout_s
        self._broken: str | None = None
        self._store = host_store(pc.master_addr, pc.master_port, pc.dist_timeout_s)
        # Never fork a process whose torch threads may be running: ranks fork from a fresh server process that has
        # only imported the rank code (once per engine process, so a second engine starts in a fraction of the time).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["deepinfer.worker.ep_rank"])
        self._processes, self._conns = [], []
        for rank in range(self.num_ranks):
            ours, theirs = context.Pipe()
            args = RankArgs(rank, config, files, max_model_len, compute, self._store.port, backend)
            process = context.Process(target=rank_main, args=(args, theirs), name=f"deepinfer-ep-rank-{rank}",
                                      daemon=True)
            process.start()
            theirs.close()  # the rank's end lives in the rank only, so its death closes the pipe
            self._processes.append(process)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._conns)
        try:
            info: RankInfo = self._replies("start-up")[0]
        except BaseException:
            self._finalizer()
            raise
        self._kv_specs = info.kv_specs
        self.placement = info.placement
        self._tracker = ExpertLoadTracker(TrackerConfig(self.placement.num_layers, self.placement.num_experts))
        self._window: collections.deque[tuple[np.ndarray, int]] = collections.deque(maxlen=pc.moe_lb_window)
        self._steps = self._rebalances = self._experts_moved = 0
        self._longest_move_s = 0.0
        self._target: Placement | None = None  # where the layers still being moved go

    # ---- the Executor interface -------------------------------------------------------------------------------
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self._kv_specs

    def initialize_cache(self, num_blocks: int, layout: KVLayout, kv_store: KVStoreConnector | None) -> None:
        if kv_store is not None:
            raise ValueError("kv_store is not supported with expert_parallel_size > 1 yet")
        self._call(("init", num_blocks, layout), "initialize_cache")

    def execute(self, plan: StepPlan) -> StepResult:
        self.move_next_layer()
        replies = self._call(("step", plan), "step")
        result, exchange_bytes = replies[0]
        for rank, (sampled, _) in enumerate(replies[1:], start=1):
            if sampled != result.sampled:
                raise self._fail(f"expert-parallel ranks diverged: rank {rank} sampled {sampled}, rank 0 "
                                 f"{result.sampled} (the replicated layers must compute the same bits on every rank)")
        if result.expert_counts is not None:
            self._record(result, exchange_bytes)
        return result

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def rank_pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    # ---- load balancing ---------------------------------------------------------------------------------------
    def load_stats(self) -> MoELoadStats:
        loads = np.stack([w for w, _ in self._window]) if self._window else np.zeros((1, 1, self.num_ranks))
        lb = moe_lb(loads)
        bytes_per_step = float(np.mean([b for _, b in self._window])) if self._window else 0.0
        return MoELoadStats(lb.mean, lb.worst, len(self._window), self._rebalances, self._experts_moved,
                            self._longest_move_s, bytes_per_step)

    def _record(self, result: StepResult, exchange_bytes: int) -> None:
        self._window.append((np.asarray(result.expert_rank_loads), exchange_bytes))
        self._tracker.record(result.expert_counts)
        self._steps += 1
        interval = self.config.parallel.eplb_interval
        if interval is not None and self._steps % interval == 0 and self._target is None:
            self.rebalance(balanced_placement(self._tracker.loads, self.placement.num_slots, self.num_ranks))

    def rebalance(self, placement: Placement) -> None:
        """Starts moving the ranks' expert weights to `placement`: one MoE layer per step boundary, each layer's slots
        switching at once, so a step waits for at most one layer's weights (the layers in between run on a mix of
        old and new rows, each a valid placement of its layer). A no-op when nothing changes."""
        if placement.slot_to_expert.shape != self.placement.slot_to_expert.shape \
                or placement.num_experts != self.placement.num_experts or placement.num_ranks != self.num_ranks:
            raise ValueError(f"placement shape {placement.slot_to_expert.shape} over {placement.num_ranks} ranks, "
                             f"expected {self.placement.slot_to_expert.shape} over {self.num_ranks}")
        if not np.array_equal(placement.slot_to_expert, self.placement.slot_to_expert):
            self._target = placement
            self._rebalances += 1
            self._longest_move_s = 0.0

    def move_next_layer(self) -> bool:
        """Moves the next layer that differs from the target placement, if any (between two steps); returns whether
        one moved."""
        if self._target is None:
            return False
        current, target = self.placement.slot_to_expert, self._target.slot_to_expert
        layer = next(i for i in range(len(current)) if not np.array_equal(current[i], target[i]))
        started = time.perf_counter()
        self._experts_moved += sum(self._call(("place", layer, target[layer]), "rebalance"))
        self._longest_move_s = max(self._longest_move_s, time.perf_counter() - started)
        table = current.copy()
        table[layer] = target[layer]
        self.placement = Placement(table, self.placement.num_experts, self.num_ranks)
        if np.array_equal(table, target):
            self._target = None
        return True

    # ---- talking to the ranks ---------------------------------------------------------------------------------
    def _call(self, request: tuple, what: str) -> list[Any]:
        """Sends one request to every rank and returns their payloads, rank order."""
        if self._broken is not None:
            raise RuntimeError(f"expert-parallel executor is down: {self._broken}")
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)  # one pickle, N sends
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(blob)
            except OSError:
                raise self._fail(self._death(rank) or f"expert-parallel rank {rank}: its pipe is closed") from None
        return self._replies(what)

    def _replies(self, what: str) -> list[Any]:
        """Every rank's answer to the last request. A dead rank fails it at once; a rank that reports an error leaves
        the others _GRACE_S more to answer; a stuck rank fails it after dist_timeout_s (its peers' collectives time
        out first, and report it)."""
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        payloads: list[Any] = [None] * self.num_ranks
        errors: dict[int, tuple[str, str, str]] = {}  # rank -> (exception type, message, traceback)
        started = time.monotonic()
        deadline = started + self._timeout + _GRACE_S
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, conn in pending.items() if conn in ready]:
                try:
                    status, payload = pending.pop(rank).recv()
                except (EOFError, OSError):
                    raise self._fail(self._death(rank) or f"expert-parallel rank {rank} closed its pipe") from None
                if status == "ok":
                    payloads[rank] = payload
                else:
                    errors[rank] = payload
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
            dead = [sentinels[s] for s in ready if s in sentinels and sentinels[s] in pending]
            if dead:
                raise self._fail(self._death(dead[0]))
        if pending:
            said = "".join(f"; rank {r} reported {errors[r][0]}: {errors[r][1]}" for r in sorted(errors)[:1])
            raise self._fail(f"expert-parallel ranks {sorted(pending)} did not answer {what} within "
                             f"{time.monotonic() - started:.1f} s (dist_timeout_s={self._timeout:g}){said}")
        if errors:
            kinds = {(kind, message) for kind, message, _ in errors.values()}
            if len(errors) == self.num_ranks and len(kinds) == 1 and next(iter(kinds))[0] == "ValueError":
                raise ValueError(next(iter(kinds))[1])  # bad input, refused alike everywhere: the ranks carry on
            rank = min(errors)
            raise self._fail(self._first_death() or f"expert-parallel rank {rank} failed in {what}: {errors[rank][2]}")
        return payloads

    def _death(self, rank: int) -> str | None:
        process = self._processes[rank]
        process.join(timeout=_GRACE_S)
        if process.is_alive():
            return None
        return f"expert-parallel rank {rank} (pid {process.pid}) died with exit code {process.exitcode}"

    def _first_death(self) -> str | None:
        """A rank that died (within _GRACE_S): the likely cause of its peers' errors."""
        deadline = time.monotonic() + _GRACE_S
        while True:
            for rank, process in enumerate(self._processes):
                if not process.is_alive() and process.exitcode != 0:
                    return self._death(rank)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _fail(self, message: str) -> RuntimeError:
        """Kills every rank (a rank lost mid-collective leaves the group unusable) and returns the error to raise."""
        self._broken = message
        for process in self._processes:
            if process.is_alive():
                process.kill()
        self._finalizer()
        return RuntimeError(message)


def _stop(processes: list, conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(timeout=1.0)
        if process.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
            process.kill()
            process.join(timeout=1.0)
    for conn in conns:
        conn.close()
