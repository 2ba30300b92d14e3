"""The compiled float32 linear of the batch-invariant mode (csrc/dense_linear.cpp): each output one chain of fused
multiply-adds in k order. Checked against float64 within the chain's rounding bound, against that chain computed
step by step on a few outputs, row alone against row in any batch and thread count, and every instruction-set
build against the native one."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.ops import batch_invariant as bi
from deepinfer.ops import cpu_ops

from .test_quant_linear import _isa_builds  # the lower builds this CPU can run


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


@pytest.mark.parametrize("n, k", [(576, 576), (100, 48), (17, 3), (33, 1536), (1, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_within_the_chains_rounding(kernels, n, k, with_bias):
    w, bias = _weights(n, k, seed=n + k)
    b = bias if with_bias else None
    for m in (1, 3, 8, 9, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = kernels.dense_linear(x, bi.pack_panels(w), n, b)
        want = x.double() @ w.double().T + (b.double() if with_bias else 0)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # a chain of K roundings: |error| <= K * eps * sum |x w| (plus the bias add), far below it in practice
        bound = (k + 1) * 2**-24 * (x.double().abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0))
        assert ((got.double() - want).abs() <= bound + 1e-30).all(), (n, k, m)


def test_each_output_is_the_fma_chain_in_k_order(kernels):
    """The exact sequence: acc = fma(x[k], w[k], acc) from 0 for k in order, then + bias. The reference takes the
    float32 product exactly in float64 (24 + 24 bits), adds in float64 and rounds to float32: one float32 fma,
    except where the float64 sum lands on a float32 tie (about 2^-29 per step; these seeds have none)."""
    n, k = 19, 40
    w, bias = _weights(n, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    got = kernels.dense_linear(x, bi.pack_panels(w), n, bias)
    for m in range(5):
        for j in (0, 7, 16, 18):
            acc = torch.zeros((), dtype=torch.float32)
            for i in range(k):
                acc = (acc.double() + x[m, i].double() * w[j, i].double()).float()
            assert got[m, j] == acc + bias[j], (m, j)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 70), target=st.data(), n=st.integers(1, 80), k=st.integers(1, 90), seed=st.integers(0, 999))
def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count(kernels, m, target, n, k, seed):
    w, bias = _weights(n, k, seed)
    panels = bi.pack_panels(w)
    batch = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    t = target.draw(st.integers(0, m - 1), label="target")
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs += [kernels.dense_linear(batch, panels, n, bias)[t], kernels.dense_linear(batch[t : t + 1], panels, n, bias)[0]]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_bad_shapes_are_refused(kernels):
    w, _ = _weights(20, 8, seed=0)
    panels = bi.pack_panels(w)
    with pytest.raises(RuntimeError, match="x has K=9"):
        kernels.dense_linear(torch.zeros(1, 9), panels, 20, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.dense_linear(torch.zeros(1, 8), panels, 40, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        kernels.dense_linear(torch.zeros(1, 8), panels, 20, torch.zeros(3))
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.dense_linear(torch.zeros(1, 8, dtype=torch.float64), panels, 20, None)


@pytest.mark.parametrize("isa", _isa_builds())
def test_every_instruction_set_build_gives_the_native_bits(kernels, isa):
    """One IEEE fma per step on every path (AVX-512 lanes, the portable loop's std::fma): the same bits."""
    other = cpu_ops.load(isa)
    assert other is not None, f"the {isa} build failed"
    for n, k, m in ((40, 96, 11), (17, 3, 9), (576, 576, 2)):
        w, bias = _weights(n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        assert torch.equal(other.dense_linear(x, bi.pack_panels(w), n, bias),
                           kernels.dense_linear(x, bi.pack_panels(w), n, bias)), (n, k, m)
