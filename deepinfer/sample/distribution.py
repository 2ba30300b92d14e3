"""The distribution the sampler draws from, as an explicit probability vector per row (speculative verification
needs p(token) for any token, not one draw).

The same steps as sampler.py, in the same order: penalties, min_tokens suppression and grammar masks; temperature
and min_p; top-k and top-p over tokens ordered by (logit descending, id ascending), keeping the shortest prefix
whose mass reaches top_p of the mass left (always at least one token); then normalised, in float64.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sample.sampler import SamplingRow, _cdf, _needs_sort, _process_logits, _weights


def target_probabilities(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[N, V] float64 rows summing to 1. Rows must not be greedy (temperature 0: use the argmax)."""
    if any(row.params.greedy for row in rows):
        raise ValueError("target_probabilities is for sampled rows; a greedy row's distribution is its argmax")
    processed = _process_logits(logits.float(), rows)
    weights = _weights(processed, rows).to(torch.float64)
    out = torch.zeros_like(weights)
    for i, row in enumerate(rows):
        w = weights[i]
        if _needs_sort(row.params):
            order = torch.sort(processed[i], descending=True, stable=True).indices
            sorted_w = w[order]
            top_k = row.params.top_k
            total = float(_cdf(sorted_w[:top_k].unsqueeze(0))[0, -1]) if top_k > 0 else float(_cdf(w.unsqueeze(0))[0, -1])
            if top_k > 0:
                sorted_w[top_k:] = 0.0
            cdf = _cdf(sorted_w.unsqueeze(0))[0]
            mass_before = torch.nn.functional.pad(cdf[:-1], (1, 0))
            kept = int((mass_before < row.params.top_p * total).sum().clamp(min=1))
            kept = min(kept, top_k) if top_k > 0 else kept
            out[i, order[:kept]] = sorted_w[:kept]
        else:
            out[i] = w
    return out / out.sum(dim=-1, keepdim=True)
