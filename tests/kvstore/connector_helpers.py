"""A scheduler plus a model-free worker sharing a KV store, to test the connector's two halves exactly.

"Computing" the token at position p writes value(token, p, tensor) into every cache tensor's slot,
and before computing anything the worker checks that every earlier position of the request already
holds its value, loaded or computed: a wrong or missing load fails there, the way attention would
read garbage. The sampled token depends on the tokens only, so outputs are comparable across runs.
"""
from __future__ import annotations

import torch

from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepResult
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.kvstore.base import KVStore
from deepinfer.worker.kv_transfer import KVBlockTransfer
from deepinfer.kvstore.connector import KVStoreConnector
from deepinfer.kvstore.saver import AsyncSaver
from deepinfer.sampling_params import SamplingParams

BS = 4


def value(token: int, position: int, tensor: int) -> float:
    """Never 0 (an unwritten slot) and exact in bfloat16."""
    return float((token * 131 + position * 17 + tensor * 5) % 251 + 1)


class TinyEngine:
    """One scheduler and one worker with two layers of small K/V caches; a fresh one has a cold device cache."""

    def __init__(self, store: KVStore, num_blocks: int = 64, budget: int = 64, dtype: torch.dtype = torch.float32,
                 caching: bool = True, saver_queue: int | None = None) -> None:
        self.connector = KVStoreConnector(store, AsyncSaver(store, saver_queue), BS)
        self.kv = KVCacheManager(num_blocks, BS, caching, "tiny-model")
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), self.kv, 10_000, self.connector)
        self.caches = [(torch.zeros(num_blocks * BS, 2, 3, dtype=dtype), torch.zeros(num_blocks * BS, 1, 5, dtype=dtype))
                       for _ in range(2)]
        self.transfer = KVBlockTransfer(store, self.connector.saver, self.caches, num_blocks, BS)
        self.tables: dict[str, list[int]] = {}
        self.plans = []
        self.results = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3, **params) -> None:
        self.scheduler.add(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), 0, 0.0))

    def step(self) -> StepResult:
        plan = self.scheduler.schedule()
        for rid in plan.finished_ids + plan.preempted_ids:
            self.tables.pop(rid, None)
        for new in plan.new_requests:
            self.tables[new.request_id] = list(new.block_ids[0])
        for cached in plan.cached_requests:
            self.tables[cached.request_id].extend(cached.new_block_ids[0])
        result = StepResult()
        work = plan
        if plan.kv_loads:
            result.kv_load_failures = self.transfer.load(plan)
            work = plan.without(result.kv_load_failures)
        for rid, n in work.num_tokens.items():
            request = self.scheduler.requests[rid]
            start = request.num_computed_tokens
            for pos in range(start):
                self._check(rid, request.token_at(pos), pos)
            for pos in range(start, start + n):
                self._write(rid, request.token_at(pos), pos)
            if start + n == request.num_tokens:
                result.sampled[rid] = [sum(request.all_token_ids) % 97 + 1000]
        self.transfer.save(work)
        self.scheduler.update(plan, result)
        self.plans.append(plan)
        self.results.append(result)
        return result

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def generate(self, rid: str, prompt: list[int], max_tokens: int = 3, **params) -> list[int]:
        self.add(rid, prompt, max_tokens, **params)
        request = self.scheduler.requests[rid]
        self.run()
        return request.output_token_ids

    def _slot(self, rid: str, pos: int) -> int:
        return self.tables[rid][pos // BS] * BS + pos % BS

    def _write(self, rid: str, token: int, pos: int) -> None:
        slot = self._slot(rid, pos)
        for i, t in enumerate(t for pair in self.caches for t in pair):
            t[slot] = value(token, pos, i)

    def _check(self, rid: str, token: int, pos: int) -> None:
        slot = self._slot(rid, pos)
        for i, t in enumerate(t for pair in self.caches for t in pair):
            got = t[slot].flatten()[0].item()
            assert got == value(token, pos, i), f"{rid}: wrong KV at position {pos}: {got}"

    def close(self) -> None:
        self.connector.saver.close()
