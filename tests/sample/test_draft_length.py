"""The varlen draft-length rule: draft the j-th token while acceptance^j >= batch / (batch + FIXED_ROWS)."""
from deepinfer.config import SpecConfig
from deepinfer.worker.speculative import FIXED_ROWS, PROBE_EVERY, DraftState, draft_length

SPEC = SpecConfig(speculative_method="ngram", num_speculative_tokens=5)


def test_alone_a_fair_acceptance_drafts_deep():
    # 0.6^3 = 0.216 >= 1/5 = 0.2 > 0.6^4
    assert draft_length(SPEC, True, DraftState(acceptance=0.6), 1) == 3
    assert draft_length(SPEC, True, DraftState(acceptance=0.95), 1) == 5  # never more than k


def test_the_bar_rises_with_the_batch():
    state = DraftState(acceptance=0.85)
    lengths = [draft_length(SPEC, True, state, b) for b in (1, 8, 32, 64)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 5 and lengths[-1] == 0
    assert lengths[1] == 2  # at 8 sequences the bar is 8 / (8 + FIXED_ROWS) = 0.67: 0.85^2 = 0.72 passes it
    assert FIXED_ROWS == 4


def test_a_sequence_that_stopped_drafting_probes_with_one_token():
    state = DraftState(acceptance=0.5)
    lengths = [draft_length(SPEC, True, state, 64) for _ in range(PROBE_EVERY)]
    assert lengths == [0] * (PROBE_EVERY - 1) + [1]


def test_without_varlen_every_sequence_drafts_k():
    assert draft_length(SPEC, False, DraftState(acceptance=0.0), 64) == 5
