"""Prompt rows on AMX tiles (ops/wide_linear.py, csrc/amx_linear.cpp) against a float64 reference on the same
bfloat16-rounded operands; the weight's bfloat16 values, dequantized from its blocks in the kernel, against the
format's own dequantization for every packed format; a row's bits alone and inside any batch; the layer that routes
a step's prompt rows to them and its other rows to the quantized blocks.

The kernel needs a CPU with AMX-BF16 (Intel Sapphire Rapids and later) and runs only there; the routing of rows and
the refusals run everywhere.
"""
import numpy as np
import pytest
import torch

from deepinfer.layers.context import AttentionMetadata, ForwardContext, forward_context
from deepinfer.layers.quantized import QuantizedLinear
from deepinfer.ops import cpu_ops
from deepinfer.ops import quant_linear as ql
from deepinfer.ops import wide_linear as wl
from deepinfer.worker.inputs import RequestRows, prompt_runs

REL = 2e-6  # |kernel - reference| / sum_k |w_k x_k|: float32 sums of exact bfloat16 products over K <= 1536


@pytest.fixture(scope="module")
def amx(kernels):
    if not wl.available(kernels):
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused AMX tile state): the kernel cannot run here")
    return kernels


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    out = xb @ wb.T + (0 if bias is None else bias.double())
    return out, xb.abs() @ wb.abs().T + (0 if bias is None else bias.double().abs())


def int4(n: int, k: int, seed: int = 0) -> ql.Canonical:
    return ql.quantize_int4(np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32))


# every packed format (ops/quant_linear.QuantFormat): GGUF's legacy types, Q4_K / Q5_K (float32 scales, stored
# offsets), Q6_K (8 bits in groups of 16), and symmetric 4- and 5-bit with their c
FORMATS = [ql.QuantFormat(4, 32, "float16", True), ql.QuantFormat(4, 32, "float16", False, -8),
           ql.QuantFormat(5, 32, "float16", False, -16), ql.QuantFormat(5, 32, "float32", True),
           ql.QuantFormat(8, 32, "float16", False, -128), ql.QuantFormat(8, 16, "float32", False, -32),
           ql.QuantFormat(4, 32, "float32", True)]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_tiles_weight_is_the_blocks_dequantized_values_in_bfloat16(amx, fmt):
    """One-hot rows read the kernel's bfloat16 weight back exactly: it must be the format's own dequantization
    (Canonical.dequantize) rounded to nearest even, padding columns included nowhere."""
    rng = np.random.default_rng(fmt.bits * 100 + fmt.group)
    n, k = 37, 96
    u = rng.integers(0, 2**fmt.bits, (n, k)).astype(np.uint8)
    scales = rng.uniform(1e-3, 3e-2, (n, k // fmt.group)).astype(np.float16).astype(np.float32)
    offsets = rng.uniform(-0.2, 0.2, (n, k // fmt.group)).astype(np.float16).astype(np.float32) if fmt.affine else None
    canonical = ql.Canonical(fmt, u, scales, offsets)
    got = wl.linear(amx, torch.eye(k), ql.pack(canonical))
    assert torch.equal(got.T, torch.from_numpy(canonical.dequantize()).bfloat16().float())


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 96), (16, 32), (50, 64)])
def test_kernel_matches_reference(amx, n, k):
    torch.manual_seed(n + k)
    canonical, x, bias = int4(n, k, n + k), torch.randn(45, k), torch.randn(n)
    w = torch.from_numpy(canonical.dequantize())
    for b in (None, bias):
        got = wl.linear(amx, x, ql.pack(canonical), b)
        want, scale = reference(x, w, b)
        assert got.shape == (45, n) and got.dtype == torch.float32
        assert ((got.double() - want).abs() / scale).max() < REL


def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count(amx):
    torch.manual_seed(0)
    packed, x, bias = ql.pack(int4(100, 1536)), torch.randn(300, 1536), torch.randn(100)
    whole = wl.linear(amx, x, packed, bias)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 15, 16, 17, 31, 33, 64, 255, 256):
                for start in (0, 5, 300 - m):
                    assert torch.equal(wl.linear(amx, x[start : start + m].contiguous(), packed, bias),
                                       whole[start : start + m]), (t, m, start)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_refused(amx):
    packed = ql.pack(int4(32, 64))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        wl.linear(amx, torch.randn(3, 32), packed)
    with pytest.raises(RuntimeError, match="bias"):
        amx.amx_linear(torch.randn(3, 64), *packed.op_args, torch.randn(31))
    with pytest.raises(RuntimeError, match="does not fit"):
        amx.amx_linear(torch.randn(3, 64), *packed.op_args[:-1], 48, None)
    assert wl.linear(amx, torch.randn(0, 64), packed).shape == (0, 32)


