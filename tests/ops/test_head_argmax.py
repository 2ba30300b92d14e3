"""The LM head's fused argmax (quant_linear_argmax) against torch.argmax of the kernel's own outputs: the same index
for every format, row count, thread count and output count (a partial last block of 16), with ties between equal
outputs and rows of NaN; and the runner's greedy steps give the same tokens with it and without."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from deepinfer import SamplingParams
from deepinfer.models.gguf_blocks import BLOCK_VALUES, SUPPORTED, canonical
from deepinfer.ops import quant_linear as ql
from tests.ops.test_quant_linear import random_blocks


def packed_weight(qtype: QType, n: int, k: int, seed: int, repeat: int = 0) -> ql.PackedWeight:
    """n random output rows; with `repeat`, rows 3, 3 + n//2 and n - 1 copy row `repeat` (equal outputs: ties)."""
    raw = random_blocks(qtype, n, k, seed)
    if repeat:
        for row in (3, 3 + n // 2, n - 1):
            raw[row] = raw[repeat]
    return ql.pack(canonical(qtype, raw, (n, k)))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_fused_argmax_is_the_argmax_of_the_outputs(kernels, qtype):
    k = max(BLOCK_VALUES[qtype], 64)
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    try:
        for n in (16, 1000, 4099):  # whole blocks of 16, a partial last block, more blocks than a buffer pass
            for repeat in (0, n // 4):
                w = packed_weight(qtype, n, k, seed=n + repeat, repeat=repeat)
                for rows in (1, 3, 17, 64, 300):
                    x = torch.randn(rows, k, generator=gen)
                    want = ql.linear(kernels, x, w).argmax(dim=-1)
                    for t in (1, 2, 3):
                        torch.set_num_threads(t)
                        got = ql.argmax(kernels, x, w)
                        assert torch.equal(got, want), (qtype.name, n, repeat, rows, t)
    finally:
        torch.set_num_threads(threads)


def test_ties_go_to_the_first_output_and_nan_rows_to_their_first_nan(kernels):
    n, k = 520, 64
    raw = random_blocks(QType.Q8_0, n, k, seed=3)
    raw[:] = raw[7]  # every output row equal: every output equal, the first wins
    w = ql.pack(canonical(QType.Q8_0, raw, (n, k)))
    x = torch.rand(5, k, generator=torch.Generator().manual_seed(0)) + 0.1  # positive: every dot product > 0
    assert torch.equal(ql.argmax(kernels, x, w), torch.zeros(5, dtype=torch.long))
    raw = random_blocks(QType.Q8_0, n, k, seed=4)
    # a NaN scale makes those outputs NaN; torch.argmax gives the first NaN
    for row in (300, 100):
        raw[row, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    w = ql.pack(canonical(QType.Q8_0, raw, (n, k)))
    out = ql.linear(kernels, x, w)
    assert out[:, 100].isnan().all() and torch.equal(out.argmax(dim=-1), torch.full((5,), 100))
    raw[100] = random_blocks(QType.Q8_0, 1, k, seed=5)[0]  # now only 300, in the second thread's columns
    late = ql.pack(canonical(QType.Q8_0, raw, (n, k)))
    want_late = ql.linear(kernels, x, late).argmax(dim=-1)
    assert torch.equal(want_late, torch.full((5,), 300)) and ql.linear(kernels, x, late)[:, 300].isnan().all()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(ql.argmax(kernels, x, w), torch.full((5,), 100))
            assert torch.equal(ql.argmax(kernels, x, late), want_late)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_refused(kernels):
    w = packed_weight(QType.Q8_0, 32, 64, seed=0)
    with pytest.raises(ValueError, match="quantized argmax takes"):
        ql.argmax(kernels, torch.randn(2, 32), w)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quant_linear_argmax(torch.randn(2, 64).double(), *w.op_args)


def test_greedy_steps_give_the_same_tokens_with_the_fused_head_and_without(kernels):
    from deepinfer import LLM

    llm = LLM(kv_cache_memory=128 << 20)  # the bundled GGUF: its head computes on Q8_0 blocks
    model = llm.engine.executor.runner.model
    calls = []
    fused = model.greedy_tokens

    def counting(hidden):
        calls.append(hidden.shape[0])
        return fused(hidden)

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    model.greedy_tokens = counting
    with_fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model.greedy_tokens = lambda hidden: None  # the logits and the sampler's argmax
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del model.greedy_tokens
    assert with_fused == without and calls and max(calls) == len(prompts)
    assert np.array_equal(np.array(with_fused).shape, (4, 24))
