"""Overlap (asynchronous) scheduling: the engine thread plans step N+1 and turns step N's result into outputs while a
worker thread computes.

One compute thread builds the executor and runs its steps in the order they were submitted, so a step always sees
the state (KV cache, sampled tokens) of every step before it. It does all of the model's work from load on: OpenMP
(libgomp) keeps a thread pool per thread that starts parallel work, and once a process has more pool threads than
CPUs, every pool waits at its barriers by sleeping instead of spinning; on this 2-core machine a forward driven from a
second thread ran 2.6x slower for that reason alone. The scheduler counts a step in flight as computed and each token it
will sample as a placeholder (core/scheduler.py `_apply_ahead`); the worker fills a placeholder from the token it
sampled itself, so a request's next step needs nothing from the engine thread. Outputs are the same tokens as one
step at a time: the plans differ only in which rows share a step, and every row's result depends on that row alone.

Structured output overlaps too: the next step's grammar mask needs the token in flight, but only when it samples,
after its forward. The plan carries the request as `late` (core/plan.py LateMasks); the engine thread feeds the token
to the grammar as it applies the step before, then fills the mask, while the worker computes the forward, and the
worker waits for it before sampling. Where the grammar then appends tokens without a model step (jump-forward), ends
the request or allows no token, the row is not sampled (core/scheduler.py `void_sample`: it holds no placeholder)
and the appended tokens go with the next plan, as one step at a time would: the same tokens.

Speculative decoding overlaps where nothing is drafted: how many of a step's drafts are accepted decides the next
step's positions, and its drafts come from its own result, so a step that verifies drafts, or follows a result
that proposed some, is planned after the step before returns (engine/engine.py `_can_overlap`). A step planned ahead
verifies none (the scheduler offers drafts only after every known token is computed); drafts the worker proposed in
a step that another was planned behind are dropped. Where the draft plan drafts nothing (a batch too big for drafts
to pay), every step overlaps; where it drafts, steps go one at a time and verify them. Greedy tokens are those of one
step at a time; a seeded sampled request's draws depend on where drafts were verified (the rejection rule differs
from plain sampling), as they already do on the batch with varlen drafts, so with fixed draft lengths
(enable_mtp_varlen=False, the reproducible mode) steps never overlap.

What runs one step at a time always: a KV store (a save names its block by the tokens in it), prefill/decode
hand-offs and expert-parallel ranks (their executor is driven from the engine thread too).
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from deepinfer.config import EngineConfig
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.outputs import RequestOutput

T = TypeVar("T")
logger = logging.getLogger("deepinfer")


@dataclass
class InFlight:
    plan: StepPlan
    failed: list[RequestOutput]  # requests that failed as it was planned (a grammar that allows no token)
    future: Future


def overlap_blockers(config: EngineConfig, device: str) -> list[str]:
    """Why this engine does not overlap steps (empty: it does)."""
    reasons = []
    wanted = config.scheduler.async_scheduling
    if wanted is False:
        reasons.append("async_scheduling=False")
    elif wanted is None:  # measured (doc/inference_deployment_qa.md)
        why = ("a GPU, where it measured slower: the forward launches its kernels from Python and the two threads "
               "contend for the GIL") if device.startswith("cuda") else \
            ("the CPU, where every core computes the forward: the engine thread's work beside it slows the forward "
             "by more than that work takes")
        reasons.append(f"the default on {why}; --async-scheduling turns it on")
    if config.spec.enabled and not config.enable_mtp_varlen:
        reasons.append("speculative decoding with fixed draft lengths (enable_mtp_varlen=False, the reproducible mode: "
                       "every step verifies the drafts proposed, and a seeded draw depends on where drafts were "
                       "verified)")
    if config.kv_store.kinds:
        reasons.append("a KV store (a block is saved under the hash of its tokens)")
    if config.disagg.role != "both":
        reasons.append(f"role={config.disagg.role} (KV hand-offs are driven between steps)")
    if config.parallel.expert_parallel_size > 1:
        reasons.append("expert-parallel ranks (their executor is driven from the engine thread)")
    return reasons


def describe_overlap(blockers: list[str]) -> str:
    """The start-up log's line: that steps overlap, or why they never do."""
    if blockers:
        return "off: " + "; ".join(blockers)
    return ("on (the next step is planned while one computes; a constrained request's grammar mask follows once its "
            "last token is known; a step with drafts to verify, or after one that proposed drafts, waits for the one "
            "before)")


def extra_decode_steps(config: EngineConfig, overlapped: bool) -> int:
    """Multi-step decoding (worker/multi_step.py): decode steps a decode (no drafts, no grammar) runs after its step
    (num_scheduler_steps - 1), or 0 where each step's tokens are needed before the next is planned: overlap
    scheduling (it plans one token a step ahead), speculative decoding (its own tokens a step), a KV store (it saves
    the blocks each planned step fills), a hand-off role, or expert-parallel ranks (their executor runs one step
    per call)."""
    extra = config.scheduler.num_scheduler_steps - 1
    blockers = [why for why, on in (("overlap scheduling", overlapped), ("speculative decoding", config.spec.enabled),
                                     ("a KV store", bool(config.kv_store.kinds)),
                                     (f"role={config.disagg.role}", config.disagg.role != "both"),
                                     ("expert-parallel ranks", config.parallel.expert_parallel_size > 1)) if on]
    if extra and blockers:
        logger.warning("num_scheduler_steps=%d ignored (one decode step per engine step) with %s", extra + 1,
                       ", ".join(blockers))
        return 0
    if extra:
        logger.info("multi-step decoding: up to %d decode steps per engine step for decodes without a grammar",
                    extra + 1)
    return extra


class StepPipeline:
    """Work on the compute thread: `call` waits for its answer, steps are submitted and taken in order."""

    def __init__(self, num_threads: int) -> None:
        # OpenMP's thread count is per calling thread: the compute thread sets its own
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-compute",
                                        initializer=torch.set_num_threads, initargs=(num_threads,))
        self.in_flight: deque[InFlight] = deque()

    def call(self, fn: Callable[..., T], *args) -> T:
        return self._pool.submit(fn, *args).result()

    def submit(self, execute: Callable[[StepPlan], StepResult], plan: StepPlan, failed: list[RequestOutput]) -> None:
        self.in_flight.append(InFlight(plan, failed, self._pool.submit(execute, plan)))

    def take(self) -> tuple[InFlight, StepResult]:
        """The oldest step and its result (blocks until it is done; its exception is raised here). After an
        exception the steps behind it are waited for and dropped: the caller aborts what was in flight."""
        step = self.in_flight.popleft()
        try:
            return step, step.future.result()
        except BaseException:
            self.drop_all()
            raise

    def cancel_late_masks(self, why: str) -> None:
        """Releases the steps in flight still waiting for grammar masks (they fail with `why`) before they are waited
        for: the engine thread that would fill them will not."""
        for step in self.in_flight:
            if step.plan.late_masks is not None:
                step.plan.late_masks.cancel(why)

    def drop_all(self) -> None:
        self.cancel_late_masks("a step before it failed")
        while self.in_flight:
            self.in_flight.popleft().future.exception()  # waits; its error, if any, is the first one's echo

    def close(self) -> None:
        self.drop_all()
        self._pool.shutdown(wait=True)
