"""The sampler's contract: greedy, filters, penalties, masks, seeded batch-independent draws, logprobs."""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.sample import Sampler, SamplingRow, compute_prompt_logprobs
from deepinfer.sample import rng
from deepinfer.sample import prob_order as prob_order_module
from deepinfer.sampling_params import SamplingParams

sampler = Sampler()


def row(params: SamplingParams | None = None, seed: int = 0, position: int = 0, prompt=(), output=(), eos=(), mask=None) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        seed=seed,
        position=position,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=frozenset(eos),
        allowed_token_mask=mask,
    )


def draws(logits: list[float], params: SamplingParams, seeds: range, **kw) -> list[int]:
    """One token per seed, all drawn in a single batch."""
    batch = torch.tensor([logits] * len(seeds))
    return sampler(batch, [row(params, seed=s, **kw) for s in seeds]).token_ids


GREEDY = SamplingParams(temperature=0)


# ---- greedy and filters ----


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [row(GREEDY) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("logprobs", [None, 2])
def test_greedy_ties_go_to_lowest_id(logprobs):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    out = sampler(logits, [row(GREEDY.replace(logprobs=logprobs))] * 2)
    assert out.token_ids == [1, 0]


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)):
        assert sampler(logits, [row(params, seed=s) for s in range(32)]).token_ids == expected


def test_top_k_1_ties_go_to_lowest_id():
    params = SamplingParams(top_k=1)
    assert set(draws([0.0, 2.0, 1.0, 2.0], params, range(50))) == {1}


# probabilities 0.5, 0.3, 0.15, 0.05
FOUR = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(min_p=0.25), {0, 1, 2}),  # drops p < 0.125
        (SamplingParams(min_p=0.5), {0, 1}),  # drops p < 0.25
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),
        (SamplingParams(min_p=0.25, top_p=0.99), {0, 1, 2}),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(params, support):
    assert set(draws(FOUR, params, range(400))) == support


def test_min_p_equals_sampling_with_dropped_tokens_removed():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(2)).tolist()
    probs = torch.softmax(torch.tensor(logits), dim=-1)
    removed = [x if p >= 0.1 * probs.max() else float("-inf") for x, p in zip(logits, probs)]
    seeds = range(300)
    assert draws(logits, SamplingParams(min_p=0.1), seeds) == draws(removed, SamplingParams(), seeds)


# ---- penalties (dyadic values, so the expected logits are exact) ----

BASE = [2.0, -1.0, 0.5, 3.0, -0.5, 0.25]
PROMPT = [0, 1]
OUTPUT = [1, 3, 3]


@pytest.mark.parametrize(
    "params, expected",
    [
        # seen = {0, 1, 3}: positive logits halved, negative doubled
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -0.5, 0.25]),
        # output only: token 1 once, token 3 twice
        (SamplingParams(presence_penalty=0.5), [2.0, -1.5, 0.5, 2.5, -0.5, 0.25]),
        (SamplingParams(frequency_penalty=0.25), [2.0, -1.25, 0.5, 2.5, -0.5, 0.25]),
        (SamplingParams(presence_penalty=-1.0), [2.0, 0.0, 0.5, 4.0, -0.5, 0.25]),
        (
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [1.0, -2.75, 0.5, 0.5, -0.5, 0.25],
        ),
    ],
)
def test_penalties_match_hand_computed_logits(params, expected):
    seeds = range(200)
    penalized = draws(BASE, params, seeds, prompt=PROMPT, output=OUTPUT)
    plain = draws(expected, SamplingParams(temperature=params.temperature), seeds)
    assert penalized == plain
    greedy = params.replace(temperature=0)
    assert draws(BASE, greedy, range(1), prompt=PROMPT, output=OUTPUT) == [max(range(6), key=lambda t: (expected[t], -t))]


def test_repetition_penalty_changes_greedy_choice_and_not_logprobs():
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)
    out = sampler(logits, [row(params, prompt=[1])])
    assert out.token_ids == [2]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == {1: raw[1].item(), 2: raw[2].item()}