def test_a_build_without_avx512_has_no_amx_kernel_and_says_why():
    built = cpu_ops.load("avx2")
    if built is None:
        pytest.fail("the AVX2 build of the compiled ops failed")
    assert not wl.available(built)
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        built.amx_linear(torch.randn(2, 64), *ql.pack(int4(16, 64)).op_args, None)


def test_prompt_runs_follow_each_rows_own_position():
    rows = [RequestRows("d1", 0, 1, [], 40, True),  # decode past its prompt
            RequestRows("d2", 1, 1, [7, 8], 9, True),  # decode + drafts: position 9 of a 10-token prompt
            RequestRows("p1", 4, 6, [], 0, True),  # a whole prompt
            RequestRows("p2", 10, 5, [], 8, True),  # a chunk crossing the end of its prompt (recompute)
            RequestRows("p3", 15, 3, [], 20, True)]  # recomputed output tokens only
    lens = {"d1": 12, "d2": 10, "p1": 6, "p2": 11, "p3": 12}
    assert prompt_runs(rows, lens) == ((1, 2), (4, 13))
    assert prompt_runs(rows[:1], lens) == ()


def _layer(kernels, n: int, k: int, tiles: bool) -> QuantizedLinear:
    layer = QuantizedLinear(k, [n], torch.nn.Parameter(torch.randn(n), requires_grad=False), "int4", kernels)
    layer.weight.load_shard(int4(n, k, n), 0)
    layer.weight.finalize(ql.unify, tiles=tiles)
    return layer


def _context(rows: int, runs) -> ForwardContext:
    md = AttentionMetadata(torch.zeros(rows, dtype=torch.int64), 0, None, None)
    return ForwardContext(md, [], torch.arange(rows), prompt_runs=runs)


def test_the_layer_sends_prompt_rows_to_the_tiles_and_the_rest_to_the_blocks(amx):
    layer = _layer(amx, 96, 128, tiles=True)
    w = layer.weight
    assert w.tiles and w.nbytes == w.packed.nbytes  # no copy of the weight
    x = torch.randn(20, 128)
    quant = ql.linear(amx, x, w.packed, layer.bias)
    tiles = wl.linear(amx, x, w.packed, layer.bias)
    assert not torch.equal(quant, tiles)
    for runs in [((0, 20),), ((3, 9),), ((0, 4), (10, 20)), ((19, 20),)]:
        with forward_context(_context(20, runs)):
            got = layer(x)
        prompt = torch.zeros(20, dtype=torch.bool)
        for a, b in runs:
            prompt[a:b] = True
        assert torch.equal(got[prompt], tiles[prompt]) and torch.equal(got[~prompt], quant[~prompt]), runs
    with forward_context(_context(21, ((0, 21),))):  # rows that are not the step's tokens: all on the blocks
        assert torch.equal(layer(x), quant)
    assert torch.equal(layer(x), quant)  # outside a forward pass


def test_without_amx_prompt_rows_stay_on_the_blocks(kernels):
    built = cpu_ops.load("avx2")
    layer = _layer(built, 32, 64, tiles=True)
    assert not layer.weight.tiles
    with forward_context(_context(4, ((0, 4),))):
        assert torch.equal(layer(torch.ones(4, 64)), ql.linear(built, torch.ones(4, 64), layer.weight.packed,
                                                               layer.bias))


