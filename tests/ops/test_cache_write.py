"""The fused KV-cache write (ops/csrc/layer_ops.cpp) against torch's index_copy_: the same bits, into float32 caches
and, rounding float32 rows as torch rounds them, into bfloat16 and float8 e4m3fn caches."""
import pytest
import torch



BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


@pytest.mark.parametrize("cache_dtype", list(BITS), ids=["f32", "bf16", "fp8"])
def test_cache_write_matches_index_copy(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    slots_total, heads, dim = 512, 3, 64
    k = torch.randn(300, heads, dim, generator=gen)  # enough rows for the threads to share them
    v = torch.randn(300, heads, dim, generator=gen)
    # ties round to even; a large value, infinities, NaN, -0, a subnormal
    k[0, 0, :9] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e38, float("inf"), -float("inf"),
                                float("nan"), -0.0, 1e-40])
    # float8 e4m3fn: 448 is the largest (464 ties to it, 480 and past saturate), subnormals step 2^-9 (ties to even)
    k[0, 1, :10] = torch.tensor([448.0, 464.0, 479.9, 480.0, -1e4, 2**-10, 3 * 2**-10, 2**-9 * 1.49, 2**-6 * 0.999,
                                 0.1])
    v[1] = v[1] * 300  # values spread over the whole range
    slots = torch.randperm(slots_total, generator=gen)[:300]
    bits = BITS[cache_dtype]
    want_k, want_v = (torch.zeros(slots_total, heads, dim, dtype=cache_dtype) for _ in range(2))
    want_k.view(bits).index_copy_(0, slots, k.to(cache_dtype).view(bits))  # no float8 index_copy_ on the CPU
    want_v.view(bits).index_copy_(0, slots, v.to(cache_dtype).view(bits))
    got_k, got_v = (torch.zeros(slots_total, heads, dim, dtype=cache_dtype) for _ in range(2))
    kernels.cache_write(k, v, got_k, got_v, slots)
    assert torch.equal(got_k.view(bits), want_k.view(bits))
    assert torch.equal(got_v.view(bits), want_v.view(bits))


def test_cache_write_refuses_other_dtype_pairs(kernels):
    k = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        kernels.cache_write(k, k, torch.zeros(4, 1, 64), torch.zeros(4, 1, 64), torch.tensor([0]))
