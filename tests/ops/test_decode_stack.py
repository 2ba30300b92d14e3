"""The decode stack (layers/decode_stack.py, ops/csrc/decode_stack.cpp) against the module path it replaces on
decode, prefill and mixed steps: the same tokens and the same logprobs, bit for bit, on tiny random Llama-family and
Gemma 3 models quantized at load and on the bundled SmolLM2; and it is really taken on those steps and refused where
it cannot be exact."""
import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.layers.attention import PAGED_PREFILL_MAX
from deepinfer.layers.decode_stack import DecodeStack
from deepinfer.llm import LLM

from ..models.hf_reference import save_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
VARIANTS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True), {}),
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=24), {}),
    "qwen2-bias-bf16-kv": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False),
                           dict(kv_cache_dtype="bfloat16")),
    "qwen3-qknorm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=64), {}),
    "llama-fp8-kv": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True),
                     dict(kv_cache_dtype="fp8")),
    # both layer kinds (sliding layers attend through their own group's tables), offset norms, GELU, QK norms
    "gemma3-window": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                      dict(head_dim=64, num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=64,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"]), {}),
}
# mixed lengths: rows of one decode step sit at different positions, some past a block and past the window
PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40)), [7], list(range(100, 150))]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def stack_of(llm: LLM):
    return llm.engine.executor.runner.model.model


def run(llm: LLM, prompts, use_stack: bool, stack: DecodeStack) -> tuple[list, list]:
    stack_of(llm).decode_stack = stack if use_stack else None
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def count_calls(stack: DecodeStack, calls: list[int] | None = None) -> list[int]:
    """Wraps the stack so each call that computed (did not hand back to the module path) is counted, and each call
    in `calls` when given."""
    taken = [0]
    original = stack.__call__

    class Counting(DecodeStack):
        def __call__(self, x, positions):
            out = original(x, positions)
            taken[0] += out is not None
            if calls is not None:
                calls[0] += 1
            return out

    stack.__class__ = Counting
    return taken


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, extra, options = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**{**BASE, **extra}), path)
    return LLM(str(path), quantization="int8", kv_cache_memory=16 << 20, block_size=16, enable_prefix_caching=False,
               **options)


def test_tiny_models_same_bits_with_and_without_the_stack(tiny):
    stack = stack_of(tiny).decode_stack
    assert stack is not None, "the stack should be on for a plain Llama-family model on quantized weights"
    taken = count_calls(stack)
    for prompts in ([PROMPTS[1]], PROMPTS):  # alone, and in a mixed batch
        off = run(tiny, prompts, False, stack)
        taken[0] = 0
        on = run(tiny, prompts, True, stack)
        assert taken[0] >= PARAMS.max_tokens - 1  # every decode-only step went through the stack
        assert on == off


def test_refused_where_it_cannot_be_exact(tmp_path):
    dense = tmp_path / "llama"
    save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(**BASE), dense)
    assert stack_of(LLM(str(dense), kv_cache_memory=8 << 20)).decode_stack is None  # exact float32 weights
    # its ops compute each row on its own, as the batch-invariant mode's module path now does: taken there too
    assert stack_of(LLM(str(dense), quantization="int8", kv_cache_memory=8 << 20,
                        batch_invariant=True)).decode_stack is not None


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_bundled_model_same_bits_with_and_without_the_stack(batch_invariant):
    llm = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, batch_invariant=batch_invariant)
    stack = stack_of(llm).decode_stack
    assert stack is not None
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in ("The capital of France is", "def fibonacci(n):",
                                          "Once upon a time, in a small village by the sea, there lived")]
    assert run(llm, prompts, True, stack) == run(llm, prompts, False, stack)


