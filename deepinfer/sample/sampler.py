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

from deepinfer.sample.logprobs import logprob_dicts
from deepinfer.sample.prob_order import ProbOrderOps, sample_in_prob_order
from deepinfer.sample.rows import SamplingRow, _cdf, _invert_cdf, _take_rows, _uniforms, _weights
from deepinfer.sampling_params import SamplingParams

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
    torch.argmax(x, dim=-1) with the same results (the compiled CPU ops' argmax_rows, rows in parallel);
    `prob_order`: the compiled ops for top-k / top-p rows (ProbOrderOps)."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 id_order: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 prob_order: ProbOrderOps | None = None) -> None:
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        self.id_order = id_order  # the compiled ops' sample_id_order (see _sample_in_id_order), or None
        self.prob_order = prob_order

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
            (in_prob_order, lambda x, group: sample_in_prob_order(x, group, self.prob_order)),
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
    return (p.greedy and p.logprobs is None and not has_penalties(p) and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_words_token_ids)


def _is_plain_greedy(row: SamplingRow, vocab: int) -> bool:
    return plain_greedy_params(row.params) and row.allowed_token_mask is None and not _suppresses_stops(row, vocab)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _suppressed_ids(row: SamplingRow, vocab: int) -> list[int]:
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    # An id outside the vocabulary can never be drawn, so suppressing it is vacuous.
    return sorted(t for t in row.eos_token_ids | set(row.params.stop_token_ids) if 0 <= t < vocab)


def _bad_word_ids(row: SamplingRow, vocab: int) -> list[int]:
    """The last token of each bad word whose tokens before it end the output so far."""
    out, banned = row.output_token_ids, set()
    for seq in row.params.bad_words_token_ids or ():
        if len(seq) == 1 or (len(out) >= len(seq) - 1 and list(out[len(out) - len(seq) + 1:]) == seq[:-1]):
            banned.add(seq[-1])
    return sorted(t for t in banned if t < vocab)


def _suppresses_stops(row: SamplingRow, vocab: int) -> bool:
    return bool(_suppressed_ids(row, vocab))


def _needs_sort(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0


# ---- logits processing: logit bias, penalties, min_tokens, structured-output masks ----


def _process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits after bias, penalties and masks; ``logits`` itself when none applies."""
    vocab = logits.shape[1]
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    penalized = [i for i, row in enumerate(rows) if has_penalties(row.params)]
    suppressed = [(i, _suppressed_ids(row, vocab)) for i, row in enumerate(rows)]
    suppressed = [(i, ids) for i, ids in suppressed if ids]
    masked = [i for i, row in enumerate(rows) if row.allowed_token_mask is not None]
    listed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    bad = [(i, _bad_word_ids(row, vocab)) for i, row in enumerate(rows) if row.params.bad_words_token_ids]
    bad = [(i, ids) for i, ids in bad if ids]
    if not (biased or penalized or suppressed or masked or listed or bad):
        return logits

    x = logits.float().clone(memory_format=torch.contiguous_format)  # penalties index it flat
    if biased:  # before the penalties, as vLLM adds it; ids past the logits' width do not exist
        entries = [(i, t, b) for i in biased for t, b in rows[i].params.logit_bias.items() if t < vocab]
        if entries:
            r, t, b = zip(*entries)
            x.index_put_((torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)),
                         torch.tensor(b, dtype=x.dtype, device=x.device), accumulate=True)
    if penalized:
        _apply_penalties_(x, penalized, rows)
    for i in listed:  # every other token of the row to -inf
        ids = torch.tensor([t for t in rows[i].params.allowed_token_ids if t < vocab], dtype=torch.int64, device=x.device)
        kept = x[i, ids]
        x[i] = float("-inf")
        x[i, ids] = kept
    if suppressed:
        row_index = [i for i, ids in suppressed for _ in ids]
        token_index = [t for _, ids in suppressed for t in ids]
        x[torch.tensor(row_index, device=x.device), torch.tensor(token_index, device=x.device)] = float("-inf")
    if masked:
        index = torch.tensor(masked, device=x.device)
        allowed = torch.stack([rows[i].allowed_token_mask for i in masked]).to(x.device)
        x[index] = x[index].masked_fill(~allowed, float("-inf"))
    restricted = sorted({i for i, _ in suppressed} | set(masked) | set(listed))
    if restricted:
        nothing_left = torch.isneginf(x[torch.tensor(restricted, device=x.device)].amax(dim=-1))
        if nothing_left.any():
            i = restricted[int(nothing_left.nonzero()[0, 0])]
            raise ValueError(
                f"row {i}: no token is allowed (min_tokens={rows[i].params.min_tokens} suppresses "
                f"{_suppressed_ids(rows[i], vocab)} and the allowed tokens are nothing else)"
            )
    for i, ids in bad:  # last, and only where they leave a token to draw: a bad word never fails a request
        index = torch.tensor(ids, dtype=torch.int64, device=x.device)
        kept = x[i, index]
        x[i, index] = float("-inf")
        if torch.isneginf(x[i].amax()):
            x[i, index] = kept
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


