"""An 8-bit LM head's argmax in two passes (ops/quant_linear.bounded_argmax, csrc/bounded_argmax.cpp) against the
exact fused argmax and torch.argmax of the kernel's own outputs: the same index for every row count, thread count
and output count, with ties across blocks, near ties, extreme low bits and non-finite values; the per-output bound
against one computed from the format; every instruction-set build agrees; and greedy decoding gives the same tokens
with the two-pass head and without."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from deepinfer import SamplingParams
from deepinfer.models.gguf_blocks import canonical
from deepinfer.ops import quant_linear as ql
from tests.ops.test_quant_linear import _isa_builds, random_blocks
from tests.ops.test_split_head import bound_edges_q8


def q8(raw: np.ndarray, n: int, k: int) -> ql.PackedWeight:
    return ql.pack(canonical(QType.Q8_0, raw, (n, k)))


def check(kernels, w: ql.PackedWeight, x: torch.Tensor) -> torch.Tensor:
    bound = ql.argmax_bound(kernels, w)
    want = ql.linear(kernels, x, w).argmax(dim=-1)
    assert torch.equal(ql.argmax(kernels, x, w), want)
    assert torch.equal(ql.bounded_argmax(kernels, x, w, bound), want)
    return want


def test_the_bound_is_the_one_the_format_gives(kernels):
    n, k = 1000, 576
    raw = random_blocks(QType.Q8_0, n, k, seed=1)
    c = canonical(QType.Q8_0, raw, (n, k))
    got = ql.argmax_bound(kernels, ql.pack(c)).reshape(-1, 2, 16).permute(0, 2, 1).reshape(-1, 2)[:n].double()
    d = np.abs(c.scales.astype(np.float64))  # [n, k / 32]
    low = (c.u.astype(np.int64) & 3).astype(np.float64) - 1.5  # the bits the first pass leaves open, centred
    r = np.sqrt((np.repeat(d, 32, axis=1) ** 2 * low**2).sum(axis=1))
    e = (2 * (k // 32) + 16) * 2.0**-23 * 512 * d.max(axis=1)
    for col, ref in ((0, r), (1, e)):
        ref = torch.from_numpy(ref)
        assert (got[:, col] >= ref).all() and (got[:, col] <= ref * (1 + 2**-18) + 1e-30).all()


@pytest.mark.parametrize("n,k", [(16, 64), (1000, 576), (4099, 640)])
def test_same_index_as_the_exact_argmax_for_any_rows_and_threads(kernels, n, k):
    w = q8(random_blocks(QType.Q8_0, n, k, seed=n), n, k)
    dense = torch.from_numpy(canonical(QType.Q8_0, random_blocks(QType.Q8_0, n, k, seed=n), (n, k)).dequantize())
    gen = torch.Generator().manual_seed(k)
    # peaked rows (an output's own weights: one clear winner, few candidate blocks) and flat random ones
    peaked = 3 * dense[torch.randint(0, n, (40,), generator=gen)] + 0.05 * torch.randn(40, k, generator=gen)
    x = torch.cat([peaked, torch.randn(30, k, generator=gen)])[torch.randperm(70, generator=gen)]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (1, 2, 3, 5, 17, 64, 70):
                check(kernels, w, x[:rows])
    finally:
        torch.set_num_threads(threads)


def test_ties_across_blocks_near_ties_and_extreme_low_bits(kernels):
    n, k = 700, 128
    gen = torch.Generator().manual_seed(2)
    raw = bound_edges_q8(n, k, 3)  # the 2 low bits pass 1 leaves open
    w = q8(raw, n, k)
    d = torch.from_numpy(canonical(QType.Q8_0, raw, (n, k)).dequantize())
    x = torch.cat([d[40:41] * 3, d[300:301] + 0.01 * torch.randn(1, k, generator=gen),
                   d[100:101] + d[101:102] + d[102:103],  # near ties: many outputs within the bound of the largest
                   torch.randn(5, k, generator=gen)])
    want = check(kernels, w, x)
    assert int(want[0]) == 5
    check(kernels, w, x * 1e-37)  # activations near float's smallest normal: products lose bits, the slack covers them
    for m in range(x.shape[0]):  # each row alone and in pairs gives its index
        check(kernels, w, x[m : m + 1])
        check(kernels, w, x[m : m + 2])


def test_non_finite_values_take_the_exact_path(kernels):
    n, k = 520, 64
    raw = random_blocks(QType.Q8_0, n, k, seed=4)
    raw[300, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # a NaN scale: NaN outputs at 300
    x = torch.rand(3, k, generator=torch.Generator().manual_seed(0)) + 0.1
    assert torch.equal(check(kernels, q8(raw, n, k), x), torch.full((3,), 300))
    w = q8(random_blocks(QType.Q8_0, n, k, seed=5), n, k)
    x[1, 7], x[2, 9] = float("inf"), float("nan")
    check(kernels, w, x)


def test_only_8bit_symmetric_weights_and_bad_inputs_are_refused(kernels):
    q41 = ql.pack(canonical(QType.Q4_1, random_blocks(QType.Q4_1, 32, 64, seed=0), (32, 64)))
    assert not ql.boundable(q41) and not ql.boundable(ql.split(q8(random_blocks(QType.Q8_0, 32, 64, seed=0), 32, 64)))
    with pytest.raises(ValueError, match="8-bit symmetric"):
        ql.argmax_bound(kernels, q41)
    w = q8(random_blocks(QType.Q8_0, 32, 64, seed=0), 32, 64)
    bound = ql.argmax_bound(kernels, w)
    with pytest.raises(ValueError, match="quantized argmax takes"):
        ql.bounded_argmax(kernels, torch.randn(2, 32), w, bound)
    with pytest.raises(RuntimeError, match="bound must be float32"):
        ql.bounded_argmax(kernels, torch.randn(2, 64), w, bound[:1])
    with pytest.raises(RuntimeError, match="8-bit symmetric"):
        kernels.quant_argmax_bounded(torch.randn(2, 64), *q41.op_args, bound)


@pytest.mark.parametrize("isa", _isa_builds())
def test_every_instruction_set_build_gives_the_same_index(kernels, isa):
    from deepinfer.ops import cpu_ops

    other = cpu_ops.load(isa)
    assert other is not None, f"the {isa} build failed"
    n, k = 300, 96
    w = q8(random_blocks(QType.Q8_0, n, k, seed=8), n, k)
    d = torch.from_numpy(canonical(QType.Q8_0, random_blocks(QType.Q8_0, n, k, seed=8), (n, k)).dequantize())
    gen = torch.Generator().manual_seed(8)
    x = torch.cat([2 * d[:5] + 0.1 * torch.randn(5, k, generator=gen), torch.randn(4, k, generator=gen)])
    assert torch.equal(ql.argmax_bound(other, w), ql.argmax_bound(kernels, w))
    assert torch.equal(ql.bounded_argmax(other, x, w, ql.argmax_bound(other, w)), ql.argmax(kernels, x, w))


def test_greedy_tokens_are_the_same_with_the_two_pass_head(kernels, monkeypatch):
    from deepinfer import LLM

    calls = []
    real = ql.bounded_argmax
    monkeypatch.setattr(ql, "bounded_argmax", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Dear Sir,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for on in (False, True):
        llm = LLM(kv_cache_memory=128 << 20, bounded_head=on)  # the bundled GGUF: a tied Q8_0 head
        assert (llm.engine.executor.runner.model.lm_head.weight.argmax_bound is not None) == on
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
        del llm
    assert outputs[0] == outputs[1]
    assert calls and max(calls) == len(prompts)  # the batch's greedy steps took the two passes


def test_auto_bounds_the_head_only_where_the_ops_are_avx2_without_vnni(kernels):
    from deepinfer.config import EngineConfig
    from deepinfer.worker.executor import apply_bounded_head

    class Ops:
        def __init__(self, isa):
            self.isa = lambda: isa

    auto = EngineConfig.from_kwargs(env={})
    assert auto.bounded_head is None
    for isa in ("avx512-vnni", "avx2-vnni", "generic"):
        assert apply_bounded_head(auto, None, Ops(isa)).startswith("no (auto: AVX2 without VNNI only")
    assert apply_bounded_head(auto, None, Ops("avx2")).startswith("no (not an 8-bit symmetric head")
    assert apply_bounded_head(auto, None, None) == "no (no compiled CPU ops)"
    off = EngineConfig.from_kwargs(env={"DEEPINFER_BOUNDED_HEAD": "0"})
    assert apply_bounded_head(off, None, Ops("avx2")) == "no (DEEPINFER_BOUNDED_HEAD=0)"
    assert EngineConfig.from_kwargs(env={"DEEPINFER_BOUNDED_HEAD": "1"}).bounded_head is True
    with pytest.raises(ValueError, match="DEEPINFER_BOUNDED_HEAD must be 0, 1 or auto"):
        EngineConfig.from_kwargs(env={"DEEPINFER_BOUNDED_HEAD": "maybe"})
