"""Speculative decoding, the worker half: verify a request's drafts against the target's logits at its k + 1 rows,
and propose the next step's drafts.

Each of the k + 1 rows is sampled as if the drafts before it had been generated: its SamplingRow sees them as
output tokens (penalties, min_tokens), its output position, and its own grammar mask. Greedy rows accept while the
target's argmax equals the draft; sampled rows use the rejection rule (sample/rejection.py).

Draft lengths: with `varlen`, each sequence drafts as many tokens as its recent acceptance makes worthwhile (down
to none, probing again now and then); without it, every sequence drafts exactly k (as many as the proposer finds).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.config import SpecConfig
from deepinfer.sample.distribution import target_probabilities
from deepinfer.sample.logprobs import logprob_dicts
from deepinfer.sample.rejection import verify_greedy, verify_sampled
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.spec.ngram import propose_ngram

EMA = 0.7  # weight of the past in a sequence's acceptance estimate
PROBE_EVERY = 8  # steps between one-token probes of a sequence that stopped drafting
# a decode step's fixed cost in rows, calibrated on SmolLM2 Q4_1, 2 cores (benchmarks/spec_decode.py with 2, 4 and 8;
# doc/inference_deployment_qa.md): below the ~10 rows the kernels alone suggest, since a batch waits for its
# slowest sequence and a draft's verification costs more than its share of the kernels
FIXED_ROWS = 4


@dataclass
class DraftState:
    """Per sequence: its acceptance estimate and how long it has gone without drafting."""

    acceptance: float = 0.6
    idle_steps: int = 0


def verify(sampler: Sampler, logits: torch.Tensor, base: SamplingRow, drafts: Sequence[int],
           masks: Sequence[torch.Tensor | None]) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [k + 1, V] at the request's rows; base: the row as plain sampling would build it. Returns the tokens
    to emit and, if the request asks, their logprobs."""
    rows = [SamplingRow(base.params, base.seed, base.position + i, base.prompt_token_ids,
                        list(base.output_token_ids) + list(drafts[:i]), base.eos_token_ids,
                        masks[i] if i < len(masks) else None)
            for i in range(len(drafts) + 1)]
    if base.params.greedy:
        emitted = verify_greedy(sampler(logits, rows).token_ids, drafts)
    else:
        emitted = verify_sampled(target_probabilities(logits, rows), drafts, None, base.seed, base.position)
    if base.params.logprobs is None:
        return emitted, [None] * len(emitted)
    raw = torch.log_softmax(logits[: len(emitted)].float(), dim=-1)
    return emitted, list(logprob_dicts(raw, emitted, [base.params.logprobs] * len(emitted)))


def draft_length(spec: SpecConfig, varlen: bool, state: DraftState, batch_seqs: int) -> int:
    """How many tokens to draft next: k, or with varlen the longest j whose j-th draft is still likely enough to be
    accepted. A draft row costs about as much as any row of the step; an accepted draft saves this sequence's share
    of a whole step, step / batch. With a step costing FIXED_ROWS rows plus one per row, drafting the j-th token pays
    while acceptance^j >= batch / (batch + FIXED_ROWS): 0.2 alone, 0.67 at 8 sequences, 0.89 at 32."""
    k = spec.num_speculative_tokens
    if not varlen:
        return k
    bar = batch_seqs / (batch_seqs + FIXED_ROWS)
    j = 0
    while j < k and state.acceptance ** (j + 1) >= bar:
        j += 1
    if j == 0:
        state.idle_steps += 1
        if state.idle_steps >= PROBE_EVERY:
            state.idle_steps = 0
            return 1
    return j


def record_acceptance(state: DraftState, drafted: int, accepted: int) -> None:
    if drafted:
        rate = accepted / drafted
        state.acceptance = EMA * state.acceptance + (1 - EMA) * rate


def propose(spec: SpecConfig, tokens: np.ndarray, length: int) -> list[int]:
    """Drafts for a sequence whose known tokens are `tokens`."""
    if length <= 0:
        return []
    if spec.speculative_method == "ngram":
        return propose_ngram(tokens, length, spec.ngram_min, spec.ngram_max)
    raise ValueError(f"no proposer for speculative_method={spec.speculative_method!r} in the worker")
