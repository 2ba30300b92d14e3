"""Top-k / top-p rows: tokens in (logit descending, id ascending) order, from prefixes found by topk or from the
whole row sorted, the decision taken on float64 sums in that order (with compiled ops on the CPU: a radix sort and
the decision without a cdf tensor, the same results)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.sample.logprobs import ordered_top
from deepinfer.sample.rows import SamplingRow, _cdf, _invert_cdf, _row_values, _take_rows, _uniforms, _weights

# Prefix lengths of the (logit descending, id ascending) order that topk tries
# for top-p rows, before falling back to sorting the whole vocabulary. With the
# compiled ops (ordered_prefix, then the radix sort): SmolLM2 chat rows at batch
# 64, temperature 0.8, top_p 0.95, sampler per step 7.0 / 5.9 ms with (64,),
# 5.4 / 4.7 with (64, 1024), 5.1 / 4.6 with (64, 512, 4096); N(0, 1) rows
# (nucleus past any prefix) 44 / 50 / 74 ms a call.
_ORDER_PREFIXES = (64, 1024, 8192)
_ORDER_PREFIXES_BEFORE_RADIX = (64, 1024)


@dataclass(frozen=True)
class ProbOrderOps:
    """Compiled ops for rows in probability order (the CPU ops' sort_descending, sample_sorted, row_sums and
    ordered_prefix): the same results as the torch calls they replace."""

    sort: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    decide: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    totals: Callable[[torch.Tensor], torch.Tensor]
    prefix: Callable[[torch.Tensor, int], Sequence[torch.Tensor]]

    @classmethod
    def of(cls, kernels: ModuleType) -> ProbOrderOps:
        return cls(kernels.sort_descending, kernels.sample_sorted, kernels.row_sums, kernels.ordered_prefix)


def sample_in_prob_order(logits: torch.Tensor, rows: Sequence[SamplingRow],
                          ops: ProbOrderOps | None = None) -> torch.Tensor:
    """top-k / top-p over tokens ordered by (logit descending, id ascending).

    Ordering by the processed logits rather than the probabilities matches
    greedy, so top_k=1 is exactly greedy even where temperature rounds two
    probabilities to the same float. top-p keeps the shortest prefix whose mass
    reaches top_p of the mass left by min_p and top-k (without top-k: the
    id-order total, which needs no sort), always at least one token.

    Sorting the whole vocabulary is slow, so each row first tries prefixes of
    the order found by topk; only rows whose decision reaches past them are
    sorted in full. All give bit-identical results, since a prefix holds the
    same tokens in the same order and the sums run in the same order. With
    `ops` (compiled: a radix sort linear in the vocabulary, the decision without
    a cdf tensor) the whole sort costs less than topk's widest prefix, so only
    the narrow prefixes come first.
    """
    vocab = logits.shape[1]
    compiled = ops is not None and logits.device.type == "cpu"
    id_total = torch.zeros(len(rows), dtype=torch.float64, device=logits.device)
    without_top_k = [i for i, row in enumerate(rows) if row.params.top_k == 0]
    if without_top_k:
        subset = [rows[i] for i in without_top_k]
        weights = _weights(_take_rows(logits, without_top_k), subset)
        id_total[without_top_k] = ops.totals(weights) if compiled else _cdf(weights)[:, -1]

    # With top-k on every row, its largest k bounds what any row can keep; one entry more, because a prefix is
    # usable only up to its entries above its last (ordered_top), so a prefix of exactly k never decides a row.
    prefixes = _ORDER_PREFIXES_BEFORE_RADIX if compiled else _ORDER_PREFIXES
    widths = list(prefixes) if without_top_k else [max(row.params.top_k for row in rows) + 1]
    tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    pending = list(range(len(rows)))
    for width in [w for w in widths if w < vocab] + [vocab]:
        group = [rows[i] for i in pending]
        x = _take_rows(logits, pending)
        if width < vocab:
            ordered = ops.prefix(x, width) if compiled else ordered_top(x, width)
        else:
            sorted_logits, order = (ops.sort(x) if compiled
                                    else torch.sort(x, dim=-1, descending=True, stable=True))
            everything = torch.ones(len(pending), dtype=torch.bool, device=logits.device)
            ordered = (sorted_logits, order, torch.full((len(pending),), vocab, device=logits.device), everything)
        picked, decided = _sample_sorted(*ordered, id_total[pending], group, ops.decide if compiled else None)
        done = decided.tolist()
        tokens[[i for i, d in zip(pending, done) if d]] = picked[decided]
        pending = [i for i, d in zip(pending, done) if not d]
        if not pending:
            break
    return tokens


def _sample_sorted(
    sorted_logits: torch.Tensor,
    sorted_ids: torch.Tensor,
    usable: torch.Tensor,
    complete: torch.Tensor,
    id_total: torch.Tensor,
    rows: Sequence[SamplingRow],
    decide: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from the start of the sorted order: (token ids, whether each row's
    top-k / top-p decision falls within its ``usable`` entries). `decide`: the
    compiled sample_sorted (the same sums in the same order, no cdf tensor);
    rows it leaves (-1: NaN weights) go the torch way."""
    top_k = _row_values(rows, lambda r: r.params.top_k, torch.long, sorted_logits.device).squeeze(1)
    top_p = _row_values(rows, lambda r: r.params.top_p, torch.float64, sorted_logits.device)
    limit = torch.where(top_k > 0, torch.minimum(top_k, usable), usable)
    weights = _weights(sorted_logits, rows)
    if decide is not None:
        picked, decided = decide(weights, limit, top_k, top_p.squeeze(1), id_total, _uniforms(rows, weights.device),
                                 usable, complete)
        left = (picked < 0).nonzero().flatten().tolist()
        if left:
            cdf = _masked_cdf(weights[left], limit[left])
            picked[left], decided[left] = _decide_from_cdf(cdf, top_k[left], top_p[left], id_total[left], usable[left],
                                                           complete[left], [rows[i] for i in left])
        return sorted_ids.gather(1, picked.unsqueeze(1)).squeeze(1), decided
    picked, decided = _decide_from_cdf(_masked_cdf(weights, limit), top_k, top_p, id_total, usable, complete, rows)
    return sorted_ids.gather(1, picked.unsqueeze(1)).squeeze(1), decided


def _masked_cdf(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    ranks = torch.arange(weights.shape[1], device=weights.device)
    return _cdf(weights.masked_fill(ranks >= limit.unsqueeze(1), 0.0))


def _decide_from_cdf(cdf: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, id_total: torch.Tensor,
                     usable: torch.Tensor, complete: torch.Tensor, rows: Sequence[SamplingRow]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the sorted order, decided) from a row's float64 cdf; top_p [N, 1]."""
    width = cdf.shape[1]
    top_k_total = cdf.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
    total = torch.where(top_k > 0, top_k_total, id_total)
    mass_before = torch.nn.functional.pad(cdf[:, :-1], (1, 0))
    num_kept = (mass_before < top_p * total.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    kept_total = cdf.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    # Rows left undecided may have no mass in their prefix; clamp so their
    # (discarded) pick stays in bounds.
    picked = _invert_cdf(cdf, kept_total, rows).clamp(max=width - 1)
    reached = torch.where(top_k > 0, top_k <= usable, cdf[:, -1] >= top_p.squeeze(1) * total)
    return picked, complete | reached
