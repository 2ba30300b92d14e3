"""Pick one token per logits row: penalties, masks, greedy or seeded sampling, logprobs.

Every row's result is a function of that row alone (its logits, params, seed and
position): all reductions are per row (max, argmax, sequential cumsum, sort,
searchsorted), never across rows, and randomness comes from ``rng.uniform``
keyed by (seed, position), never from a shared generator. Rows are grouped only
to batch the tensor work.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.sample import rng
from deepinfer.sample.logprobs import logprob_dicts, ordered_top
from deepinfer.sample.penalties import PenaltyState
from deepinfer.sampling_params import SamplingParams

# Prefix lengths of the (logit descending, id ascending) order that topk tries
# for top-p rows, before falling back to sorting the whole vocabulary.
_ORDER_PREFIXES = (64, 1024, 8192)


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


@dataclass
class SamplerOutput:
    """Per row: the chosen token, and its logprobs if ``params.logprobs`` is set.

    A logprobs dict holds the top-N tokens (N = params.logprobs) in descending
    logprob order (ties: lower id first), then the sampled token if it is not
    among them, so its values never increase. Logprobs are those of the model's
    raw distribution: log_softmax of the logits before penalties, masks and
    temperature.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Chooses the next token for each row of a [N, V] float32 logits tensor. `argmax`: a replacement for
    torch.argmax(x, dim=-1) with the same results (the compiled CPU ops' argmax_rows, rows in parallel)."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 id_order: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        self.id_order = id_order  # the compiled ops' sample_id_order (see _sample_in_id_order), or None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        _check_inputs(logits, rows)
        logits = logits.float()
        if all(_is_plain_greedy(row, logits.shape[1]) for row in rows):
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(rows))

        processed = _process_logits(logits, rows)
        token_ids = [0] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        in_id_order = [i for i, row in enumerate(rows) if not row.params.greedy and not _needs_sort(row.params)]
        in_prob_order = [i for i, row in enumerate(rows) if not row.params.greedy and _needs_sort(row.params)]
        groups = (
            (greedy, lambda x, group: self.argmax(x)),
            (in_id_order, lambda x, group: _sample_in_id_order(x, group, self.id_order)),
            (in_prob_order, _sample_in_prob_order),
        )
        for indices, pick in groups:
            if indices:
                group = [rows[i] for i in indices]
                for i, token in zip(indices, pick(_take_rows(processed, indices), group).tolist()):
                    token_ids[i] = token
        return SamplerOutput(token_ids, _sampled_logprobs(logits, rows, token_ids))


def _check_inputs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [N, V] tensor, got {logits.dtype} of shape {tuple(logits.shape)}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"got {len(rows)} rows for {logits.shape[0]} logits rows; expected one per row")
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        mask = row.allowed_token_mask
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (vocab,)):
            raise ValueError(f"row {i}: allowed_token_mask must be bool of shape ({vocab},), got {mask.dtype} {tuple(mask.shape)}")


def plain_greedy_params(p: SamplingParams) -> bool:
    """Parameters whose rows are the argmax alone, unless a mask or min_tokens intervenes."""
    return p.greedy and p.logprobs is None and not has_penalties(p)


def _is_plain_greedy(row: SamplingRow, vocab: int) -> bool:
    return plain_greedy_params(row.params) and row.allowed_token_mask is None and not _suppresses_stops(row, vocab)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _suppressed_ids(row: SamplingRow, vocab: int) -> list[int]:
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    # An id outside the vocabulary can never be drawn, so suppressing it is vacuous.
    return sorted(t for t in row.eos_token_ids | set(row.params.stop_token_ids) if 0 <= t < vocab)


def _suppresses_stops(row: SamplingRow, vocab: int) -> bool:
    return bool(_suppressed_ids(row, vocab))