def test_prefill_and_mixed_steps_same_bits_and_long_contexts_refused(tmp_path):
    """A small token budget chunks the prompts, so steps hold decode rows and prompt chunks together: every step goes
    through the stack, with the module path's bits, chunks whose cached context passes PAGED_PREFILL_MAX (3,072)
    included. A whole prompt past it with nothing cached (the module path runs torch's attention on its fresh K/V)
    is handed back, and still nothing differs. A tiny int8 Llama whose context holds such prompts: the bundled
    model's long prompts took a minute of the suite for the same paths (its steps are checked above)."""
    path = tmp_path / "llama-long"
    save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 4096},
                                                                     tie_word_embeddings=True), path)

    def engine(budget: int) -> LLM:
        return LLM(str(path), quantization="int8", kv_cache_memory=64 << 20, enable_prefix_caching=False,
                   max_num_batched_tokens=budget)

    def ids(start: int, n: int) -> list[int]:
        return [3 + (start + i) % 500 for i in range(n)]

    llm = engine(40)
    stack = stack_of(llm).decode_stack
    assert stack is not None
    calls = [0]
    taken = count_calls(stack, calls)
    prompts = [ids(300, 7), ids(100, 90), [42], ids(200, 33)]
    off = run(llm, prompts, False, stack)
    calls[0] = taken[0] = 0
    assert run(llm, prompts, True, stack) == off
    assert taken[0] == calls[0] > PARAMS.max_tokens  # prefill and mixed steps included
    long_prompts = [ids(100, PAGED_PREFILL_MAX + 60), [7, 8, 9]]
    for budget, whole in ((1000, False), (PAGED_PREFILL_MAX + 128, True)):  # 4 chunks (the last one's context
        chunked = engine(budget)                                            # passes the limit), or one chunk
        stack = stack_of(chunked).decode_stack
        calls = [0]
        taken = count_calls(stack, calls)
        off = run(chunked, long_prompts, False, stack)
        calls[0] = taken[0] = 0
        assert run(chunked, long_prompts, True, stack) == off
        assert (0 < taken[0] < calls[0]) if whole else (taken[0] == calls[0])


def test_bad_rows_are_refused_not_computed():
    llm = LLM(kv_cache_memory=16 << 20)
    stack = stack_of(llm).decode_stack
    caches = llm.engine.executor.runner.kv_caches
    compiled = stack._compiled(caches, None)
    slots = caches[0][0].shape[0]
    x = torch.zeros(1, 576)
    ok = dict(positions=torch.tensor([3]), slots=torch.tensor([3]), tables=torch.zeros(1, 1, dtype=torch.int64),
              lens=torch.tensor([4]))
    bad = {"slot out of range": dict(slots=torch.tensor([slots])),
           "position out of range": dict(positions=torch.tensor([10**7])),
           "context length out of range": dict(lens=torch.tensor([17])),
           "block out of range": dict(tables=torch.tensor([[slots]]))}
    for message, change in bad.items():
        args = {**ok, **change}
        with pytest.raises(RuntimeError, match=message):
            compiled.forward(x, args["positions"], [args["slots"]], [args["tables"]], [args["lens"]], 16)
    assert compiled.forward(x, ok["positions"], [ok["slots"]], [ok["tables"]], [ok["lens"]], 16).shape == (1, 576)
    with pytest.raises(RuntimeError, match="per group"):
        compiled.forward(x, ok["positions"], [], [], [], 16)


def test_prompt_rows_on_amx_tiles_same_bits_with_and_without_the_stack(kernels):
    """With prompt rows on AMX tiles (ops/wide_linear.py), a step whose prompt rows come last computes them on
    the tiles inside the stack, the module path's bits; prompt rows elsewhere are handed back to the module path."""
    from deepinfer.ops.wide_linear import available
    if not available(kernels):
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused AMX tile state)")
    llm = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, max_num_batched_tokens=40, amx_prefill=True)
    stack = stack_of(llm).decode_stack
    assert stack.tiles
    tiles = []
    original = DecodeStack._tile_from

    def spy(self, runs, rows):
        tiles.append(original(self, runs, rows))
        return tiles[-1]

    stack._tile_from = spy.__get__(stack)
    prompts = [list(range(300, 307)), list(range(1000, 1090)), [42], list(range(2000, 2033))]
    off = run(llm, prompts, False, stack)
    assert run(llm, prompts, True, stack) == off
    assert any(t is not None and t >= 0 for t in tiles) and -1 in tiles  # prompt steps on the tiles, decodes not
    assert stack._tile_from((), 5) == -1 and stack._tile_from(((2, 5),), 5) == 2
    assert stack._tile_from(((0, 2),), 5) is None and stack._tile_from(((0, 2), (3, 5)), 5) is None
