"""One logits row as the sampler sees it, and the per-row tensor helpers the sampling paths share: weights after
temperature and min_p, their float64 cdf, its inversion by the row's counter-based uniform."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.sample import rng
from deepinfer.sample.penalties import PenaltyState
from deepinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one logits row.

    ``eos_token_ids`` and ``params.stop_token_ids`` get logit -inf while fewer than
    ``params.min_tokens`` tokens have been generated, even with ``ignore_eos`` and
    even where ``allowed_token_mask`` allows them: min_tokens always wins.
    ``allowed_token_mask`` (bool [V], structured output) sets disallowed tokens
    to -inf after penalties and before temperature / min_p / top-k / top-p, for
    greedy rows too.
    """

    params: SamplingParams
    seed: int  # resolved per-request seed: seq_seed, or one the engine chose at arrival
    position: int  # index of the output token being drawn (0 = first generated token)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, for penalties and min_tokens
    eos_token_ids: frozenset[int]
    allowed_token_mask: torch.Tensor | None = None
    # the same tokens kept as penalties read them (sample/penalties.py); None: read from the two lists above
    penalty_state: PenaltyState | None = None


def _take_rows(x: torch.Tensor, indices: list[int]) -> torch.Tensor:
    if len(indices) == x.shape[0]:  # indices are ascending and distinct, so this is every row in order
        return x
    return x[torch.tensor(indices, device=x.device)]


def _row_values(rows: Sequence[SamplingRow], get: Callable[[SamplingRow], float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [len(rows), 1] column of one per-row parameter."""
    return torch.tensor([get(row) for row in rows], dtype=dtype, device=device).unsqueeze(1)


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    return torch.tensor([rng.uniform(row.seed, row.position) for row in rows], dtype=torch.float64, device=device)


def _weights(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Unnormalized probabilities after temperature and min_p, scaled so the largest is 1.

    min_p drops tokens whose probability is below min_p times the largest one,
    which with this scaling is a comparison against min_p itself.
    """
    temperature = _row_values(rows, lambda r: r.params.temperature, logits.dtype, logits.device)
    weights = logits / temperature  # a fresh tensor, so the rest can work in place
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    if any(row.params.min_p > 0.0 for row in rows):
        min_p = _row_values(rows, lambda r: r.params.min_p, weights.dtype, weights.device)
        weights.masked_fill_(weights < min_p, 0.0)
    return weights


def _cdf(weights: torch.Tensor) -> torch.Tensor:
    # float64 so that tokens far below the running total still move it; torch's
    # CPU cumsum adds each row sequentially, so the order is fixed per row.
    return weights.to(torch.float64, copy=True).cumsum_(dim=-1)


def _invert_cdf(cdf: torch.Tensor, total: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Index of the first entry of each (non-decreasing) ``cdf`` row above u * total.

    An entry with zero weight never qualifies before the positive one it follows,
    so the result always has positive weight. u < 1, but u * total can round up
    to total, so the target is kept strictly below it.
    """
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(_uniforms(rows, cdf.device) * total, below_total)
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
