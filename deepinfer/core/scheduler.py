"""Continuous batching: each step, decide how many tokens every request computes."""
from __future__ import annotations

from collections import deque

from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from deepinfer.core.request import Request, RequestStatus


class Scheduler:
    """No prefill or decode modes: a prompt chunk, a prefix-cache remainder and a decode token are all
    token counts under one budget. Running requests go first (oldest first); when blocks run out the
    newest running request is preempted and recomputed later, so the oldest always makes progress."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request_id: str, reason: str, stop_reason: str | int | None = None) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        self._finished_ids.append(request_id)
        return request

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.can_allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                new_blocks = self.kv.allocate(request, n)
                plan.cached_requests.append(
                    CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
                )
                plan.num_tokens[request.request_id] = n
                budget -= n
                i += 1
        if not plan.preempted_ids:
            budget = self._admit_waiting(plan, budget)
        return plan

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached, num_cached = [], 0
            if request.params.prompt_logprobs is None:  # prompt logprobs need every position computed
                cached, num_cached = self.kv.find_cached_prefix(request)
            n = request.num_tokens - num_cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.can_allocate(request, n, cached):
                break
            block_ids = self.kv.allocate(request, n, cached)
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=list(block_ids),
                    num_computed_tokens=num_cached,
                    params=request.params,
                    seed=request.seed,
                    eos_token_ids=request.eos_token_ids,
                )
            )
            plan.num_tokens[request.request_id] = n
            budget -= n
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Applies a step's result; returns the requests that advanced (finished ones included)."""
        advanced = []
        for request_id, n in plan.num_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens += n
            self.kv.cache_computed(request)  # before a stop frees the blocks
            for token in result.sampled.get(request_id, ()):
                request.output_token_ids.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    self.finish(request_id, *reason)
                    break
            advanced.append(request)
        return advanced

    def _stop_reason(self, request: Request, token: int) -> tuple[str, int | None] | None:
        params = request.params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return "length", None
        if request.num_tokens >= self.max_model_len:
            return "length", None
        return None
