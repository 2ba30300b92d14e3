"""Speculative verification keeps the target distribution exactly (chi-square over seeds), and greedy verification
equals greedy decoding."""
import numpy as np
import pytest
import torch

from deepinfer.sample.rejection import sample_from, verify_greedy, verify_sampled
from deepinfer.spec.ngram import match_ngram, propose_ngram

SEEDS = 6000
ALPHA = 1e-3  # a correct implementation fails one run in a thousand


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test: P(chi2 >= statistic) with (categories - 1) degrees of freedom."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_greedy_accepts_the_matching_prefix_then_corrects_or_adds_the_bonus():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch replaced, the rest dropped
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


def _dist(v: int, seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * sharp, 0)
    return p


@pytest.mark.parametrize("draft_kind", ["model", "deterministic", "far"])
def test_emitted_tokens_follow_the_target_distribution(draft_kind):
    """First emitted token over many seeds vs p; and the second given the first was an accepted draft."""
    v = 8
    p = torch.stack([_dist(v, 1, 1.5), _dist(v, 2, 1.5), _dist(v, 3, 1.5)])
    q = torch.stack([_dist(v, 11, 1.5), _dist(v, 12, 1.5)])
    if draft_kind == "far":  # q very different from p: mass on p's least likely tokens
        q = torch.softmax(-torch.log(p[:2]) * 2, dim=1)
    first, second = np.zeros(v), np.zeros(v)
    for seed in range(SEEDS):
        if draft_kind == "deterministic":
            drafts = [int(torch.argmax(p[0]).item() + seed) % v, 3]
            out = verify_sampled(p, drafts, None, seed, 0)
        else:
            g = torch.Generator().manual_seed(10_000 + seed)
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            out = verify_sampled(p, drafts, q, seed, 0)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chisquare_pvalue(first, p[0].numpy() * SEEDS) > ALPHA
    assert chisquare_pvalue(second, p[1].numpy() * second.sum()) > ALPHA


def test_sampling_is_a_pure_function_of_seed_and_position():
    p = torch.stack([_dist(16, 1, 1.0), _dist(16, 2, 1.0)])
    q = _dist(16, 3, 1.0).unsqueeze(0)
    runs = {tuple(verify_sampled(p, [4], q, seed=7, first_position=12)) for _ in range(5)}
    assert len(runs) == 1
    assert sample_from(torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.float64), 0.999999) == 2


def test_the_chi_square_check_can_fail():
    p = _dist(8, 1, 1.5).numpy()
    assert chisquare_pvalue(p[::-1] * SEEDS, p * SEEDS) < ALPHA


def _ngram_by_definition(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
        if starts:
            start = starts[-1] + n
            return [tokens[start + i % (len(tokens) - start)] for i in range(k)]
    return []


def test_ngram_drafts_and_match_length_follow_the_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(600):
        tokens = rng.integers(0, int(rng.integers(2, 9)), size=int(rng.integers(1, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n, k = min_n + int(rng.integers(0, 4)), int(rng.integers(1, 9))
        drafts = _ngram_by_definition(tokens, k, min_n, max_n)
        assert propose_ngram(np.array(tokens, dtype=np.int64), k, min_n, max_n) == drafts, (tokens, k, min_n, max_n)
        # and the match's length: the longest suffix within [min_n, max_n] that occurred before
        longest = next((n for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1)
                        if any(tokens[s : s + n] == tokens[len(tokens) - n :] for s in range(len(tokens) - n))), 0)
        assert match_ngram(np.array(tokens, dtype=np.int64), k, min_n, max_n) == (longest, drafts)


def test_ngram_finds_the_latest_earlier_match_longest_first():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]  # "1 2 3" last seen before the end at index 5
    assert propose_ngram(tokens, 8, 1, 3) == [4, 5, 6, 1, 2, 3, 4, 5]  # past the end: the stretch repeats
    assert propose_ngram(np.array([7, 8, 9]), 3, 1, 3) == []
    assert propose_ngram(np.array([5, 6, 5]), 2, 1, 3) == [6, 5]  # only a 1-gram matches
    assert propose_ngram(np.array([4, 7, 7, 7]), 5, 1, 3) == [7] * 5  # a run drafts k of its token, not one
    assert propose_ngram(np.array([8, 1, 2, 1, 2]), 5, 2, 3) == [1, 2, 1, 2, 1]  # "1 2" 2 back: period 2
