"""What crosses between the scheduler (core) and the worker: a diff per step, and the step's result."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams

TokenLogprobs = dict[int, float]


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (its old state is dropped)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)  # tokens each request computes this step
    finished_ids: list[str] = field(default_factory=list)  # the worker drops their state
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    expert_counts: list[list[int]] | None = None  # per MoE layer, per expert: tokens routed this step (EPLB input)
