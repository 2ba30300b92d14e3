"""Speculative decoding on the bundled SmolLM2 and on tiny models: lossless (greedy tokens identical to no
speculation, sampled tokens from the same distribution), deterministic with fixed draft lengths, and leaving no
rejected KV behind."""
import numpy as np
import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.llm import LLM

from ..models.hf_reference import save_tiny
from ..sample.test_rejection import ALPHA, chisquare_pvalue

REPEAT = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, red apple, green pear, yellow banana, "
          "red apple, green pear, yellow banana, red apple,")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
PROMPTS = [REPEAT, CODE, "The capital of France is", "Once upon a time, in a small village by the sea,"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(kv_cache_memory=128 << 20)
    return tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("options", [
    dict(),
    # drafts compete with prompt chunks for the budget, so chunk boundaries move: batch invariance keeps the bits
    dict(max_num_batched_tokens=24, batch_invariant=True),
    dict(enable_prefix_caching=False),
    dict(num_speculative_tokens=5),
], ids=["default", "small-budget", "no-prefix-cache", "k5"])
def test_greedy_tokens_identical_with_ngram_speculation(reference, options):
    """Every decode row is one query computed alone (quantized linear layers and the compiled attention are
    row-wise), so verifying a draft computes the same logits as decoding that token would."""
    expected = reference
    if "max_num_batched_tokens" in options:
        expected = tokens(LLM(kv_cache_memory=128 << 20, **options).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(kv_cache_memory=128 << 20, speculative_method="ngram", **options)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected  # mixed batch
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == expected[:1]  # batch 1
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens


def test_preemption_with_drafts_loses_nothing():
    """A preempted request is recomputed as a prompt: batch invariance makes that give the decode path's bits."""
    expected = tokens(LLM(kv_cache_memory=128 << 20, batch_invariant=True).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(kv_cache_memory=6 << 20, max_model_len=256, speculative_method="ngram", batch_invariant=True)  # bfloat16 KV
    outs = llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert tokens(outs) == expected * 3


def test_kv_returns_to_start_and_no_rejected_block_is_ever_a_hit():
    """Random prompts make most drafts fail. Afterwards every block is free again, and the prefix cache only holds
    the real tokens' KV: continuing each finished sequence from the cache gives what a cold engine gives."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(200, 400, size=int(n))] for n in rng.integers(20, 60, size=6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(kv_cache_memory=32 << 20, speculative_method="ngram", num_speculative_tokens=4, enable_mtp_varlen=False)
    used_before = llm.engine.kv.pool.num_free_blocks
    first = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_draft_tokens > llm.engine.stats().spec_decode.num_accepted_tokens
    assert llm.engine.kv.pool.num_free_blocks == used_before  # cached blocks are free (evictable) blocks
    continued = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, first)]
    warm = llm.generate(continued, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in warm)
    cold = LLM(kv_cache_memory=32 << 20, enable_prefix_caching=False).generate(continued, params, use_tqdm=False)
    assert tokens(warm) == tokens(cold)


def test_seeded_sampling_is_bitwise_reproducible_with_fixed_draft_lengths():
    """Batch invariance, a seq_seed and DEEPINFER_ENABLE_MTP_VARLEN=0: a request alone and in a crowd gives the same
    tokens and logprobs with speculation on."""
    llm = LLM(kv_cache_memory=128 << 20, batch_invariant=True, speculative_method="ngram", enable_mtp_varlen=False)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seq_seed=i, max_tokens=24, logprobs=2) for i in range(2)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(PROMPTS[:2], params)]
    crowd = llm.generate(PROMPTS[:2] + PROMPTS[2:] * 2, params + [GREEDY] * 4, use_tqdm=False)
    for a, c in zip(alone, crowd[:2]):
        assert list(a.token_ids) == list(c.outputs[0].token_ids)
        assert a.logprobs == c.outputs[0].logprobs
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny-vocabulary model: n-grams repeat often, so drafts are common and often wrong."""
    config = transformers.LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-vocab")
    save_tiny(transformers.LlamaForCausalLM, config, path, seed=3)
    return str(path)


def test_sampled_tokens_follow_the_same_distribution(tiny):
    """Output token 6 over 1500 seeds, with and without speculation: a chi-square test of homogeneity."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    seeds = range(1500)
    params = [SamplingParams(temperature=1.0, seq_seed=s, max_tokens=7, ignore_eos=True) for s in seeds]
    counts = {}
    for name, options in (("off", {}), ("ngram", dict(speculative_method="ngram", num_speculative_tokens=3,
                                                       enable_mtp_varlen=False))):
        llm = LLM(tiny, kv_cache_memory=16 << 20, max_num_seqs=256, **options)
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        counts[name] = np.bincount([o.outputs[0].token_ids[6] for o in outs], minlength=12).astype(float)
        if name == "ngram":
            stats = llm.engine.stats().spec_decode
            assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    seen = (counts["off"] + counts["ngram"]) > 0
    off, on = counts["off"][seen], counts["ngram"][seen]
    expected = (off + on) / 2  # equal sample sizes: each row's expectation is the pooled share
    statistic_p = chisquare_pvalue(np.concatenate([off, on]), np.concatenate([expected, expected]))
    assert statistic_p > ALPHA, (off, on)


def test_options_are_checked():
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        LLM(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        LLM(speculative_method="ngram", num_speculative_tokens=0)


def test_spec_decode_counters_reach_prometheus_with_vllm_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from deepinfer.server.metrics import _EngineStatsCollector

    llm = LLM(kv_cache_memory=64 << 20, speculative_method="ngram")
    out = llm.generate([REPEAT], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_accepted_tokens > 0 and out.metrics.num_draft_tokens >= out.metrics.num_accepted_tokens
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(llm.engine.stats, "smol", lambda: 0))
    text = generate_latest(registry).decode()
    stats = llm.engine.stats().spec_decode
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="smol"}} {float(stats.num_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="smol"}} {float(stats.num_accepted_tokens)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="0"}' in text