def test_penalties_read_non_contiguous_logits():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(500, 6, generator=gen).t()  # a transposed view: rows are strided
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logprobs=2)
    rows = [row(params, seed=s, prompt=[1, 2, 3], output=[3, 3, 7, 499]) for s in range(6)]
    assert sampler(logits, rows) == sampler(logits.contiguous(), rows)


# ---- min_tokens and structured-output masks ----


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_suppresses_eos_and_stop_ids(ignore_eos):
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=ignore_eos)
    assert sampler(logits, [row(params, output=[3], eos={0})]).token_ids == [2]
    assert sampler(logits, [row(params, output=[3, 3], eos={0})]).token_ids == [0]
    sampled = params.replace(temperature=1.0)
    assert set(draws(logits[0].tolist(), sampled, range(300), output=[3], eos={0, 7})) == {2, 3}


def test_allowed_mask_is_respected_greedy_and_sampled():
    logits = [5.0, 4.0, 3.0, 2.0, 1.0]
    mask = torch.tensor([False, True, False, True, False])
    assert draws(logits, GREEDY, range(1), mask=mask) == [1]
    assert set(draws(logits, SamplingParams(), range(300), mask=mask)) == {1, 3}
    assert set(draws(logits, SamplingParams(top_k=1), range(50), mask=mask)) == {1}


def test_min_tokens_wins_over_the_allowed_mask():
    mask = torch.tensor([True, False, True])
    params = SamplingParams(temperature=0, min_tokens=1)
    assert draws([9.0, 1.0, 0.0], params, range(1), eos={0}, mask=mask) == [2]
    with pytest.raises(ValueError, match="no token is allowed"):
        draws([9.0, 1.0, 0.0], params, range(1), eos={0}, mask=torch.tensor([True, False, False]))


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="one per row"):
        sampler(torch.zeros(2, 4), [row()])
    with pytest.raises(ValueError, match="allowed_token_mask"):
        sampler(torch.zeros(1, 4), [row(mask=torch.ones(3, dtype=torch.bool))])
    with pytest.raises(ValueError, match="token ids"):
        sampler(torch.zeros(1, 4), [row(SamplingParams(presence_penalty=1.0), output=[4])])


# ---- seeded randomness ----


def test_rng_is_a_pure_function_in_unit_interval():
    values = [rng.uniform(seed, pos, draw) for seed in (0, 1, -5, 2**63 + 12345) for pos in range(50) for draw in range(3)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert rng.uniform(42, 7, 1) == rng.uniform(42, 7, 1)
    with pytest.raises(ValueError):
        rng.uniform(0, -1)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.9, top_p=0.95)
    first = draws(logits, params, range(64))
    assert draws(logits, params, range(64)) == first
    assert len(set(first)) > 10
    moved = sampler(torch.tensor([logits] * 64), [row(params, seed=s, position=1) for s in range(64)]).token_ids
    assert moved != first