def _needs_sort(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0


def _take_rows(x: torch.Tensor, indices: list[int]) -> torch.Tensor:
    if len(indices) == x.shape[0]:  # indices are ascending and distinct, so this is every row in order
        return x
    return x[torch.tensor(indices, device=x.device)]


def _row_values(rows: Sequence[SamplingRow], get: Callable[[SamplingRow], float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [len(rows), 1] column of one per-row parameter."""
    return torch.tensor([get(row) for row in rows], dtype=dtype, device=device).unsqueeze(1)


# ---- logits processing: penalties, min_tokens, structured-output masks ----


def _process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits after penalties and masks; ``logits`` itself when none applies."""
    vocab = logits.shape[1]
    penalized = [i for i, row in enumerate(rows) if has_penalties(row.params)]
    suppressed = [(i, _suppressed_ids(row, vocab)) for i, row in enumerate(rows)]
    suppressed = [(i, ids) for i, ids in suppressed if ids]
    masked = [i for i, row in enumerate(rows) if row.allowed_token_mask is not None]
    if not (penalized or suppressed or masked):
        return logits

    x = logits.float().clone(memory_format=torch.contiguous_format)  # penalties index it flat
    if penalized:
        _apply_penalties_(x, penalized, rows)
    if suppressed:
        row_index = [i for i, ids in suppressed for _ in ids]
        token_index = [t for _, ids in suppressed for t in ids]
        x[torch.tensor(row_index, device=x.device), torch.tensor(token_index, device=x.device)] = float("-inf")
    if masked:
        index = torch.tensor(masked, device=x.device)
        allowed = torch.stack([rows[i].allowed_token_mask for i in masked]).to(x.device)
        x[index] = x[index].masked_fill(~allowed, float("-inf"))
    restricted = sorted({i for i, _ in suppressed} | set(masked))
    if restricted:
        nothing_left = torch.isneginf(x[torch.tensor(restricted, device=x.device)].amax(dim=-1))
        if nothing_left.any():
            i = restricted[int(nothing_left.nonzero()[0, 0])]
            raise ValueError(
                f"row {i}: no token is allowed (min_tokens={rows[i].params.min_tokens} suppresses "
                f"{_suppressed_ids(rows[i], vocab)} and the allowed_token_mask allows nothing else)"
            )
    return x


def _apply_penalties_(x: torch.Tensor, penalized: list[int], rows: Sequence[SamplingRow]) -> None:
    """Penalize rows ``penalized`` of the contiguous ``x`` in place.

    Repetition penalty (HF) over prompt and output tokens: positive logits
    divided, others multiplied. Then OpenAI presence and frequency penalties
    over output tokens: logit -= presence * (count > 0) + frequency * count.
    Only the logits of tokens that occur are read and written, so the cost is
    in the number of tokens, not rows times vocabulary; a token listed twice is
    written twice with the same value.
    """
    vocab = x.shape[1]
    flat = x.view(-1)
    repeated = [i for i in penalized if rows[i].params.repetition_penalty != 1.0]
    if repeated:
        sequences = [(i, seq) for i in repeated for seq in _repetition_sequences(rows[i])]
        positions, owners = _flat_positions(sequences, vocab, x.device)
        penalty = torch.tensor([rows[i].params.repetition_penalty for i, _ in sequences], device=x.device)[owners]
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / penalty, values * penalty)
    additive = [i for i in penalized if rows[i].params.presence_penalty != 0.0 or rows[i].params.frequency_penalty != 0.0]
    if additive:
        kept = [i for i in additive if rows[i].penalty_state is not None]  # counts kept as tokens arrived
        listed = [i for i in additive if rows[i].penalty_state is None]
        sequences = [(i, rows[i].penalty_state.output_ids) for i in kept] + [(i, rows[i].output_token_ids) for i in listed]
        positions, owners = _flat_positions(sequences, vocab, x.device)
        local = owners * vocab + positions % vocab
        counts = torch.zeros(len(sequences) * vocab, device=x.device)
        increments = [torch.from_numpy(rows[i].penalty_state.output_counts) for i in kept]
        increments.append(torch.ones(int(sum(len(rows[i].output_token_ids) for i in listed))))
        counts.scatter_add_(0, local, torch.cat(increments).to(x.device))
        count = counts[local]
        owner_rows = [i for i, _ in sequences]
        presence = torch.tensor([rows[i].params.presence_penalty for i in owner_rows], device=x.device)[owners]
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in owner_rows], device=x.device)[owners]
        flat[positions] = flat[positions] - presence * (count > 0) - frequency * count


def _repetition_sequences(row: SamplingRow) -> tuple[Sequence[int], ...]:
    """The tokens the repetition penalty reads: the distinct ones kept, or prompt and output as listed."""
    if row.penalty_state is not None:
        return (row.penalty_state.seen_ids,)
    return (row.prompt_token_ids, row.output_token_ids)


