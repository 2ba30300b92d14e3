"""The float8 e4m3 KV cache (`kv_cache_dtype="fp8"`, vLLM's name): a quarter of float32's bytes a value, half of
bfloat16's; outputs change, by a measured amount (benchmarks/accuracy.py --modes float32,gguf,gguf-kv-fp8), and the
mode keeps every row's bits whatever batch it runs in. The kernels' own checks: tests/ops (cache write, attention)."""
import os

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig, resolve_compute

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "perplexity_text.md")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "Explain photosynthesis in simple terms:"]


@pytest.fixture(scope="module")
def engines():
    return {kv: LLM(kv_cache_memory=32 << 20, kv_cache_dtype=kv) for kv in ("bfloat16", "fp8")}


def mean_nll(llm: LLM, token_ids: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return -sum(lp[t] for t, lp in zip(token_ids[1:], out.prompt_logprobs[1:])) / (len(token_ids) - 1)


def test_half_the_bytes_of_bfloat16_and_the_text_almost_as_likely(engines):
    assert engines["fp8"].engine.num_blocks == 2 * engines["bfloat16"].engine.num_blocks  # same budget
    with open(TEXT) as f:
        ids = engines["fp8"].get_tokenizer()(f.read()).input_ids[:384]  # one chunk: every query reads the cache
    bf16, fp8 = mean_nll(engines["bfloat16"], ids), mean_nll(engines["fp8"], ids)
    assert abs(fp8 - bf16) < 0.03 * bf16, (fp8, bf16)  # measured: perplexity +1.1% over 3,072 tokens


def test_a_row_has_its_bits_alone_and_in_a_batch(engines):
    llm = engines["fp8"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, together in zip(PROMPTS[:2], batch):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == together.outputs[0].token_ids and alone.logprobs == together.outputs[0].logprobs


def test_bad_names_and_places_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        LLM(kv_cache_memory=8 << 20, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_compute(ModelConfig(model="x", device="cuda"), "safetensors", cuda_available=True,
                        kv_cache_dtype="fp8")


def test_blocks_through_the_kv_store_come_back_as_they_left():
    llm = LLM(kv_cache_memory=32 << 20, kv_cache_dtype="fp8", kv_store="memory")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p * 6 for p in PROMPTS[:2]]  # a few full blocks each
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.kv_store.flush(timeout=30)
    llm.engine.kv.pool.reset_cache()
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.stats().kv_store
    assert again == first and stats.loaded_tokens > 0 and stats.failed_blocks == 0