class _Ops:
    """Stands in for a build of the compiled ops, with or without the tiles."""

    def __init__(self, tiles: bool) -> None:
        self.tiles = tiles

    def amx_linear(self, *args):
        raise AssertionError("not called here")

    def amx_bf16_available(self) -> bool:
        return self.tiles


def test_the_switch_auto_on_off_and_its_refusals():
    from deepinfer.config import Compute, EngineConfig
    from deepinfer.worker.executor import amx_prefill_choice

    quantized, dense = Compute("float32", "gguf"), Compute("float32", None)
    auto = EngineConfig.from_kwargs(env={})
    assert auto.amx_prefill is None
    assert EngineConfig.from_kwargs(env={"DEEPINFER_AMX_PREFILL": "auto"}).amx_prefill is None
    assert EngineConfig.from_kwargs(env={"DEEPINFER_AMX_PREFILL": "0"}).amx_prefill is False
    on = EngineConfig.from_kwargs(env={"DEEPINFER_AMX_PREFILL": "1"})
    assert on.amx_prefill is True
    with pytest.raises(ValueError, match="DEEPINFER_AMX_PREFILL must be 0, 1 or auto"):
        EngineConfig.from_kwargs(env={"DEEPINFER_AMX_PREFILL": "sometimes"})
    assert amx_prefill_choice(auto, _Ops(True), quantized)[0] is True
    assert amx_prefill_choice(auto, _Ops(False), quantized) == (
        False, "no (this CPU has no AMX-BF16, or the OS did not grant AMX tile state)")
    assert amx_prefill_choice(auto, _Ops(True), dense)[0] is False
    assert amx_prefill_choice(auto, None, quantized)[0] is False
    invariant = EngineConfig.from_kwargs(env={}, batch_invariant=True)
    assert "batch invariance" in amx_prefill_choice(invariant, _Ops(True), quantized)[1]
    assert amx_prefill_choice(EngineConfig.from_kwargs(env={}, batch_invariant=True, amx_prefill=True),
                              _Ops(True), quantized)[0] is True
    assert amx_prefill_choice(EngineConfig.from_kwargs(env={}, amx_prefill=False), _Ops(True), quantized)[0] is False
    for ops, compute, why in [(_Ops(False), quantized, "no AMX-BF16"), (_Ops(True), dense, "dense"),
                              (None, quantized, "no compiled CPU ops")]:
        with pytest.raises(ValueError, match=why):
            amx_prefill_choice(on, ops, compute)


def test_asking_for_it_where_it_cannot_run_is_a_clear_error():
    from deepinfer.llm import LLM

    with pytest.raises(ValueError, match="amx_prefill .* cannot run here: the weights are dense"):
        LLM(dtype="float32", amx_prefill=True, kv_cache_memory=16 << 20)


def test_engine_tokens_do_not_depend_on_batch_chunks_or_cached_prefixes(amx):
    """Prompt rows on the tiles, each row's kernel chosen by its own position: a request gives the same tokens and
    logprobs alone, inside a batch, with its prompt cut into small chunks, and after another request cached its
    prefix (the blocks a prompt computed)."""
    from deepinfer import SamplingParams
    from deepinfer.llm import LLM

    params = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True, logprobs=2)
    shared = list(range(500, 560))
    prompts = [shared + [7, 8, 9], list(range(1000, 1090)), [42], shared + [11]]

    def result(outs):
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]

    llm = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, amx_prefill=True)
    assert llm.engine.executor.runner.prompt_rows_tiles
    alone = [result(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert result(llm.generate(prompts, params, use_tqdm=False)) == alone
    del llm
    chunked = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, amx_prefill=True, max_num_batched_tokens=24)
    assert result(chunked.generate(prompts, params, use_tqdm=False)) == alone
    del chunked
    cached = LLM(kv_cache_memory=64 << 20, amx_prefill=True)
    cached.generate([shared + [1, 2, 3]], params, use_tqdm=False)
    outs = cached.generate(prompts, params, use_tqdm=False)
    assert outs[0].num_cached_tokens >= 48 and result(outs) == alone