def _flat_positions(sequences: Sequence[tuple[int, Sequence[int]]], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For (row, token ids) pairs: each token's index into the flattened [N, V]
    logits, and the index of the pair it came from."""
    ids = [torch.as_tensor(seq, dtype=torch.long).reshape(-1) for _, seq in sequences]
    lengths = torch.tensor([len(seq) for seq in ids])
    tokens = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        for (row, _), seq in zip(sequences, ids):
            if seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= vocab):
                raise ValueError(f"row {row}: token ids must be in [0, {vocab}), got range [{int(seq.min())}, {int(seq.max())}]")
    owners = torch.arange(len(ids)).repeat_interleave(lengths)
    row_of_pair = torch.tensor([row for row, _ in sequences], dtype=torch.long)
    return (row_of_pair[owners] * vocab + tokens).to(device), owners.to(device)


# ---- sampling ----


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


def _sample_in_id_order(logits: torch.Tensor, rows: Sequence[SamplingRow],
                        compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """No top-k / top-p: the inverse CDF is taken over token ids in ascending order. `compiled` (sample_id_order)
    runs the same float64 sums in the same order without the [N, V] cdf; rows it leaves (-1: NaN weights) go the
    torch way."""
    weights = _weights(logits, rows)
    if compiled is not None and weights.device.type == "cpu":
        picked = compiled(weights, _uniforms(rows, weights.device))
        left = (picked < 0).nonzero().flatten().tolist()
        if left:
            cdf = _cdf(weights[left])
            picked[left] = _invert_cdf(cdf, cdf[:, -1], [rows[i] for i in left])
        return picked
    cdf = _cdf(weights)
    return _invert_cdf(cdf, cdf[:, -1], rows)


def _sample_in_prob_order(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """top-k / top-p over tokens ordered by (logit descending, id ascending).

    Ordering by the processed logits rather than the probabilities matches
    greedy, so top_k=1 is exactly greedy even where temperature rounds two
    probabilities to the same float. top-p keeps the shortest prefix whose mass
    reaches top_p of the mass left by min_p and top-k (without top-k: the
    id-order total, which needs no sort), always at least one token.

    Sorting the whole vocabulary is slow, so each row first tries prefixes of
    the order found by topk; only rows whose decision reaches past them are
    sorted in full. All give bit-identical results, since a prefix holds the
    same tokens in the same order and the sums run in the same order.
    """
    vocab = logits.shape[1]
    id_total = torch.zeros(len(rows), dtype=torch.float64, device=logits.device)
    without_top_k = [i for i, row in enumerate(rows) if row.params.top_k == 0]
    if without_top_k:
        subset = [rows[i] for i in without_top_k]
        id_total[without_top_k] = _cdf(_weights(_take_rows(logits, without_top_k), subset))[:, -1]

    # With top-k on every row, its largest k bounds what any row can keep; one entry more, because a prefix is
    # usable only up to its entries above its last (ordered_top), so a prefix of exactly k never decides a row.
    widths = list(_ORDER_PREFIXES) if without_top_k else [max(row.params.top_k for row in rows) + 1]
    tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    pending = list(range(len(rows)))
    for width in [w for w in widths if w < vocab] + [vocab]:
        group = [rows[i] for i in pending]
        x = _take_rows(logits, pending)
        if width < vocab:
            ordered = ordered_top(x, width)
        else:
            sorted_logits, order = torch.sort(x, dim=-1, descending=True, stable=True)
            everything = torch.ones(len(pending), dtype=torch.bool, device=logits.device)
            ordered = (sorted_logits, order, torch.full((len(pending),), vocab, device=logits.device), everything)
        picked, decided = _sample_sorted(*ordered, id_total[pending], group)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from the start of the sorted order: (token ids, whether each row's
    top-k / top-p decision falls within its ``usable`` entries)."""
    width = sorted_logits.shape[1]
    top_k = _row_values(rows, lambda r: r.params.top_k, torch.long, sorted_logits.device).squeeze(1)
    top_p = _row_values(rows, lambda r: r.params.top_p, torch.float64, sorted_logits.device)
    limit = torch.where(top_k > 0, torch.minimum(top_k, usable), usable)
    ranks = torch.arange(width, device=sorted_logits.device)
    cdf = _cdf(_weights(sorted_logits, rows).masked_fill(ranks >= limit.unsqueeze(1), 0.0))
    top_k_total = cdf.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
    total = torch.where(top_k > 0, top_k_total, id_total)
    mass_before = torch.nn.functional.pad(cdf[:, :-1], (1, 0))
    num_kept = (mass_before < top_p * total.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    kept_total = cdf.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    # Rows left undecided may have no mass in their prefix; clamp so their
    # (discarded) pick stays in bounds.
    picked = _invert_cdf(cdf, kept_total, rows).clamp(max=width - 1)
    reached = torch.where(top_k > 0, top_k <= usable, cdf[:, -1] >= top_p.squeeze(1) * total)
    return sorted_ids.gather(1, picked.unsqueeze(1)).squeeze(1), complete | reached


# ---- logprobs ----


def _sampled_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: list[int]) -> list[dict[int, float] | None]:
    result: list[dict[int, float] | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    logprobs = torch.log_softmax(_take_rows(logits, wanted).float(), dim=-1)
    dicts = logprob_dicts(logprobs, [token_ids[i] for i in wanted], [rows[i].params.logprobs for i in wanted])
    for i, d in zip(wanted, dicts):
        result[i] = d
    return result


