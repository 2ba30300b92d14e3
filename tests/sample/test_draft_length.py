"""The varlen draft-length rule: draft the j-th token while acceptance^j >= batch / (batch + FIXED_ROWS)."""
from deepinfer.config import SpecConfig
from deepinfer.worker.speculative import FIXED_ROWS, PROBE_EVERY, DraftState, draft_length

SPEC = SpecConfig(speculative_method="ngram", num_speculative_tokens=5)


def test_alone_a_fair_acceptance_drafts_deep():
    # 0.6^4 = 0.13 >= 1/9 = 0.11 > 0.6^5
    assert draft_length(SPEC, True, DraftState(acceptance=0.6), 1) == 4
    assert draft_length(SPEC, True, DraftState(acceptance=0.95), 1) == 5  # never more than k


def test_the_bar_rises_with_the_batch():
    state = DraftState(acceptance=0.85)
    lengths = [draft_length(SPEC, True, state, b) for b in (1, 8, 32, 64)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 5 and lengths[-1] == 0
    assert 32 / (32 + FIXED_ROWS) == 0.8


def test_a_sequence_that_stopped_drafting_probes_with_one_token():
    state = DraftState(acceptance=0.5)
    lengths = [draft_length(SPEC, True, state, 64) for _ in range(PROBE_EVERY)]
    assert lengths == [0] * (PROBE_EVERY - 1) + [1]


def test_without_varlen_every_sequence_drafts_k():
    assert draft_length(SPEC, False, DraftState(acceptance=0.0), 64) == 5
