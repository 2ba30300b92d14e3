"""What crosses between the scheduler (core) and the worker: a diff per step, and the step's result."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from deepinfer.sampling_params import SamplingParams

TokenLogprobs = dict[int, float]


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (its old state is dropped)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    block_ids: list[list[int]]  # per layer group, its block table
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[list[int]]  # per layer group, entries appended to its table
    num_computed_tokens: int


@dataclass(frozen=True)
class KVBlockRef:
    """One block moving between the device KV cache and the external KV store."""

    key: bytes  # the prefix cache's chained block key, also the store key
    block_id: int
    ttl_class: str | None = None  # saves only: the request's kv_ttl_class (None: the store's default)


@dataclass(frozen=True)
class KVPull:
    """Disaggregation, direct hand-off: blocks of a prompt's KV that a prefill engine holds, pulled into this engine's
    cache in the background. The last block may be partial (the prompt's tail)."""

    address: str  # the prefill engine's hand-off socket
    handoff_id: str
    block_indices: list[int]  # positions in the prompt's block table, ascending
    block_ids: list[int]  # where each goes in this engine's cache


class LateMasks:
    """Overlap scheduling with structured output: the grammar masks of a step planned while the step before it still
    computes, for the constrained requests whose previous token that step samples. The engine thread fills them once
    it has fed those tokens to the grammars (engine/engine.py `_fill_late_masks`); the worker waits for them after its forward,
    before sampling. `voided`: rows not to sample at all (the request finished, or its grammar appended tokens without
    a model step, which the next step computes first, or allows no token at all)."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._ready = threading.Event()
        self._masks: dict[str, Any] = {}
        self._voided: frozenset[str] = frozenset()
        self._error: str | None = None

    # how long the worker waits after its forward (milliseconds in practice; past it the step fails, never hangs)
    TIMEOUT_S = 60.0

    def fill(self, masks: dict[str, Any], voided: Collection[str]) -> None:
        self._masks, self._voided = masks, frozenset(voided)
        self._ready.set()

    def cancel(self, why: str) -> None:
        """Releases a worker waiting for masks that will not come (the engine dropped the step): it raises. Masks
        already filled stand (fill and cancel both run on the engine thread)."""
        if not self._ready.is_set():
            self._error = why
            self._ready.set()

    def wait(self, timeout: float = TIMEOUT_S) -> tuple[dict[str, Any], frozenset[str]]:
        if not self._ready.wait(timeout):
            raise RuntimeError(f"overlap scheduling: the grammar masks of a step planned ahead did not arrive within "
                               f"{timeout:g} s")
        if self._error is not None:
            raise RuntimeError(f"overlap scheduling: step dropped before its grammar masks were filled ({self._error})")
        return self._masks, self._voided


@dataclass
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)  # tokens each request computes this step
    sample_ids: list[str] = field(default_factory=list)  # requests whose step reaches their last token: they sample
    # speculative decoding: draft tokens appended after a request's last known token this step (counted in
    # num_tokens); the worker verifies them and samples one more
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # multi-step decoding: decodes that may run this many more decode steps after this one (their KV slots are
    # allocated); the worker returns each step's token, or only the first where it cannot run them
    multi_steps: dict[str, int] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)  # the worker drops their state
    preempted_ids: list[str] = field(default_factory=list)
    # structured output: allowed-token masks (bool [V]) for constrained requests that sample this step,
    # and tokens the engine appended without a model step (grammar jump-forward) that the worker must learn
    grammar_masks: dict[str, Any] = field(default_factory=dict)
    appended_token_ids: dict[str, list[int]] = field(default_factory=dict)
    late_masks: LateMasks | None = None  # overlap scheduling: masks that wait for the step before's tokens
    # KV store work, in block-chain order. Loads fill blocks before the forward; their tokens already
    # count in num_computed_tokens. Saves copy blocks this step's forward fills, after it.
    kv_loads: dict[str, list[KVBlockRef]] = field(default_factory=dict)
    kv_saves: dict[str, list[KVBlockRef]] = field(default_factory=dict)
    # saved before the forward: tails of requests that finished (their blocks may be handed out this step)
    kv_saves_first: dict[str, list[KVBlockRef]] = field(default_factory=dict)
    # disaggregation: prompt KV to pull from prefill engines in the background (reported in kv_loads_done)
    kv_pulls: dict[str, KVPull] = field(default_factory=dict)
    step: int = 0  # the scheduler's count; a plan narrowed by without() keeps it

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def without(self, request_ids: Collection[str]) -> StepPlan:
        """This plan minus the work of `request_ids` this step (the worker's state for them is kept)."""
        drop = set(request_ids)
        return dataclasses.replace(
            self,
            num_tokens={r: n for r, n in self.num_tokens.items() if r not in drop},
            sample_ids=[r for r in self.sample_ids if r not in drop],
            spec_token_ids={r: v for r, v in self.spec_token_ids.items() if r not in drop},
            multi_steps={r: v for r, v in self.multi_steps.items() if r not in drop},
            kv_loads={r: v for r, v in self.kv_loads.items() if r not in drop},
            kv_saves={r: v for r, v in self.kv_saves.items() if r not in drop},
        )


@dataclass
class StepResult:
    # per request the tokens it emits this step: one, or with drafts the accepted ones and the target's next
    sampled: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # the proposer's drafts for the next step
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    expert_counts: list[list[int]] | None = None  # per MoE layer, per expert: tokens routed this step (EPLB input)
    # expert parallelism: per MoE layer, per rank, the (token, expert) rows its slots computed this step (moe_lb input)
    expert_rank_loads: list[list[int]] | None = None
    # request id -> how many of its kv_loads (leading, in order) arrived intact. A request listed here
    # was left out of this step's forward; the scheduler recomputes from its first failed block.
    kv_load_failures: dict[str, int] = field(default_factory=dict)
    # background loads and pulls the worker finished this step: request id -> how many of its blocks arrived intact
    kv_loads_done: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # worker seconds: prepare, forward, sample
