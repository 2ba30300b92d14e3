"""The compiled ops for top-k / top-p rows against the torch calls they replace: sort_descending gives torch.sort's
(descending, stable) values and ids bit for bit (ties, NaN, +-0, +-inf, any width); the sampler with them
(ProbOrderOps: the radix sort and sample_sorted, the decision without a cdf tensor) gives the torch path's tokens for
top-p, top-k, min_p and their mixes, peaked and flat rows, prefixes that decide and ones that do not, a row alone and
in any batch; NaN rows go the torch way."""
import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.sample import Sampler, SamplingRow
from deepinfer.sample import prob_order
from deepinfer.sample.logprobs import ordered_top
from deepinfer.sample.prob_order import ProbOrderOps


def rows_of(params: list[SamplingParams], count: int) -> list[SamplingRow]:
    return [SamplingRow(params[i % len(params)], seed=77 + i, position=5 + i, prompt_token_ids=[1],
                        output_token_ids=[], eos_token_ids=frozenset()) for i in range(count)]


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 300), (40, 4099), (2, 49152)])
def test_sort_descending_is_torch_sort_stable_descending(kernels, rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 3
    if vocab >= 16:
        x[:, ::5] = x[:, 3:4]  # wide ties
        x[:, -6:] = x[:, -6:].round()
        x[0, 1], x[0, 2], x[0, 4] = float("nan"), -float("nan"), -0.0
        x[-1, 6], x[-1, 7], x[-1, 8], x[-1, 9] = float("inf"), -float("inf"), 0.0, -0.0
    want_values, want_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    values, ids = kernels.sort_descending(x)
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.view(torch.int32), want_values.view(torch.int32))  # NaN payloads and -0 too


@pytest.mark.parametrize("rows,vocab,k", [(1, 1, 1), (3, 7, 3), (5, 300, 64), (9, 4099, 64), (8, 49152, 64),
                                          (4, 20000, 1024), (2, 1000, 1000)])
@pytest.mark.parametrize("values", ["normal", "ties", "ascending", "nan and -inf"])
def test_ordered_prefix_is_the_sorted_orders_first_k_and_ordered_tops_contract(kernels, rows, vocab, k, values):
    """ordered_prefix gives the first k entries of the stable descending sort (ids and values bit for bit), and
    ordered_top's usable / complete; where topk chose other ids among ties with the k-th value, the usable entries
    agree."""
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(rows, vocab, generator=gen) * 3
    if values == "ties":
        x = x.round()
    elif values == "ascending":  # every entry beats the k-th so far: the kept entries are cut back again and again
        x = torch.arange(vocab, dtype=torch.float32).repeat(rows, 1)
    elif values == "nan and -inf" and vocab > 10:
        x[0, 3] = float("nan")
        x[-1, : vocab // 2] = -float("inf")
        x[-1, -5:] = -0.0
    top, ids, usable, complete = kernels.ordered_prefix(x, k)
    want_values, want_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, want_ids[:, :k])
    assert torch.equal(top.view(torch.int32), want_values[:, :k].view(torch.int32))
    t_top, t_ids, t_usable, t_complete = ordered_top(x, k)
    assert torch.equal(usable, t_usable) and torch.equal(complete, t_complete)
    for r in range(rows):
        u = int(usable[r])
        assert torch.equal(ids[r, :u], t_ids[r, :u])


SETTINGS = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.9, top_k=50),
    SamplingParams(temperature=1.3, top_k=3000, top_p=0.99, min_p=0.01),
    SamplingParams(temperature=0.05, top_p=1e-6),
    SamplingParams(temperature=1e4, top_p=0.3),
]


@pytest.mark.parametrize("prefixes", [None, (), (64,), (1, 16)])
def test_sampler_with_compiled_prob_order_gives_the_torch_paths_tokens(kernels, monkeypatch, prefixes):
    if prefixes is not None:  # narrower or no prefixes: more rows reach the whole-row sort
        monkeypatch.setattr(prob_order, "_ORDER_PREFIXES_BEFORE_RADIX", prefixes)
    gen = torch.Generator().manual_seed(5)
    torch_path = Sampler()
    compiled = Sampler(prob_order=ProbOrderOps.of(kernels))
    for vocab in (2, 300, 5000, 49152):
        for scale in (0.05, 1.0, 3.0, 12.0):  # flat rows' nucleus reaches past any prefix
            logits = torch.randn(21, vocab, generator=gen) * scale
            logits[::5, : vocab // 4] = -float("inf")
            logits[1, ::3] = logits[1, 0]  # ties across the nucleus
            rows = rows_of(SETTINGS, 21)
            want = torch_path(logits, rows).token_ids
            assert compiled(logits, rows).token_ids == want, (vocab, scale)
            for i in (0, 9, 20):
                assert compiled(logits[i : i + 1], rows[i : i + 1]).token_ids == [want[i]]


def test_rows_with_nan_weights_go_the_torch_way(kernels):
    logits = torch.randn(4, 500)
    logits[2, 7] = float("nan")
    rows = rows_of([SamplingParams(temperature=0.9, top_p=0.8)], 4)
    weights = torch.rand(4, 500)
    weights[2, 7] = float("nan")
    n = torch.full((4,), 500, dtype=torch.long)
    pick, decided = kernels.sample_sorted(weights, n, torch.zeros(4, dtype=torch.long),
                                          torch.full((4,), 0.8, dtype=torch.float64), weights.double().sum(1),
                                          torch.full((4,), 0.5, dtype=torch.float64), n,
                                          torch.ones(4, dtype=torch.bool))
    assert pick[2] == -1 and (pick[[0, 1, 3]] >= 0).all() and decided.all()
    compiled = Sampler(prob_order=ProbOrderOps.of(kernels))
    assert compiled(logits, rows).token_ids == Sampler()(logits, rows).token_ids


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_row_sums_are_the_last_entry_of_the_float64_cumsum(kernels, rows):
    """Rows go four at a time (their chains of adds side by side) and one at a time after: each row's sum in its own
    id order either way, bit for bit; NaN and inf carried."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.rand(rows, 3001, generator=gen) ** 12  # spread exponents: the order of the adds shows in the bits
    w[0, 17] = float("inf") if rows > 2 else w[0, 17]
    w[-1, 5] = float("nan") if rows > 3 else w[-1, 5]
    got, want = kernels.row_sums(w), w.double().cumsum(dim=-1)[:, -1]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
