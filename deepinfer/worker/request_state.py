"""What the worker holds for each request between steps: its tokens (prompt and output apart), sampling parameters,
penalty counts and draft-acceptance estimates."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.sample.penalties import PenaltyState
from deepinfer.sample.sampler import SamplingRow, has_penalties, plain_greedy_params
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.speculative import DraftState


class Tokens:
    """A request's prompt and generated tokens, kept apart: the sampler reads each without a per-step copy, a step's
    inputs slice only the tokens it computes."""

    __slots__ = ("prompt", "output")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.prompt, self.output = list(token_ids[:num_prompt_tokens]), list(token_ids[num_prompt_tokens:])

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(len(self))
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n : stop - n]
        return self.prompt[start:] + self.output[: stop - n]

    def extend(self, tokens: list[int]) -> None:
        self.output.extend(tokens)

    def as_array(self) -> np.ndarray:
        return np.asarray(self.prompt + self.output, dtype=np.int64)


@dataclass
class WorkerRequest:
    """A running request as the worker sees it: tokens, block ids, sampling parameters, and the acceptance estimates
    of whoever drafts for it (the proposer's and, with the n-gram lookup in front of MTP, the lookup's)."""

    token_ids: Tokens
    block_ids: list[np.ndarray]  # per layer group, int64; replaced (not changed in place) when blocks are added
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    drafting: DraftState = field(default_factory=DraftState)
    lookup: DraftState = field(default_factory=DraftState)  # the n-gram lookup in front of MTP, its own estimates
    matched: dict[int, DraftState] = field(default_factory=dict)  # n-gram drafts (varlen): by the match's length
    drafted_by: DraftState | None = None  # whose estimates the drafts now proposed came from (drafting/lookup/matched)
    penalties: PenaltyState | None = None  # requests with penalties: their tokens as the sampler reads them
    plain_greedy: bool = field(init=False, default=False)  # greedy, no logprobs, no penalties

    def __post_init__(self) -> None:
        if has_penalties(self.params):
            self.penalties = PenaltyState(self.token_ids.prompt, self.token_ids.output)
        self.plain_greedy = plain_greedy_params(self.params)

    @property
    def argmax_only(self) -> bool:
        """A row the sampler answers with the argmax alone (once min_tokens no longer holds back a stop token)."""
        return self.plain_greedy and len(self.token_ids.output) >= self.params.min_tokens

    def stops(self, token: int) -> bool:
        """Whether `token`, the last output token, ends the request (the scheduler decides; this only tells a
        multi-step run that the row has no use for more steps)."""
        return self.params.token_stop(token, self.eos_token_ids, len(self.token_ids.output)) is not None

    @property
    def judged(self) -> DraftState:
        """The estimates a verification of the drafts now proposed updates: those of whoever proposed them."""
        return self.drafted_by or self.drafting

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids.prompt)

    def extend(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)
        if self.penalties is not None:
            self.penalties.extend(tokens)

    def sampling_row(self, mask: torch.Tensor | None) -> SamplingRow:
        tokens = self.token_ids
        return SamplingRow(self.params, self.seed, len(tokens.output), tokens.prompt, tokens.output,
                           self.eos_token_ids, mask, self.penalties)