def random_row(pick: Callable[[Sequence], Any], integer: Callable[[int, int], int], vocab: int) -> SamplingRow:
    """A row with varied params, drawn through ``pick`` / ``integer`` (hypothesis or random.Random)."""
    params = SamplingParams(
        temperature=pick([0.0, 0.5, 1.0, 1.7]),
        top_k=pick([0, 1, 5, 50]),
        top_p=pick([1.0, 0.9, 0.3]),
        min_p=pick([0.0, 0.05]),
        presence_penalty=pick([0.0, 0.5]),
        frequency_penalty=pick([0.0, -0.3]),
        repetition_penalty=pick([1.0, 1.2]),
        min_tokens=pick([0, 0, 3]),
        logprobs=pick([None, 0, 3]),
    )
    mask = None
    if pick([False, True]):
        mask = torch.rand(vocab, generator=torch.Generator().manual_seed(integer(0, 999))) < 0.5
        mask[vocab - 1] = True  # min_tokens below never suppresses it, so some token is always allowed
    return row(
        params,
        seed=integer(-(2**63), 2**64),
        position=integer(0, 10_000),
        prompt=[integer(0, vocab - 1) for _ in range(integer(0, 8))],
        output=[integer(0, vocab - 1) for _ in range(integer(0, 6))],
        eos={0, 1},
        mask=mask,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_row_depends_only_on_itself(data):
    vocab = data.draw(st.sampled_from([7, 128, 3000]))
    batch_size = data.draw(st.integers(1, 64))
    target = data.draw(st.integers(0, batch_size - 1))
    neighbours = random.Random(data.draw(st.integers(0, 2**32)))
    rows = [random_row(neighbours.choice, neighbours.randint, vocab) for _ in range(batch_size)]
    rows[target] = random_row(lambda xs: data.draw(st.sampled_from(xs)), lambda a, b: data.draw(st.integers(a, b)), vocab)
    scale = data.draw(st.sampled_from([0.05, 4.0]))  # flat rows reach past the topk prefix into a full sort
    logits = torch.randn(batch_size, vocab, generator=torch.Generator().manual_seed(neighbours.randrange(2**32))) * scale

    alone = sampler(logits[target : target + 1].clone(), [rows[target]])
    together = sampler(logits, rows)
    assert together.token_ids[target] == alone.token_ids[0]
    assert together.logprobs[target] == alone.logprobs[0]
    if alone.logprobs[0] is not None:
        assert list(together.logprobs[target]) == list(alone.logprobs[0])

    order = list(range(batch_size))
    neighbours.shuffle(order)
    shuffled = sampler(logits[order], [rows[i] for i in order])
    where = order.index(target)
    assert shuffled.token_ids[where] == alone.token_ids[0]
    assert shuffled.logprobs[where] == alone.logprobs[0]


def test_wide_nucleus_and_wide_ties_reach_past_the_topk_prefix():
    vocab = 12000
    flat = torch.linspace(0.0, 1.0, vocab).flip(0)  # probabilities fall slowly with the id
    probs = torch.softmax(flat, dim=-1)
    nucleus = int((torch.cumsum(probs, 0) - probs < 0.9).sum())
    assert nucleus > max(prob_order_module._ORDER_PREFIXES)
    tokens = draws(flat.tolist(), SamplingParams(top_p=0.9), range(40))
    assert max(tokens) < nucleus and max(tokens) > max(prob_order_module._ORDER_PREFIXES)

    tied = [0.0] * 1000 + [1.0] * 9000 + [0.5] * 2000  # 9000 tokens tied at the top
    assert set(draws(tied, SamplingParams(top_k=1), range(5))) == {1000}
    assert set(draws(tied, SamplingParams(top_p=1e-6), range(5))) == {1000}
    assert set(draws(tied, SamplingParams(top_k=8500), range(20))) <= set(range(1000, 9500))
    out = sampler(torch.tensor([tied]), [row(SamplingParams(logprobs=3))])
    assert list(out.logprobs[0])[:3] == [1000, 1001, 1002]


def test_results_do_not_depend_on_the_topk_prefix_length(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(48, 3000, generator=gen) * torch.tensor([0.05, 1.0, 4.0]).repeat(16).unsqueeze(1)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=200, top_p=0.95), SamplingParams(top_k=50, min_p=0.01)]
    rows = [row(params[i % 3], seed=i, position=i) for i in range(48)]
    default = sampler(logits, rows).token_ids
    for prefixes in ((1,), (16, 64), (3000,)):
        monkeypatch.setattr(prob_order_module, "_ORDER_PREFIXES", prefixes)
        assert sampler(logits, rows).token_ids == default


