"""The varlen draft plan: a step's drafts are taken best first (acceptance per position, chained) while they raise the expected tokens
per unit of step cost (worker/speculative.py: RowCosts.step)."""
import numpy as np
import pytest

from deepinfer.config import SpecConfig
from deepinfer.worker.speculative import (AVX2_COSTS, AVX512_COSTS, PROBE_EVERY, TILE_ROWS, DraftState,
                                          check_shadow, drafts_can_pay, first_draft_bar, matched_drafts, mtp_upkeep,
                                          plan_draft_lengths, record_acceptance, row_costs)

SPEC = SpecConfig(speculative_method="ngram", num_speculative_tokens=5)


def plan(acceptances, varlen=True):
    return plan_draft_lengths(SPEC, varlen, [DraftState(acceptance=a) for a in acceptances])


def expected_tokens_per_cost(acceptances, lengths, costs=AVX512_COSTS):
    tokens = sum(1 + sum(a**j for j in range(1, n + 1)) for a, n in zip(acceptances, lengths))
    return tokens / costs.step(len(acceptances) + sum(lengths))


def test_alone_drafts_are_cheap_so_a_fair_acceptance_drafts_deep():
    assert plan([0.5]) == [3]  # alone, rows are memory-bound: a draft costs ~8% of a step
    assert plan([0.7]) == [4]
    assert plan([0.95]) == [5]  # never more than k


def test_on_avx2_drafts_are_planned_shallower():
    """AVX2's kernels (no VNNI, 8 lanes): a second row costs ~13% of a one-row step (AVX-512: ~8%) and each 5th row
    starts another pass, so the same acceptance drafts no deeper than on AVX-512, and a 0.1 acceptance, which drafts
    there, does not pay here."""
    assert row_costs("avx2") == row_costs("avx2-vnni") == row_costs("generic") == AVX2_COSTS
    assert row_costs("avx512-vnni") == row_costs(None) == AVX512_COSTS
    for a in (0.3, 0.5, 0.7, 0.9, 0.97):
        on_avx2 = plan_draft_lengths(SPEC, True, [DraftState(acceptance=a)], costs=AVX2_COSTS)
        assert on_avx2[0] <= plan([a])[0]
        # the best length within the first pass (the plan stops at the first draft that does not pay, so it does
        # not look past a pass: at 0.97, 5 drafts would give 5% more than its 3)
        best = expected_tokens_per_cost([a], on_avx2, AVX2_COSTS)
        assert all(best >= expected_tokens_per_cost([a], [n], AVX2_COSTS) - 1e-12 for n in range(4))
    assert plan_draft_lengths(SPEC, True, [DraftState(acceptance=0.1)], costs=AVX2_COSTS) == [0]  # AVX-512: 1
    assert plan([0.1]) == [1]
    assert plan_draft_lengths(SPEC, True, [DraftState(acceptance=0.9)], costs=AVX2_COSTS) == [3]  # AVX-512: 5
    # a draft sure to be accepted pays unless it starts a pass: at 4 or 32 sequences it would
    assert drafts_can_pay(True, 3, AVX2_COSTS) and not drafts_can_pay(True, 4, AVX2_COSTS)
    assert not drafts_can_pay(True, 32, AVX2_COSTS) and first_draft_bar(32, (), AVX2_COSTS) > 1


