"""Speculative verification: which draft tokens the target model accepts, and the token it adds after them.

Greedy rows: a draft is accepted while it equals the target's argmax at its position; the first mismatch is replaced
by the target's argmax, and when every draft is accepted the target's next argmax is added (the bonus token). The
output equals plain greedy decoding token for token.

Sampled rows, the standard rule (Leviathan et al. 2023; Chen et al. 2023): with target distribution p and draft
distribution q at a position, draft d is accepted with probability min(1, p(d) / q(d)); a rejected draft is
replaced by a sample from the residual max(0, p - q) / sum(max(0, p - q)), and verification stops. Every emitted
token is then distributed exactly as p. A deterministic draft (n-gram) is q = one-hot(d): accepted with
probability p(d), residual p without d. Randomness is counter-based per request and position (sample/rng.py):
draw 1 decides acceptance, draw 2 samples a residual, draw 0 samples the bonus as the plain sampler would.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sample import rng

ACCEPT_DRAW, RESIDUAL_DRAW, BONUS_DRAW = 1, 2, 0


def verify_greedy(target_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """target_ids: the target's argmax at each of the len(drafts) + 1 positions. Returns the tokens to emit."""
    out: list[int] = []
    for target, draft in zip(target_ids, drafts):
        out.append(target)
        if target != draft:
            return out
    out.append(target_ids[len(drafts)])
    return out


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF over token ids of a non-negative [V] float64 vector (need not be normalized)."""
    cdf = probs.cumsum(0)
    total = cdf[-1]
    target = min(u * float(total), float(torch.nextafter(total, torch.zeros_like(total))))
    return int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype, device=cdf.device), right=True)[0])


def verify_sampled(target: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                   seed: int, first_position: int) -> list[int]:
    """target: [k + 1, V] float64 target distributions (rows sum to 1) at the draft positions and the bonus one;
    draft_probs: [k, V] the proposer's distributions, or None for deterministic drafts. first_position: the output
    index of the first draft. Returns the tokens to emit (1 to k + 1)."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        position = first_position + i
        p = target[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        accept = q_d > 0 and rng.uniform(seed, position, ACCEPT_DRAW) < min(1.0, float(p[draft]) / q_d)
        if accept:
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p equals q (or is one-hot on d): the draft could not be rejected
            out.append(draft)
            continue
        out.append(sample_from(residual, rng.uniform(seed, position, RESIDUAL_DRAW)))
        return out
    position = first_position + len(drafts)
    out.append(sample_from(target[len(drafts)], rng.uniform(seed, position, BONUS_DRAW)))
    return out
