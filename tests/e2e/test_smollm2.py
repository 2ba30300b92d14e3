"""The real bundled model: golden tokens from transformers, and features that must not change greedy output."""
import json
import os
import random

import pytest

from deepinfer import SamplingParams
from deepinfer.llm import LLM

from .compare import assert_greedy_close
from .reference import NUM_TOKENS, PROMPTS, transformers_greedy

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "smollm2_greedy.json")
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_greedy_matches_golden_transformers_tokens(smol):
    with open(GOLDEN) as f:
        golden = json.load(f)
    outs = smol.generate(list(golden), GREEDY, use_tqdm=False)
    for (prompt, expected), out in zip(golden.items(), outs):
        assert out.outputs[0].token_ids == expected, prompt


def test_greedy_matches_live_transformers(smol):
    prompts = PROMPTS[:2]
    expected = transformers_greedy(prompts)
    outs = smol.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def _mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(rng.randrange(5, 200))] for _ in range(n)]


ALONE = 6  # targets also run alone (batch-1 decode is the slow part on a CPU)


@pytest.fixture(scope="module")
def baseline(smol):
    prompts = _mixed_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    batched = [o.outputs[0] for o in smol.generate(prompts, params, use_tqdm=False)]
    return prompts, params, batched


def _check_all(reference, outs, where):
    identical = sum(assert_greedy_close(a, o.outputs[0], f"{where} #{i}") for i, (a, o) in enumerate(zip(reference, outs)))
    assert identical >= len(reference) - 2, f"{where}: only {identical}/{len(reference)} identical"


def test_alone_versus_batch_of_16(smol, baseline):
    prompts, params, batched = baseline
    alone = [smol.generate([p], params, use_tqdm=False)[0] for p in prompts[:ALONE]]
    _check_all(batched[:ALONE], alone, "alone vs batch of 16")


@pytest.mark.parametrize("options", [
    dict(enable_chunked_prefill=False, max_num_batched_tokens=4096),
    dict(max_num_batched_tokens=64),
    dict(max_num_seqs=1),
    dict(enable_prefix_caching=False),
], ids=["chunked-off", "small-chunks", "max-num-seqs-1", "prefix-cache-off"])
def test_engine_options_do_not_change_greedy_output(baseline, options):
    prompts, params, batched = baseline
    if options.get("max_num_seqs") == 1:  # one at a time: keep it to the alone targets
        prompts, batched = prompts[:ALONE], batched[:ALONE]
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, **options)
    _check_all(batched, llm.generate(prompts, params, use_tqdm=False), str(options))


def test_warm_prefix_cache_gives_same_tokens_and_reports_cached(smol):
    system = "<|im_start|>system\nYou are a terse assistant who answers in one sentence.<|im_end|>\n"
    prompts = [system + f"<|im_start|>user\nTell me about the number {i}.<|im_end|>\n<|im_start|>assistant\n" for i in range(4)]
    cold = LLM(dtype="float32", kv_cache_memory=256 << 20, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    smol.generate(prompts[:1], GREEDY, use_tqdm=False)
    warm = smol.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert all(o.num_cached_tokens >= 16 for o in warm)
    assert all(o.num_cached_tokens == 0 for o in cold)


def test_preemption_under_memory_pressure_loses_nothing(baseline):
    prompts, params, batched = baseline
    llm = LLM(dtype="float32", kv_cache_memory=12 << 20, max_model_len=256)  # ~270 tokens of KV for 16 requests: forces preemption
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    _check_all(batched, outs, "preemption")