def test_the_bar_rises_with_the_batch():
    lengths = [plan([0.85] * b)[0] for b in (1, 2, 4, 8, 32)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 5 and lengths[-1] == 0
    assert plan([0.95] * 8) == [0] * 8  # 8 rows fill the kernels' tile: a 9th would start another pass
    assert sum(plan([0.95] * 12)) == 4  # 12 sequences: likely drafts fill the second tile, no more


def test_where_no_draft_can_pay_the_plan_is_skipped_and_it_would_have_drafted_nothing():
    """drafts_can_pay is the plan's own bar for a draft sure to be accepted: where it says no, the plan (which the
    runner then skips) drafts nothing even at acceptance 1, probes included; where it says yes, acceptance 1 drafts."""
    mtp = SpecConfig(speculative_method="mtp", num_speculative_tokens=3)
    skipped = []
    for batch in range(1, 65):
        sure = [DraftState(acceptance=1.0, idle_steps=10**6) for _ in range(batch)]
        lengths = plan_draft_lengths(mtp, True, sure, depth_costs=(0.0, 1.3, 1.3), free=[True] * batch)
        assert (sum(lengths) > 0) == drafts_can_pay(True, batch)
        skipped += [] if drafts_can_pay(True, batch) else [batch]
        assert drafts_can_pay(False, batch)  # fixed draft lengths: every sequence drafts k, whatever the batch
    assert skipped[0] == TILE_ROWS and TILE_ROWS in skipped and 32 in skipped and 64 in skipped


def test_mtp_keeps_decode_rows_kv_below_a_tile_or_where_something_drafts():
    assert mtp_upkeep(True, TILE_ROWS - 1, False) and mtp_upkeep(True, 32, True)
    assert not mtp_upkeep(True, TILE_ROWS, False) and not mtp_upkeep(True, 32, False)
    assert mtp_upkeep(False, 32, False)  # fixed draft lengths: every row, every step


def test_the_plan_beats_every_uniform_length_and_prefers_the_likelier_sequence():
    acceptances = [0.9, 0.3, 0.6, 0.8]
    lengths = plan(acceptances)
    assert lengths[0] >= lengths[3] >= lengths[2] >= lengths[1]
    best = expected_tokens_per_cost(acceptances, lengths)
    for n in range(6):
        assert best >= expected_tokens_per_cost(acceptances, [n] * 4) - 1e-12


def test_a_sequence_that_stopped_drafting_probes_only_where_a_success_could_make_a_draft_pay():
    states = [DraftState(acceptance=0.05)]  # below the bar even alone
    alone = [plan_draft_lengths(SPEC, True, states)[0] for _ in range(PROBE_EVERY)]
    assert alone == [0] * (PROBE_EVERY - 1) + [1]
    states = [DraftState(acceptance=0.2) for _ in range(4)]  # below the bar of 4 (~0.25); one success (0.44) clears it
    firsts = [plan_draft_lengths(SPEC, True, states)[0] for _ in range(2 * PROBE_EVERY)]
    assert sum(firsts) == 2
    # from 8 sequences on a draft's row starts a new tile: no acceptance pays for it, so a probe (a real row) never
    # runs; MTP's own depth cost raises the bar further
    assert 1 < first_draft_bar(8) < first_draft_bar(8, (1.3,)) and first_draft_bar(32) > 1
    states = [DraftState(acceptance=0.5) for _ in range(32)]
    assert not any(any(plan_draft_lengths(SPEC, True, states)) for _ in range(8 * PROBE_EVERY))
    mtp = [DraftState(acceptance=0.5) for _ in range(8)]
    assert not any(any(plan_draft_lengths(SPEC, True, mtp, depth_costs=(1.3,) * 5)) for _ in range(8 * PROBE_EVERY))


def test_without_varlen_every_sequence_drafts_k():
    assert plan([0.0] * 64, varlen=False) == [5] * 64


def test_shadow_probes_spend_no_row_and_check_a_guess_against_the_sampled_token():
    states = [DraftState(acceptance=0.5) for _ in range(32)]
    probed = []
    for _ in range(8 * PROBE_EVERY):
        assert plan_draft_lengths(SPEC, True, states, shadow_probes=True) == [0] * 32
        probed.append(states[0].probe)
        states[0].probe = False
    assert sum(probed) == 1
    state = states[0]
    state.shadow = 7
    check_shadow(state, 7)  # the guess was right: one draft, accepted
    assert state.rate(0) == pytest.approx(0.7 * 0.5 + 0.3) and state.shadow is None
    check_shadow(state, 7)  # no guess pending: nothing recorded
    assert state.rate(0) == pytest.approx(0.65)


def test_acceptance_is_kept_per_position_so_a_first_draft_that_pays_is_not_dragged_down_by_the_second():
    state = DraftState(acceptance=0.5)
    for _ in range(30):  # the first draft accepted 3 times in 4, the second never
        for first in (True, True, True, False):
            record_acceptance(state, 2, 1 if first else 0)
    assert state.rate(0) == pytest.approx(0.75, abs=0.2) and state.rate(1) < 0.01
    assert plan_draft_lengths(SPEC, True, [state]) == [1]  # the mean (0.375 a draft) would have planned 2
    for _ in range(60):  # drafting one at a time: the second position drifts back to the prior, to be tried again
        record_acceptance(state, 1, 1)
    assert state.rate(1) > 0.45 and plan_draft_lengths(SPEC, True, [state])[0] >= 2


def test_later_positions_are_only_observed_after_the_earlier_ones_were_accepted():
    state = DraftState(acceptance=0.5)
    record_acceptance(state, 3, 0)  # the first draft rejected: the second and third say nothing
    assert state.per_position == pytest.approx([0.35, 0.5, 0.5])
    record_acceptance(state, 3, 3)
    assert state.per_position == pytest.approx([0.545, 0.65, 0.65])


def test_a_proposer_that_pays_per_depth_drafts_shallower_alone_and_shares_the_depth_in_a_batch():
    costly = (0.3, 1.3, 1.3, 1.3, 1.3)  # MTP-like: each depth past the first runs a layer once for everyone
    assert plan([0.5]) == [3]
    assert plan_draft_lengths(SPEC, True, [DraftState(acceptance=0.5)], depth_costs=costly) == [1]
    assert plan_draft_lengths(SPEC, True, [DraftState(acceptance=0.9)], depth_costs=costly) == [4]  # not 5
    # two sequences share each depth's cost: depth 2 is weighed for both at once (one draft at a time, it never pays)
    paired = plan_draft_lengths(SPEC, True, [DraftState(acceptance=0.9) for _ in range(2)], depth_costs=costly)
    assert paired == [2, 2]


def test_drafts_from_the_lookup_in_front_of_mtp_pay_their_rows_but_no_depth():
    costly = (0.3, 1.3, 1.3, 1.3, 1.3)
    alone = [DraftState(acceptance=0.5)]
    assert plan_draft_lengths(SPEC, True, alone, depth_costs=costly) == [1]
    # the lookup's drafts: as deep as plain n-gram drafts, whatever MTP's depths cost
    assert plan_draft_lengths(SPEC, True, alone, depth_costs=costly, free=[True]) == plan([0.5]) == [3]
    pair = [DraftState(acceptance=0.5), DraftState(acceptance=0.5)]
    assert plan_draft_lengths(SPEC, True, pair, depth_costs=costly) == [1, 1]
    assert plan_draft_lengths(SPEC, True, pair, depth_costs=costly, free=[True, True]) == plan([0.5, 0.5])
    assert plan_draft_lengths(SPEC, True, pair, depth_costs=costly, free=[True, False]) == [2, 1]


def test_the_lookup_in_front_of_mtp_takes_matches_of_two_tokens_or_more():
    import numpy as np

    from deepinfer.worker.speculative import lookup_drafts, looks_up

    spec = SpecConfig(speculative_method="mtp", num_speculative_tokens=3, ngram_lookup=True)
    assert lookup_drafts(spec, np.array([4, 5, 6, 7, 8, 4, 5])) == [6, 7, 8]  # "4 5" occurred before
    assert lookup_drafts(spec, np.array([4, 5, 6, 7, 8, 9, 5])) == []  # "5" alone: MTP drafts instead
    # with varlen only where a draft can pay its row; with fixed lengths (reproducible) at every batch size
    assert looks_up(spec, True, 1) and not looks_up(spec, True, 8) and looks_up(spec, False, 32)
    assert not looks_up(SpecConfig(speculative_method="mtp"), False, 1)
    with pytest.raises(ValueError, match="ngram_lookup .* needs speculative_method='mtp'"):
        SpecConfig(speculative_method="ngram", ngram_lookup=True)
    from deepinfer.args import engine_config_from_args
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--speculative-method", "mtp",
                                      "--speculative-ngram-lookup"])
    assert engine_config_from_args(args).spec == SpecConfig(speculative_method="mtp", ngram_lookup=True)


