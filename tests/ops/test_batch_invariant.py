"""Batch-invariant ops: a row computed alone equals, bit for bit, the same row inside batches of other rows.

Each op is also checked against the default computation within float tolerance, and the assumptions the module
states (fixed-shape GEMM calls, elementwise kernels, torch's per-row log_softmax used by the sampler) are checked
here where they can be.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.layers.norm import RMSNorm
from deepinfer.ops import batch_invariant as bi

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THREADS = [1, 2]


@pytest.fixture(params=THREADS, ids=lambda n: f"{n}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _rows(seed: int, m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2


def _check_rows(op, m: int, k: int, target: int, seed: int) -> None:
    """Row `target` of op(a batch of m random rows) equals op(that row alone) and op(it in another batch)."""
    batch = _rows(seed, m, k)
    row = batch[target : target + 1].clone()
    other = torch.cat([_rows(seed + 1, 7, k), row, _rows(seed + 2, 40, k)])
    alone = op(row)
    assert torch.equal(op(batch)[target : target + 1], alone)
    assert torch.equal(op(other)[7:8], alone)


def _target(data, m: int) -> int:
    return data.draw(st.integers(0, m - 1), label="target")


# ---- linear ----------------------------------------------------------------------------------------------------

SHAPES = [(576, 960), (64, 200), (1536, 576)]


@pytest.mark.parametrize("packed", ["full", "short", None], ids=["mkl-packed", "mkl-packed-short-tiles",
                                                                   "per-tile-f.linear"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@SETTINGS
@given(m=st.integers(1, 256), data=st.data(), seed=st.integers(0, 2**16))
def test_linear_row_alone_equals_row_in_batch(shape, packed, m, data, seed):
    k, n = shape
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k**0.5
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    pw = bi.pack_weight(w) if packed else None
    if packed and pw is None:
        pytest.skip("no MKL packed GEMM in this torch build")
    short = bi.short_tiles(w, bias, pw) if packed == "short" else ()
    assert set(short) <= set(bi.SHORT_TILES)
    _check_rows(lambda x: bi.linear(x, w, bias, pw, short), m, k, _target(data, m), seed)
    if short:  # the probed short tiles give the bits of the fixed 32-row tiles
        x = _rows(seed, m, k)
        assert torch.equal(bi.linear(x, w, bias, pw, short), bi.linear(x, w, bias, pw))


def test_linear_matches_f_linear_and_keeps_leading_dims(threads):
    w = torch.randn(300, 64)
    x = torch.randn(3, 37, 64)
    out = bi.linear(x, w, None, bi.pack_weight(w))
    assert out.shape == (3, 37, 300)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_rows_do_not_depend_on_thread_count():
    w = torch.randn(960, 576)
    x = torch.randn(200, 576)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in THREADS:
            torch.set_num_threads(n)
            outs.append(bi.linear(x, w, None, bi.pack_weight(w)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_unaligned_input_view_gives_the_same_rows():
    w = torch.randn(100, 48)
    storage = torch.randn(1 + 64 * 48)
    x = storage[1:].view(64, 48)  # 4 bytes past the allocator's alignment: copied before the GEMM
    assert x.data_ptr() % 64 != 0
    assert torch.equal(bi.linear(x, w, None, bi.pack_weight(w)), bi.linear(x.clone(), w, None, bi.pack_weight(w)))


# ---- reductions ------------------------------------------------------------------------------------------------


@given(width=st.integers(1, 700), seed=st.integers(0, 2**16))
@settings(max_examples=50, deadline=None)
def test_fold_sum_is_the_stated_pairwise_tree(width, seed):
    x = _rows(seed, 3, width)

    def tree(values: list[np.float32]) -> np.float32:  # the documented order, one float32 add at a time
        aside = []
        while len(values) > 1:
            if len(values) % 2:
                aside.append(values.pop())
            half = len(values) // 2
            values = [np.float32(a + b) for a, b in zip(values[:half], values[half:])]
        total = values[0]
        for tail in reversed(aside):
            total = np.float32(total + tail)
        return total

    got = bi.fold_sum(x)
    assert got.shape == (3, 1)
    for i in range(3):
        assert got[i, 0].item() == tree([np.float32(v) for v in x[i].tolist()])


@pytest.mark.parametrize("width", [576, 64, 49152, 9])
@SETTINGS
@given(m=st.integers(1, 256), data=st.data(), seed=st.integers(0, 2**16))
def test_reductions_row_alone_equals_row_in_batch(width, m, data, seed):
    m = m if width < 10_000 else 1 + m // 8  # vocabulary-wide rows: up to 32 of them keep the test quick
    weight = torch.randn(width, generator=torch.Generator().manual_seed(3))
    target = _target(data, m)
    for op in (lambda x: bi.rms_norm(x, weight, 1e-5), bi.softmax, bi.log_softmax, bi.fold_sum):
        _check_rows(op, m, width, target, seed)


def test_reductions_match_torch(threads):
    x = torch.randn(33, 576) * 3
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        torch.testing.assert_close(bi.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)
        gemma = RMSNorm(576, 1e-6, offset=1.0)
        gemma.weight.normal_()
        torch.testing.assert_close(bi.rms_norm(x, gemma.weight, 1e-6, 1.0), gemma(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bi.softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(bi.log_softmax(x), torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.fold_sum(x), x.sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)


def test_sampler_log_softmax_rows_are_invariant(threads):
    """The sampler keeps torch.log_softmax: torch's CPU kernel reduces each last-dim row with one vectorized
    pass over its own length and hands whole rows to threads, so the row count cannot change a row."""
    x = torch.randn(256, 49152) * 4
    full = torch.log_softmax(x, -1)
    for m in (1, 2, 3, 17, 64, 255):
        assert torch.equal(torch.log_softmax(x[:m].clone(), -1), full[:m])


def test_elementwise_exp_has_no_position_dependent_path():
    """The attention's exp runs on tensors whose length changes with the batch: torch must compute every element
    with the same function whether it lands in a vector body or a scalar tail (silu/sigmoid do not, see README)."""
    x = torch.randn(1 << 14) * 20
    whole = torch.exp(x)
    tails = torch.cat([torch.exp(x[i : i + 7].clone()) for i in range(0, x.numel(), 7)])
    assert torch.equal(whole, tails)

