"""The fused KV-cache write (ops/csrc/layer_ops.cpp) against torch's index_copy_: the same bits, into float32 caches
and, rounding float32 rows as torch rounds them, into bfloat16 caches."""
import pytest
import torch



@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_matches_index_copy(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    slots_total, heads, dim = 512, 3, 64
    k = torch.randn(300, heads, dim, generator=gen)  # enough rows for the threads to share them
    v = torch.randn(300, heads, dim, generator=gen)
    # ties round to even; a large value, infinities, NaN, -0, a subnormal
    k[0, 0, :9] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e38, float("inf"), -float("inf"),
                                float("nan"), -0.0, 1e-40])
    slots = torch.randperm(slots_total, generator=gen)[:300]
    want_k, want_v = (torch.zeros(slots_total, heads, dim, dtype=cache_dtype) for _ in range(2))
    want_k.index_copy_(0, slots, k.to(cache_dtype))
    want_v.index_copy_(0, slots, v.to(cache_dtype))
    got_k, got_v = (torch.zeros(slots_total, heads, dim, dtype=cache_dtype) for _ in range(2))
    kernels.cache_write(k, v, got_k, got_v, slots)
    assert torch.equal(got_k.view(torch.int16 if cache_dtype == torch.bfloat16 else torch.int32),
                       want_k.view(torch.int16 if cache_dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(got_v, want_v)


def test_cache_write_refuses_other_dtype_pairs(kernels):
    k = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        kernels.cache_write(k, k, torch.zeros(4, 1, 64), torch.zeros(4, 1, 64), torch.tensor([0]))
