"""Continuous batching: each step, decide how many tokens every request computes."""
from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_arrivals import KVArrivals
from deepinfer.core.kv_loading import AsyncKVLoads
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import CachedRequestData, KVBlockRef, NewRequestData, StepPlan, StepResult
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.spec import SpecDecodeStats

if TYPE_CHECKING:
    from deepinfer.kvstore.connector import KVStoreConnector


class Scheduler(KVArrivals):
    """No prefill or decode modes: a prompt chunk, a prefix-cache remainder and a decode token are all
    token counts under one budget. Running requests go first (oldest first); when blocks run out the
    newest running request is preempted and recomputed later, so the oldest always makes progress.

    With a KV store (`connector`), a request being admitted also takes the blocks the store holds beyond
    the device cache: they are loaded by the worker before the forward and count as computed. Blocks a
    step fills are saved to the store by the worker after the forward.

    Disaggregation: a decode request arrives with its first output token and its prompt's KV elsewhere
    (Request.remote_kv); it is admitted holding blocks for the whole prompt and waits while the worker pulls them
    (or loads them from the store). A prefill request that finishes with hold_kv keeps its blocks in `held` until
    the engine releases them (pulled, or timed out)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 connector: KVStoreConnector | None = None, draft_lookahead: int = 0,
                 async_loads: bool = False, remote_kv: bool = False, multi_steps: int = 0) -> None:
        self.config = config
        # store lookups, loads and remote pulls off the step (core/kv_loading.py); False: loads inside the step
        if remote_kv and not async_loads:
            raise ValueError("taking prompt KV from prefill engines (remote_kv) needs background loads (async_loads)")
        contains = connector.num_loadable if connector is not None else (lambda keys: 0)
        self.loads = AsyncKVLoads(contains) if async_loads and (connector is not None or remote_kv) else None
        self.held: dict[str, Request] = {}  # finished with hold_kv: blocks kept until release_held
        # slots a sampling request holds beyond this step's tokens: where MTP writes its deeper drafts' KV
        self.draft_lookahead = draft_lookahead
        # decode steps a request that decodes alone this step (one token, no drafts) may run after it, its KV slots
        # allocated with this step's (worker/multi_step.py); 0: one step at a time
        self.multi_steps = multi_steps
        self.kv = kv
        self.connector = connector
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._tail_saves: dict[str, list[KVBlockRef]] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # overlap scheduling: the last plan whose result is not applied yet, and the one applied ahead of its result
        self._unapplied: StepPlan | None = None
        self._applied_ahead: StepPlan | None = None
        self._voided: set[tuple[int, str]] = set()  # (step, request): a sample in flight that will not come
        self._steps = itertools.count(1)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.output_token_ids:  # its first token came from a prefill engine and may already end it
            stop = self._stop_reason(request, request.output_token_ids[-1])
            if stop is not None:
                self.finish(request.request_id, *stop)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or (self.loads and (self.loads.loading or self.loads.orphans)))

    def has_pending_saves(self) -> bool:
        return bool(self._tail_saves)

    def finish(self, request_id: str, reason: str, stop_reason: str | int | None = None) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif loading:
            del self.loads.loading[request_id]
        else:
            self.waiting.remove(request)
        if self.loads is not None:
            self.loads.forget(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if self.connector is not None:  # compact sliding tails: read by the worker before its blocks are reused
            tail = self.kv.tail_blocks(request)
            if tail:
                self._tail_saves[request_id] = [KVBlockRef(k, b, request.params.kv_ttl_class) for k, b in tail]
        if loading:  # the worker is writing its blocks: they are freed once it reports the load done
            self.loads.orphans[request_id] = request
        elif request.hold_kv and reason != "abort":
            self.held[request_id] = request
        else:
            self.kv.free(request)
        self._finished_ids.append(request_id)
        return request

    def schedule(self) -> StepPlan:
        """The next step's plan. Called while the previous plan still computes (overlap scheduling), it first counts
        that plan's tokens as computed and each token it samples as a placeholder (`_apply_ahead`)."""
        if self._unapplied is not None:
            self._apply_ahead(self._unapplied)
        plan = StepPlan(finished_ids=self._finished_ids, kv_saves_first=self._tail_saves, step=next(self._steps))
        self._finished_ids, self._tail_saves = [], {}
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_placeholders and self._ends_at_placeholders(request):
                i += 1  # its step in flight samples its last token: another step would be thrown away
                continue
            n = min(request.num_planned_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts_to_verify(request, n, budget)
            more = self._more_steps(request, n, drafts)  # multi-step decoding (0 with MTP's lookahead: exclusive)
            ahead = self._lookahead(request, n + len(drafts)) + more
            while not self.kv.can_allocate(request, n + len(drafts) + ahead):
                if drafts or ahead:  # drop the drafts (and extra steps) before preempting anyone
                    drafts, ahead, more = [], 0, 0
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                new_blocks = self.kv.allocate(request, n + len(drafts) + ahead)
                plan.cached_requests.append(
                    CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
                )
                if drafts:
                    plan.spec_token_ids[request.request_id] = drafts
                if more:
                    plan.multi_steps[request.request_id] = more
                self._plan_tokens(plan, request, n, len(drafts))
                budget -= n + len(drafts)
                i += 1
        if not plan.preempted_ids:
            budget = self._admit_waiting(plan, budget)
        self._unapplied = plan
        return plan

    def _apply_ahead(self, plan: StepPlan) -> None:
        """Overlap scheduling: counts a plan still computing as done, before its result; update() then only adds the
        sampled tokens. A plan with drafts cannot be counted ahead (how many are accepted is unknown)."""
        if plan.spec_token_ids:
            raise RuntimeError("a step verifying drafts cannot overlap the next one's planning")
        for request_id, n in plan.num_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += n
            request.num_placeholders += request_id in plan.sample_ids and (plan.step, request_id) not in self._voided
        self._unapplied, self._applied_ahead = None, plan

    def void_sample(self, step: int, request_id: str) -> None:
        """Overlap scheduling: the request's row in plan `step` (in flight) will not sample (its grammar appended
        tokens, which the next step computes first): it holds no placeholder, and the next plan may follow at once."""
        self._voided.add((step, request_id))

    def _ends_at_placeholders(self, request: Request) -> bool:
        """True if the tokens in flight certainly end the request (max_tokens or max_model_len)."""
        max_tokens = request.params.max_tokens
        if max_tokens is not None and len(request.output_token_ids) + request.num_placeholders >= max_tokens:
            return True
        return request.num_planned_tokens >= self.max_model_len

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        if self.loads is not None and self.connector is not None:  # start the lookups of the next ones, together
            self.loads.prefetch([(r, lambda r=r: self.kv.store_keys(r))
                                 for r in itertools.islice(self.waiting, self.config.max_num_seqs)
                                 if r.use_kv_store and r.params.prompt_logprobs is None])
        while self.waiting and budget > 0 and len(self.running) + len(self.loads or ()) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.remote_kv is not None and request.remote_kv.path == "direct":
                # the prefill engine holds every block of the prompt: what the device cache lacks is pulled
                if not self._admit_pull(plan, request, self.kv.find_cached_prefix(request, len)):
                    break
                continue
            hit = self.kv.no_hit()
            if request.params.prompt_logprobs is None:  # prompt logprobs need every position computed
                store = self.connector.num_loadable if self.connector is not None and request.use_kv_store else None
                if store is not None and self.loads is not None:
                    store = self.loads.store_view(request, lambda: self.kv.store_keys(request))
                    if store is None:
                        break  # its store lookup is still running: the step goes on without it
                hit = self.kv.find_cached_prefix(request, store)
            num_cached = hit.num_tokens
            n = request.num_tokens - num_cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.can_allocate(request, n, hit):
                break
            block_ids = self.kv.allocate(request, n, hit)
            self.waiting.popleft()
            self.kv.count_lookup(request.num_tokens, hit)
            if self.connector is not None:
                self.connector.count_admitted(request.num_tokens, hit.num_loaded_blocks)
            if hit.num_new_blocks:  # store blocks, filled by the worker before the forward (or in the background)
                plan.kv_loads[request.request_id] = [KVBlockRef(k, b) for k, b in self.kv.load_targets(request, hit)]
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            loading = self.loads is not None and hit.num_new_blocks > 0
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS if loading else RequestStatus.RUNNING
            if loading:
                self.loads.start(request, len(plan.kv_loads[request.request_id]))
            else:
                self.running.append(request)
            if request.remote_kv is not None:  # from the store: complete if it held every full block of the prompt
                complete = num_cached >= request.remote_kv.num_tokens // self.kv.block_size * self.kv.block_size
                if not (loading and complete):
                    if self.loads is not None:
                        self.loads.arrived(request.request_id, complete)
                    request.remote_kv = None
            plan.new_requests.append(self._new_request_data(request, block_ids))
            if not loading:
                self._plan_tokens(plan, request, n)
                budget -= n
        return budget

    def _new_request_data(self, request: Request, block_ids: list[list[int]]) -> NewRequestData:
        return NewRequestData(request_id=request.request_id, token_ids=request.all_token_ids,
                              num_prompt_tokens=request.num_prompt_tokens, block_ids=block_ids,
                              num_computed_tokens=request.num_computed_tokens, params=request.params,
                              seed=request.seed, eos_token_ids=request.eos_token_ids)

    def _drafts_to_verify(self, request: Request, n: int, budget: int) -> list[int]:
        """The request's drafts that fit this step: after all its known tokens, within the token budget, and no more
        than it could still emit (the target adds one token after the accepted drafts)."""
        drafts = request.spec_token_ids
        if not drafts or request.num_computed_tokens + n != request.num_tokens:
            return []
        room = min(budget - n, self.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        return drafts[: max(room, 0)]

    def _lookahead(self, request: Request, num_tokens: int) -> int:
        if not self.draft_lookahead or request.num_computed_tokens + num_tokens < request.num_tokens:
            return 0
        return max(0, min(self.draft_lookahead, self.max_model_len - request.num_computed_tokens - num_tokens))

    def _more_steps(self, request: Request, n: int, drafts: list[int]) -> int:
        """Extra decode steps for a request that decodes this step (its one last token, no drafts): as many as it
        may still emit after this step's token, up to multi_steps."""
        if not self.multi_steps or n != 1 or drafts or request.num_computed_tokens + 1 != request.num_tokens:
            return 0
        room = self.max_model_len - request.num_tokens - 1
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(0, min(self.multi_steps, room))

    def _plan_tokens(self, plan: StepPlan, request: Request, n: int, num_drafts: int = 0) -> None:
        """n known tokens (and num_drafts drafts after them) computed this step; only known tokens are saved."""
        plan.num_tokens[request.request_id] = n + num_drafts
        if request.num_computed_tokens + n == request.num_planned_tokens:
            plan.sample_ids.append(request.request_id)
        self._plan_saves(plan, request, n)

    def _plan_saves(self, plan: StepPlan, request: Request, num_new_tokens: int) -> None:
        if self.connector is None:
            return
        filled = self.kv.blocks_filled_by(request, num_new_tokens)
        if filled:
            ttl_class = request.params.kv_ttl_class
            plan.kv_saves[request.request_id] = [KVBlockRef(k, b, ttl_class) for k, b in filled]

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        request.num_placeholders = 0
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Applies a step's result; returns the requests that advanced (finished ones included)."""
        # overlap scheduling: its tokens may already count as computed
        ahead = self._applied_ahead is not None and plan.step == self._applied_ahead.step
        if ahead:
            self._applied_ahead = None
        elif self._unapplied is not None and plan.step == self._unapplied.step:
            self._unapplied = None
        self._roll_back_failed_loads(plan, result)
        if self.loads is not None:
            self._loads_done(result.kv_loads_done)
        advanced = []
        for request_id, n in plan.num_tokens.items():
            request = self.requests.get(request_id)
            if ahead and request is not None and request_id in plan.sample_ids \
                    and (plan.step, request_id) not in self._voided:
                request.num_placeholders = max(request.num_placeholders - 1, 0)
            if request is None or request.status is not RequestStatus.RUNNING:
                if ahead and request is not None and request.status is RequestStatus.PREEMPTED:
                    self._append_sampled(request, result.sampled.get(request_id, ()))  # preempted as it sampled
                    advanced.append(request)
                continue  # aborted or preempted while the step ran
            if ahead:  # computed already counted; the placeholder becomes its token
                stop = self._append_sampled(request, result.sampled.get(request_id, ()), finish=False)
                self.kv.cache_computed(request)
                if stop is not None:
                    self.finish(request_id, *stop)
                advanced.append(request)
                continue
            if request_id in result.kv_load_failures:
                continue  # left out of the forward; the rest is computed from the next step on
            sampled = result.sampled.get(request_id, ())
            if request_id in plan.multi_steps:  # each extra step's input was the token the one before sampled
                n += max(len(sampled) - 1, 0)
            drafted = len(plan.spec_token_ids.get(request_id, ()))
            if drafted:  # the KV of rejected drafts is overwritten when those positions are computed again
                accepted = max(len(sampled) - 1, 0)
                n -= drafted - accepted
                self.spec_stats.record(drafted, accepted)
                request.num_draft_tokens += drafted
                request.num_accepted_tokens += accepted
            request.spec_token_ids = result.draft_token_ids.get(request_id, [])
            stop = self._append_sampled(request, sampled, finish=False)
            # accepted drafts are computed; a stop inside them leaves the rest unknown
            request.num_computed_tokens = min(request.num_computed_tokens + n, request.num_tokens)
            self.kv.cache_computed(request)  # before a stop frees the blocks; rejected drafts lie beyond it
            if stop is not None:
                self.finish(request_id, *stop)
            advanced.append(request)
        if self._voided:
            self._voided = {v for v in self._voided if v[0] != plan.step}
        return advanced

    def _append_sampled(self, request: Request, tokens, finish: bool = True) -> tuple[str, int | None] | None:
        """Appends sampled tokens up to the first that stops the request; finishes it there unless finish=False."""
        for token in tokens:
            request.output_token_ids.append(token)
            stop = self._stop_reason(request, token)
            if stop is not None:
                if finish:
                    self.finish(request.request_id, *stop)
                return stop
        return None

    def append_tokens(self, request_id: str, tokens: list[int]) -> int:
        """Appends tokens decided without a model step (grammar jump-forward); they are computed in a
        later step like a prompt chunk. Applies the stop conditions; returns how many were appended."""
        request = self.requests.get(request_id)
        appended = 0
        if request is not None and tokens:
            request.spec_token_ids = []  # drafted before these tokens existed
        for token in tokens:
            if request is None or request.is_finished:
                break
            request.output_token_ids.append(token)
            appended += 1
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request_id, *reason)
        return appended

    def _stop_reason(self, request: Request, token: int) -> tuple[str, int | None] | None:
        params = request.params
        num_out = len(request.output_token_ids)
        reason = params.token_stop(token, request.eos_token_ids, num_out)
        if reason is not None:
            return reason
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return "length", None
        if request.num_tokens >= self.max_model_len:
            return "length", None
        return None
