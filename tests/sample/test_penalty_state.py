"""Penalties from counts kept as tokens arrive (sample/penalties.py) give the logits the token lists give, bit for
bit, for rows mixed in one batch."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.sample.penalties import PenaltyState
from deepinfer.sample.sampler import SamplingRow, _process_logits
from deepinfer.sampling_params import SamplingParams

VOCAB = 97

PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=0.45),
    SamplingParams(repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.2),
    SamplingParams(),  # no penalty: passes through untouched
]


def _rows(rng: random.Random, kept: bool) -> list[SamplingRow]:
    rows = []
    for i, params in enumerate(PARAMS * 3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        output = [rng.randrange(VOCAB // 4) for _ in range(rng.randrange(0, 60))]  # many repeats
        state = None
        if kept:
            state = PenaltyState(prompt, output[:5])  # built from part of it, the rest arriving later
            for j in range(5, len(output), 3):
                state.extend(output[j : j + 3])
        # every other row keeps the lists only, so both kinds share one batch
        rows.append(SamplingRow(params, 0, len(output), prompt, output, frozenset(),
                                penalty_state=state if i % 2 == 0 else None))
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_kept_counts_give_the_same_logits_as_the_lists(seed):
    logits = torch.randn(len(PARAMS) * 3, VOCAB, generator=torch.Generator().manual_seed(seed))
    listed = _process_logits(logits, _rows(random.Random(seed), kept=False))
    kept = _process_logits(logits, _rows(random.Random(seed), kept=True))
    assert torch.equal(listed, kept)
    assert not torch.equal(listed, logits)


def test_state_grows_past_its_first_capacity_and_counts():
    state = PenaltyState([1, 2, 2])
    tokens = [t % 50 for t in range(300)]
    state.extend(tokens)
    assert sorted(state.seen_ids.tolist()) == list(range(50))
    assert dict(zip(state.output_ids.tolist(), state.output_counts.tolist())) == {t: 6.0 for t in range(50)}
