"""The simulated replica of benchmarks/router_sim.py: one engine as a discrete-event model of core/scheduler.py.

A FIFO waiting queue, continuous batching under a token budget and --max-num-seqs, and a prefix cache of `capacity`
blocks with LRU eviction of blocks no running request holds; a request's cache hit is looked up when it is admitted.
Step times come from the router's CostModel. Each replica sends the router incremental reports (load, added and
evicted keys) as the real ones do (server/replica_api.py).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from deepinfer.router.policy import CostModel, ReplicaReport, attention_pairs

BLOCK = 512  # tokens per trace hash id


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: float  # seconds after the first request, unscaled
    input_len: int
    output_len: int
    keys: tuple[bytes, ...]


def cached_tokens(matched_blocks: int, input_len: int) -> int:
    return max(0, min(matched_blocks * BLOCK, input_len - 1))  # the last prompt token is always computed



@dataclass
class Job:
    request: TraceRequest
    arrival: float  # scaled
    expected_cached: int  # tokens the replica held when the request was routed there
    matched: int = 0  # blocks hit at admission
    computed: int = 0  # tokens
    generated: int = 0
    keys_done: int = 0  # leading keys registered as computed on the replica
    first_token: float | None = None


@dataclass
class Replica:
    """One simulated engine: a FIFO queue, continuous batching and an LRU prefix cache of `capacity` blocks."""

    index: int
    capacity: int
    cost: CostModel
    max_num_seqs: int
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    lru: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # computed blocks no running request holds
    refs: dict[bytes, int] = field(default_factory=dict)  # blocks held by running requests
    computed: set[bytes] = field(default_factory=set)  # blocks whose KV exists: the ones a lookup can hit
    added: set[bytes] = field(default_factory=set)  # since the last report
    evicted: set[bytes] = field(default_factory=set)
    seq: int = 0
    last_report: float = float("-inf")
    dirty: bool = True
    stepping: list[tuple[Job, int]] | None = None  # the step in flight
    compute_s: float = 0.0
    busy_s: float = 0.0
    evictions: int = 0

    def matched_prefix(self, keys: Sequence[bytes]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.computed), len(keys))

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.dirty = True

    def report(self, now: float) -> ReplicaReport:
        queued = pairs = 0
        for job in self.waiting:
            queued += job.request.input_len - job.expected_cached
            pairs += attention_pairs(job.expected_cached, job.request.input_len)
        decoding = context = 0
        for job in self.running:
            if job.computed < job.request.input_len:
                queued += job.request.input_len - job.computed
                pairs += attention_pairs(job.computed, job.request.input_len)
            else:
                decoding += 1
                context += job.request.input_len + job.generated
        self.seq += 1
        report = ReplicaReport(self.seq, queued, pairs, decoding, context, len(self.waiting),
                               min(1.0, len(self.refs) / self.capacity), tuple(self.added), tuple(self.evicted))
        self.added, self.evicted = set(), set()
        self.last_report, self.dirty = now, False
        return report

    def _fits(self, keys: Sequence[bytes]) -> bool:
        return len(self.refs) + sum(k not in self.refs for k in keys) <= self.capacity

    def _hold(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            if k in self.refs:
                self.refs[k] += 1
                continue
            if k in self.lru:
                del self.lru[k]
            elif len(self.refs) + len(self.lru) >= self.capacity:
                old, _ = self.lru.popitem(last=False)
                self.computed.discard(old)
                self.added.discard(old)
                self.evicted.add(old)
                self.evictions += 1
            self.refs[k] = 1

    def _release(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.refs[k] -= 1
            if not self.refs[k]:
                del self.refs[k]
                if k in self.computed:
                    self.lru[k] = None

    def plan_step(self) -> float | None:
        """Chooses this step's work like core/scheduler.py and returns its duration; None when idle."""
        budget = self.cost.max_batch_tokens
        work: list[tuple[Job, int]] = []
        prefill = pairs = decoding = context = 0
        for job in self.running:
            if budget <= 0:
                break
            r = job.request
            if job.computed < r.input_len:
                n = min(r.input_len - job.computed, budget)
                prefill += n
                pairs += attention_pairs(job.computed, job.computed + n)
            else:
                n = 1
                decoding += 1
                context += r.input_len + job.generated
            work.append((job, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            job = self.waiting[0]
            r = job.request
            if not self._fits(r.keys):
                break
            self.waiting.popleft()
            job.matched = self.matched_prefix(r.keys)
            job.computed, job.keys_done = cached_tokens(job.matched, r.input_len), job.matched
            self._hold(r.keys)
            self.running.append(job)
            n = min(r.input_len - job.computed, budget)
            prefill += n
            pairs += attention_pairs(job.computed, job.computed + n)
            work.append((job, n))
            budget -= n
        if not work:
            return None
        self.stepping = work
        seconds = self.cost.step_seconds(prefill, pairs, decoding, context)
        self.busy_s += seconds
        self.compute_s += seconds - self.cost.step_s
        return seconds

    def finish_step(self, now: float) -> list[Job]:
        """Applies the step in flight; returns the jobs that finished."""
        done = []
        for job, n in self.stepping:
            r = job.request
            if job.computed < r.input_len:
                job.computed += n
                full = len(r.keys) if job.computed == r.input_len else job.computed // BLOCK
                for k in r.keys[job.keys_done:full]:
                    if k not in self.computed:
                        self.computed.add(k)
                        self.added.add(k)
                        self.evicted.discard(k)
                job.keys_done = max(job.keys_done, full)
                if job.computed == r.input_len:
                    job.generated, job.first_token = 1, now
            else:
                job.generated += 1
            if job.first_token is not None and job.generated >= r.output_len:
                done.append(job)
        for job in done:
            self.running.remove(job)
            self._release(job.request.keys)
        self.stepping = None
        self.dirty = True
        return done
