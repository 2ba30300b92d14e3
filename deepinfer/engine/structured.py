"""Structured output, the engine half: compile at admission, one grammar matcher per sequence,
masks for the sequences that sample this step (or, with overlap scheduling, once their token in flight is known),
advance on accepted tokens, jump-forward."""
from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import torch

from deepinfer.core.plan import StepPlan
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler import Scheduler


class StructuredOutputs:
    """Holds the grammar compiler (built on first use: xgrammar is an optional import) and matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._matchers: dict[str, Any] = {}
        self.jump_forward_tokens = 0  # tokens appended without a model step

    def compile(self, so_args: dict) -> Any:
        """Raises ValueError for an invalid regex, JSON schema or grammar (before anything is queued)."""
        with self._lock:
            if self._compiler is None:
                from deepinfer.sample.structured import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, stop_token_ids=self._stop_token_ids)
        return self._compiler.compile(so_args)

    def add(self, request_id: str, compiled: Any) -> None:
        from deepinfer.sample.structured import GrammarMatcher

        self._matchers[request_id] = GrammarMatcher(compiled)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        if num_tokens:
            self._matchers[request_id].rollback(num_tokens)

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def allowed(self, request_id: str) -> torch.Tensor | None:
        """The request's allowed-token mask now (None: not constrained, or no longer)."""
        matcher = self._matchers.get(request_id)
        return None if matcher is None else matcher.allowed_mask()

    def masks(self, plan: StepPlan, skip: Collection[str] = ()) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Allowed-token masks for constrained sequences that sample a token this step (but `skip`). A sequence with
        speculative drafts gets one mask per verified row; its drafts are cut at the first one the grammar refuses
        (the plan's token count with them), and the matcher is rolled back to where it was."""
        masks: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for rid in plan.sample_ids:
            matcher = self._matchers.get(rid)
            if matcher is None or rid in skip:
                continue
            drafts = plan.spec_token_ids.get(rid)
            if not drafts:
                masks[rid] = matcher.allowed_mask()
                continue
            rows, accepted = [matcher.allowed_mask()], 0
            for token in drafts:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                accepted += 1
                rows.append(matcher.allowed_mask())
            matcher.rollback(accepted)
            if accepted < len(drafts):
                plan.num_tokens[rid] -= len(drafts) - accepted
                if accepted:
                    plan.spec_token_ids[rid] = drafts[:accepted]
                else:
                    del plan.spec_token_ids[rid]
            masks[rid] = rows if accepted else rows[0]
        return masks

    @staticmethod
    def dead_ends(masks: dict) -> list[str]:
        """Constrained sequences whose grammar allows no token of this vocabulary (a character no token spells):
        they cannot continue, and sampling them would fail the whole step."""
        def empty(mask) -> bool:
            first = mask[0] if isinstance(mask, list) else mask
            return not allows_any(first)
        return [rid for rid, mask in masks.items() if empty(mask)]

    def only_stop_allowed(self, request_id: str) -> bool:
        """Whether the request is constrained and its grammar complete: the next token can only be a stop token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        allowed = matcher.allowed_mask().numpy()  # a fresh array
        allowed[self._stop_token_ids] = False
        return not bool(allowed.any())

    def accept(self, request_id: str, tokens: list[int]) -> tuple[bool, list[int]]:
        """Advances the grammar; returns (terminated, tokens the grammar now forces)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False, []
        for token in tokens:
            if not matcher.accept_token(token):
                raise RuntimeError(f"grammar rejected sampled token {token} for {request_id}: the mask was not applied")
        if matcher.is_terminated():
            return True, []
        forced = matcher.jump_forward_tokens()
        accepted = []
        for token in forced:
            if not matcher.accept_token(token):
                break
            accepted.append(token)
        return matcher.is_terminated(), accepted

    def advance(self, advanced: list[Request], sampled: dict[str, list[int]],
                scheduler: Scheduler) -> dict[str, list[int]]:
        """Feeds a step's sampled tokens to each grammar; a finished grammar ends its request with "stop"; tokens the
        grammar forces are appended without a model step (jump-forward): returned per request, for the worker."""
        appended_now: dict[str, list[int]] = {}
        for request in advanced:
            rid = request.request_id
            tokens = sampled.get(rid, [])
            if request.is_finished or not tokens:
                continue
            terminated, forced = self.accept(rid, tokens)
            if forced:
                appended = scheduler.append_tokens(rid, forced)
                self.rollback(rid, len(forced) - appended)
                self.jump_forward_tokens += appended
                if not request.is_finished:
                    appended_now[rid] = forced[:appended]
            if terminated and not request.is_finished:
                scheduler.finish(rid, "stop")
            elif not request.is_finished and len(request.output_token_ids) < request.params.min_tokens \
                    and self.only_stop_allowed(rid):
                # min_tokens would suppress the only tokens the grammar allows (the sampler then fails the
                # whole step); the grammar wins, so the output stays valid
                scheduler.finish(rid, "stop")
        return appended_now

    def late_masks(self, request_ids: list[str], scheduler: Scheduler,
                   appended: dict[str, list[int]]) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """Overlap scheduling: the masks of a step in flight for requests whose previous token was in flight when it
        was planned, now that their grammars have it (core/plan.py LateMasks): (masks, rows not to sample, dead
        ends). A row is not sampled where its request no longer runs, its grammar appended tokens (the next step
        computes those first, as one step at a time would) or allows no token (a dead end: the request fails)."""
        masks, voided, dead = {}, [], []
        for rid in request_ids:
            request = scheduler.requests.get(rid)
            running = request is not None and request.status is RequestStatus.RUNNING and rid not in appended
            mask = self.allowed(rid) if running else None
            if mask is not None and allows_any(mask):
                masks[rid] = mask
                continue
            voided.append(rid)
            if mask is not None:
                dead.append(rid)
        return masks, voided, dead


def allows_any(mask: torch.Tensor) -> bool:
    """Whether a mask allows any token, read through numpy: torch reduces a vocabulary this long in parallel, and on
    the engine thread while a compute thread runs the forward (overlap scheduling) that starts a second OpenMP pool,
    with which libgomp's pools sleep at their barriers (one constrained user's steps ran ~2x slower)."""
    return bool(mask.numpy().any())
