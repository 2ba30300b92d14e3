"""The engine's view of one sequence being generated."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # admitted, blocks held, the worker still filling them
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class RemoteKV:
    """Disaggregation, decode side: the prompt's KV was computed by a prefill engine, which also sampled the first
    output token. "direct": the blocks are pulled from that engine (address, handoff_id); "store": its full blocks are
    in the shared KV store. num_tokens: the prompt positions it computed (all of the prompt)."""

    path: str
    num_tokens: int
    address: str | None = None
    handoff_id: str | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: params.seq_seed, or drawn once at arrival
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of known tokens
    num_preemptions: int = 0
    use_kv_store: bool = True  # False after a failed store load on a layer-group model: recompute instead
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify at the next step
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0
    hold_kv: bool = False  # disaggregation, prefill side: its blocks stay held after it finishes, for a pull
    remote_kv: RemoteKV | None = None  # disaggregation, decode side: where its prompt's KV comes from
    # overlap scheduling: tokens a step in flight will sample that the scheduler does not know yet. The next step
    # computes them all the same: the worker has them by the time it runs that step.
    num_placeholders: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens and placeholders: what the next step may compute up to."""
        return self.num_tokens + self.num_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