def test_top_k_rows_are_decided_without_sorting_the_vocabulary(monkeypatch):
    """All rows top-k: topk's prefix of k + 1 decides them (the whole-row sort is for ties at the k-th value only);
    the same tokens as with the whole row sorted."""
    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    logits = torch.randn(32, vocab, generator=gen) * 3
    rows = [row(SamplingParams(temperature=0.8, top_k=(50, 7, 1, 200)[i % 4], top_p=(1.0, 0.9)[i % 2]), seed=i,
                position=i) for i in range(32)]
    sorted_widths = []
    real_sort = torch.sort

    def counting_sort(x, *args, **kwargs):
        sorted_widths.append(x.shape[-1])
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    fast = sampler(logits, rows).token_ids
    assert vocab not in sorted_widths

    def undecided(values, k):  # no prefix is usable: every row goes on to the whole-row sort
        top, ids, usable, complete = real_ordered_top(values, k)
        return top, ids, torch.zeros_like(usable), torch.zeros_like(complete)

    real_ordered_top = prob_order_module.ordered_top
    monkeypatch.setattr(prob_order_module, "ordered_top", undecided)
    assert sampler(logits, rows).token_ids == fast and vocab in sorted_widths


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(), 8),
        (SamplingParams(temperature=0.6), 8),
        (SamplingParams(top_k=5), 5),
        (SamplingParams(temperature=1.5, top_p=0.95), None),
    ],
)
def test_seeded_draws_follow_the_softmax(params, keep):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7])
    probs = torch.softmax(logits / params.temperature, dim=-1)
    ranked = torch.argsort(probs, descending=True, stable=True)
    if keep is None:  # top_p: the shortest prefix reaching the mass
        keep = int((torch.cumsum(probs[ranked], 0) - probs[ranked] < params.top_p).sum())
    kept = probs[ranked[:keep]] / probs[ranked[:keep]].sum()
    tokens = draws(logits.tolist(), params, range(8000))
    assert set(tokens) == set(ranked[:keep].tolist())
    rank_of = {t: r for r, t in enumerate(ranked[:keep].tolist())}
    # The 99.99th percentile of chi-square with 7 degrees of freedom (at most 8 kept tokens) is about 29.9.
    stat = chi_square([rank_of[t] for t in tokens], kept)
    assert stat < 30.0, stat


# ---- logprobs ----


def test_logprobs_hold_top_n_sorted_and_the_sampled_token():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 300, generator=gen)
    logits[0, 10] = logits[0, 20] = logits[0, 30] = 9.0  # a tie at the top
    params = SamplingParams(temperature=1.0, logprobs=5, repetition_penalty=1.5)
    out = sampler(logits, [row(params, seed=s, prompt=[10]) for s in range(8)])
    raw = torch.log_softmax(logits, dim=-1)
    for i, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        top5 = sorted(range(300), key=lambda t: (-raw[i, t].item(), t))[:5]
        assert list(lps)[:5] == top5
        assert set(lps) == set(top5) | {token}
        assert all(lps[t] == raw[i, t].item() for t in lps)
        values = list(lps.values())
        assert values == sorted(values, reverse=True)
    assert list(out.logprobs[0])[:3] == [10, 20, 30]


def test_zero_logprobs_hold_only_the_sampled_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    out = sampler(logits, [row(SamplingParams(logprobs=0), seed=s) for s in range(3)])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [{t: raw[i, t].item()} for i, t in enumerate(out.token_ids)]


def test_prompt_logprobs_match_log_softmax():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(300, 40, generator=gen)  # spans more than one internal chunk
    next_ids = torch.randint(0, 40, (300,), generator=gen).tolist()
    result = compute_prompt_logprobs(logits, next_ids, 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(result) == 300
    for i, lps in enumerate(result):
        top3 = torch.topk(raw[i], 3).indices.tolist()
        assert list(lps)[:3] == top3
        assert set(lps) == set(top3) | {next_ids[i]}
        assert all(v == raw[i, t].item() for t, v in lps.items())
    with pytest.raises(ValueError, match="one per row"):
        compute_prompt_logprobs(logits, next_ids[:-1], 3)