def test_ngram_drafts_are_planned_on_the_acceptance_of_their_match_length():
    """matched_drafts: each match length keeps its own estimates. After a 1-token match whose drafts fail, nothing is
    drafted (its first draft is only guessed: a shadow probe, no row); after a 4-token match whose drafts hold, the
    same sequence drafts deep; no match, nothing."""
    matched: dict[int, DraftState] = {}
    short = np.array([5, 1, 9, 8, 1])  # "1" occurred before: a 1-token match, drafts 9 8 1 ...
    long = np.array([1, 2, 3, 4, 7, 1, 2, 3, 4])  # "1 2 3 4" did: a 4-token match, drafts 7 1 2 3 4
    for _ in range(20):
        states, drafts = matched_drafts(SPEC, [short], [matched], AVX2_COSTS)
        if drafts[0]:
            record_acceptance(states[0], len(drafts[0]), 0)
        else:
            assert states[0].shadow == 9
            check_shadow(states[0], 3)  # the model samples another token
        states, drafts = matched_drafts(SPEC, [long], [matched], AVX2_COSTS)
        record_acceptance(states[0], len(drafts[0]), len(drafts[0]))
    assert sorted(matched) == [1, 4]
    states, drafts = matched_drafts(SPEC, [short], [matched], AVX2_COSTS)
    assert drafts == [[]] and states[0] is matched[1] and states[0].shadow == 9
    states, drafts = matched_drafts(SPEC, [long], [matched], AVX2_COSTS)
    assert states[0] is matched[4] and len(drafts[0]) >= 2 and drafts[0] == [7, 1, 2, 3, 4][: len(drafts[0])]
    states, drafts = matched_drafts(SPEC, [np.array([1, 2, 3])], [{}], AVX2_COSTS)
    assert drafts == [[]] and states[0].rate(0) == 0.0
