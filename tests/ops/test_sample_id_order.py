"""The compiled inverse CDF of seeded sampling (sample_id_order) against the sampler's torch path: the same token for
every row, peaked and flat rows, min_p, extreme temperatures, NaN rows (handed back to the torch path), any batch."""
import torch

from deepinfer import SamplingParams
from deepinfer.sample import Sampler, SamplingRow


def rows_of(params: list[SamplingParams], count: int, position: int = 3) -> list[SamplingRow]:
    return [SamplingRow(params[i % len(params)], seed=1000 + i, position=position + i, prompt_token_ids=[1],
                        output_token_ids=[], eos_token_ids=frozenset()) for i in range(count)]


def test_compiled_inverse_cdf_gives_the_torch_paths_tokens(kernels):
    gen = torch.Generator().manual_seed(11)
    torch_path, compiled = Sampler(), Sampler(id_order=kernels.sample_id_order)
    params = [SamplingParams(temperature=t, min_p=m) for t in (0.05, 0.7, 1.0, 3.0, 1e4) for m in (0.0, 0.05)]
    for vocab in (1, 2, 17, 1000, 49152):
        for scale in (0.01, 1.0, 8.0):
            logits = torch.randn(42, vocab, generator=gen) * scale  # rows go four at a time, then two alone
            logits[::7, : vocab // 3] = -float("inf")  # masked-out ids
            rows = rows_of(params, 42)
            want = torch_path(logits, rows).token_ids
            assert compiled(logits, rows).token_ids == want, (vocab, scale)
            for i in (0, 13, 41):  # a row alone: the same token
                assert compiled(logits[i : i + 1], rows[i : i + 1]).token_ids == [want[i]]


def test_rows_the_kernel_cannot_decide_go_the_torch_way(kernels):
    logits = torch.randn(6, 300)
    logits[2, 5] = float("nan")
    rows = rows_of([SamplingParams(temperature=0.9)], 6)
    weights = (logits / 0.9 - (logits / 0.9).amax(dim=-1, keepdim=True)).exp()
    picked = kernels.sample_id_order(weights, torch.full((6,), 0.5, dtype=torch.float64))
    assert picked[2] == -1 and (picked[[0, 1, 3, 4, 5]] >= 0).all()
    assert Sampler(id_order=kernels.sample_id_order)(logits, rows).token_ids == Sampler()(logits, rows).token_ids
