"""An 8-bit LM head in split planes (ops/quant_linear.SplitWeight, csrc/split_head.cpp) against the same weight in
the 8-bit layout: the same logits and embedding rows to the bit, and the same argmax from the two-pass bound
(greedy steps of few rows) and from the widened blocks (more rows), with ties, a partial last block, extreme
low planes and non-finite values; every instruction-set build agrees; and greedy decoding gives the same tokens
with DEEPINFER_SPLIT_HEAD on and off."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from deepinfer import SamplingParams
from deepinfer.models.gguf_blocks import canonical
from deepinfer.ops import cpu_ops
from deepinfer.ops import quant_linear as ql
from tests.ops.test_quant_linear import _isa_builds, random_blocks


def both(raw: np.ndarray, n: int, k: int) -> tuple[ql.PackedWeight, ql.SplitWeight]:
    packed = ql.pack(canonical(QType.Q8_0, raw, (n, k)))
    return packed, ql.split(packed)


def check(kernels, packed, split, x):
    assert torch.equal(ql.linear(kernels, x, packed).view(torch.int32), ql.linear(kernels, x, split).view(torch.int32))
    want = ql.argmax(kernels, x, packed)
    assert torch.equal(want, ql.linear(kernels, x, packed).argmax(dim=-1))
    assert torch.equal(ql.argmax(kernels, x, split), want)
    for m in range(x.shape[0]):  # each row alone: the two-pass path
        assert torch.equal(ql.argmax(kernels, x[m : m + 1], split), want[m : m + 1])


@pytest.mark.parametrize("n,k", [(16, 64), (1000, 576), (4099, 640)])
def test_logits_rows_and_argmax_are_the_8bit_layouts(kernels, n, k):
    packed, split = both(random_blocks(QType.Q8_0, n, k, seed=n), n, k)
    assert split.nbytes == packed.nbytes + 8 * split.bound.shape[0]
    gen = torch.Generator().manual_seed(n)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (1, 2, 3, 5, 17):  # up to max_rows rows two-pass, more widened
                check(kernels, packed, split, torch.randn(rows, k, generator=gen))
    finally:
        torch.set_num_threads(threads)
    ids = torch.tensor([[0, n - 1], [n // 2, 7 % n]])
    assert torch.equal(ql.rows(kernels, ids, packed), ql.rows(kernels, ids, split))


def bound_edges_q8(n: int, k: int, low: int) -> np.ndarray:
    """Q8_0 blocks (700 x 128 in the tests) whose quants' low bits (mask `low`: the bits a two-pass head's first pass
    leaves open) are all set in the first half of the rows (the bound's far edge) and all clear in the second (its
    near edge), with rows 5, 300 and 650 equal to row 40: equal outputs in three blocks, the first wins wherever it is
    the largest."""
    raw = random_blocks(QType.Q8_0, n, k, seed=9)
    q = raw.reshape(n, k // 32, 34)[:, :, 2:]
    q[: n // 2] = (q[: n // 2].view(np.int8) | low).view(np.uint8)
    q[n // 2 :] = (q[n // 2 :].view(np.int8) & ~low).view(np.uint8)
    for row in (5, 300, 650):
        raw[row] = raw[40]
    return raw


def test_argmax_of_close_outputs_ties_and_extreme_low_planes(kernels):
    n, k = 700, 128
    gen = torch.Generator().manual_seed(2)
    raw = bound_edges_q8(n, k, 7)  # the 3 low planes
    packed, split = both(raw, n, k)
    w = torch.from_numpy(canonical(QType.Q8_0, raw, (n, k)).dequantize())
    x = torch.cat([w[40:41] * 3, w[300:301] + 0.01 * torch.randn(1, k, generator=gen), torch.randn(6, k, generator=gen)])
    for m in range(x.shape[0]):
        check(kernels, packed, split, x[m : m + 1])
    assert int(ql.argmax(kernels, x[:1], split)) == 5
    # rows that nearly tie: many outputs within the bound of the largest
    near = w[100:101] + w[101:102] + w[102:103]
    check(kernels, packed, split, near)


def test_non_finite_values_take_the_exact_path(kernels):
    n, k = 520, 64
    raw = random_blocks(QType.Q8_0, n, k, seed=4)
    raw[300, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # NaN outputs at 300
    packed, split = both(raw, n, k)
    x = torch.rand(3, k, generator=torch.Generator().manual_seed(0)) + 0.1
    for m in range(3):
        assert int(ql.argmax(kernels, x[m : m + 1], split)) == 300 == int(ql.argmax(kernels, x[m : m + 1], packed))
    packed, split = both(random_blocks(QType.Q8_0, n, k, seed=5), n, k)
    x[1, 7], x[2, 9] = float("inf"), float("nan")
    check(kernels, packed, split, x)


def test_only_8bit_symmetric_weights_split_and_bad_inputs_are_refused(kernels):
    q41 = ql.pack(canonical(QType.Q4_1, random_blocks(QType.Q4_1, 32, 64, seed=0), (32, 64)))
    with pytest.raises(ValueError, match="only 8-bit symmetric"):
        ql.split(q41)
    _, split = both(random_blocks(QType.Q8_0, 32, 64, seed=0), 32, 64)
    with pytest.raises(ValueError, match="quantized argmax takes"):
        ql.argmax(kernels, torch.randn(2, 32), split)
    with pytest.raises(ValueError, match="no bias"):
        ql.linear(kernels, torch.randn(2, 64), split, torch.zeros(32))
    with pytest.raises(RuntimeError, match="out of range"):
        ql.rows(kernels, torch.tensor([32]), split)


# AVX-512 builds with features off, as CPUs without them have (Cascade Lake: VNNI without GFNI and VBMI; Skylake-X:
# none of the three): the low planes unpacked with masked adds, and without VNNI no unpacking in registers
_AVX512_BUILDS = {"avx512-nogfni": ["-mno-gfni", "-mno-avx512vbmi"],
                  "avx512-novnni": ["-mno-gfni", "-mno-avx512vbmi", "-mno-avx512vnni", "-mno-avxvnni"]}


def _split_builds() -> list[str]:
    """The lower builds, and on an AVX-512 CPU with VNNI, GFNI and VBMI the AVX-512 builds without them."""
    flags = cpu_ops.cpu_isa_flags()
    full = {"avx512bw", "avx512_vnni", "gfni", "avx512vbmi"} <= flags
    return _isa_builds() + (list(_AVX512_BUILDS) if full else [])


@pytest.mark.parametrize("isa", _split_builds())
def test_every_instruction_set_build_gives_the_same_bits(kernels, isa):
    if isa in _AVX512_BUILDS:
        other = cpu_ops.build(f"deepinfer_cpu_ops_test_{isa.replace('-', '_')}", ["-march=native", *_AVX512_BUILDS[isa]])
    else:
        other = cpu_ops.load(isa)
    assert other is not None, f"the {isa} build failed"
    packed, split = both(random_blocks(QType.Q8_0, 100, 96, seed=8), 100, 96)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(8))
    assert torch.equal(ql.linear(other, x, split).view(torch.int32), ql.linear(kernels, x, packed).view(torch.int32))
    for rows in (x[:1], x[1:3], x):
        assert torch.equal(ql.argmax(other, rows, split), ql.argmax(kernels, rows, packed))
    assert torch.equal(ql.rows(other, torch.arange(100), split), ql.rows(kernels, torch.arange(100), packed))


def test_greedy_tokens_are_the_same_with_the_split_head(kernels, monkeypatch):
    from deepinfer import LLM

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_SPLIT_HEAD", flag)
        llm = LLM(kv_cache_memory=128 << 20)  # the bundled GGUF: a tied Q8_0 head
        head = llm.engine.executor.runner.model.lm_head.weight.packed
        assert isinstance(head, ql.SplitWeight) == (flag == "1")
        alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        sampled = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                   for o in llm.generate(prompts, seeded, use_tqdm=False)]
        assert alone == batch
        outputs.append((batch, sampled))
        del llm
    assert outputs[0] == outputs[1]


def test_off_by_default_and_auto_splits_only_one_sequence_avx512_engines_whose_head_outgrows_the_cache():
    from deepinfer.config import EngineConfig
    from deepinfer.worker.executor import split_head_bytes

    def config(**kwargs):
        return EngineConfig.from_kwargs(env={}, **kwargs)

    class Ops:
        def __init__(self, isa):
            self.isa = lambda: isa

    ops, limit = Ops("avx512-vnni"), 2 * (cpu_ops.last_level_cache_bytes() or 32 << 20)
    assert split_head_bytes(config(max_num_seqs=1), ops) is None  # off by default
    auto = EngineConfig.from_kwargs(env={"DEEPINFER_SPLIT_HEAD": "auto"}, max_num_seqs=1)
    assert auto.split_head is None and split_head_bytes(auto, ops) == limit
    assert split_head_bytes(auto, Ops("avx2")) is None  # no vector unpacking of the planes: they lose there
    assert split_head_bytes(config(split_head=True), Ops("avx2")) == 0  # asked for: still split (the log warns)
    assert split_head_bytes(config(split_head=None), ops) is None  # many sequences: 3+ rows pay for the unpacking
    assert split_head_bytes(config(split_head=None, max_num_seqs=1, speculative_method="ngram"), ops) is None
    assert split_head_bytes(config(split_head=True), ops) == 0
    assert split_head_bytes(config(split_head=True), None) is None  # no kernels, no planes
    assert EngineConfig.from_kwargs(env={"DEEPINFER_SPLIT_HEAD": "1"}).split_head is True
    assert EngineConfig.from_kwargs(env={}).split_head is False
    with pytest.raises(ValueError, match="DEEPINFER_SPLIT_HEAD must be 0, 1 or auto"):
        EngineConfig.from_kwargs(env={"DEEPINFER_SPLIT_HEAD": "sometimes"})
