"""Structured output, the engine half: compile at admission, one grammar matcher per sequence,
masks for the sequences that sample this step, advance on accepted tokens, jump-forward."""
from __future__ import annotations

import threading
from typing import Any

import torch

from deepinfer.core.plan import StepPlan


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

    def masks(self, plan: StepPlan) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Allowed-token masks for constrained sequences that sample a token this step. A sequence with speculative
        drafts gets one mask per verified row; its drafts are cut at the first one the grammar refuses (the plan's
        token count with them), and the matcher is rolled back to where it was."""
        masks: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for rid in plan.sample_ids:
            matcher = self._matchers.get(rid)
            if matcher is None:
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
            return not bool(first.any())
        return [rid for rid, mask in masks.items() if empty(mask)]

    def only_stop_allowed(self, request_id: str) -> bool:
        """Whether the request is constrained and its grammar complete: the next token can only be a stop token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        allowed = matcher.allowed_mask()
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
