"""Deterministic top-k by (value descending, id ascending), and logprob dicts built on it."""
from __future__ import annotations

from collections.abc import Sequence

import torch

_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per log_softmax, to bound the extra [chunk, V] memory


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num: int) -> list[dict[int, float]]:
    """Logprobs of each prompt token given the ones before it.

    ``logits[i]`` is the model's output at prompt position i and
    ``next_token_ids[i]`` the prompt token at i + 1. Each dict holds the top-``num``
    tokens in descending order (ties: lower id first), then the actual next token
    if it is not among them.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if len(next_token_ids) != logits.shape[0]:
        raise ValueError(f"got {len(next_token_ids)} next_token_ids for {logits.shape[0]} logits rows; expected one per row")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    result: list[dict[int, float]] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        chunk = logits[start : start + _PROMPT_LOGPROBS_CHUNK]
        actual = next_token_ids[start : start + _PROMPT_LOGPROBS_CHUNK]
        result += logprob_dicts(torch.log_softmax(chunk.float(), dim=-1), actual, [num] * chunk.shape[0])
    return result


def logprob_dicts(logprobs: torch.Tensor, chosen: Sequence[int], nums: Sequence[int]) -> list[dict[int, float]]:
    """Per row of ``logprobs``: the top nums[i] tokens in descending order, then chosen[i] if absent."""
    vocab = logprobs.shape[1]
    if any(not 0 <= token < vocab for token in chosen):
        raise ValueError(f"token ids must be in [0, {vocab}), got {[t for t in chosen if not 0 <= t < vocab]}")
    top_ids, top_values = top_logprobs(logprobs, min(max(nums), vocab))
    chosen_values = logprobs.gather(1, torch.tensor(list(chosen), device=logprobs.device).unsqueeze(1)).squeeze(1)
    result = []
    for ids, values, token, value, num in zip(top_ids.tolist(), top_values.tolist(), chosen, chosen_values.tolist(), nums):
        d = dict(zip(ids[:num], values[:num]))
        d.setdefault(token, value)
        result.append(d)
    return result


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and values of the k largest entries of each row, by (value descending, id ascending).

    Rows where entries tied with the k-th value run past the topk prefix (so
    topk's arbitrary choice among them could show) are sorted in full instead.
    """
    if k == 0:
        empty = logprobs.new_empty(logprobs.shape[0], 0)
        return empty.long(), empty
    values, ids, usable, _ = ordered_top(logprobs, k)
    tied = (logprobs == values[:, -1:]).sum(dim=-1)
    cut = ((k - usable) != tied) & (k < logprobs.shape[1])
    if cut.any():
        index = cut.nonzero().squeeze(1)
        full_values, full_ids = torch.sort(logprobs[index], dim=-1, descending=True, stable=True)
        values[index], ids[index] = full_values[:, :k], full_ids[:, :k]
    return ids, values


def ordered_top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first k entries of each row in (value descending, id ascending) order, via topk.

    Returns values [m, k], ids [m, k], ``usable`` [m]: how many leading entries
    are certainly the start of the full order (topk picks arbitrarily among
    entries tied with the k-th, so those are left out unless nothing is left
    out of the prefix), and ``complete`` [m]: whether every entry outside the
    prefix is -inf (or there is none).
    """
    top, ids = values.topk(k, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    top, by_value = top.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    kth = top[:, -1]
    complete = torch.isneginf(kth) | (k == values.shape[1])
    usable = torch.where(complete, k, (top > kth.unsqueeze(1)).sum(dim=-1))
    return top, ids, usable, complete
