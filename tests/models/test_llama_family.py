"""Tiny random Llama-family models: deepinfer vs Hugging Face transformers on identical weights.

Tolerance: logits within atol 1e-4 (float32, same math, different kernels and summation order).
"""
import pytest
import torch
import transformers

from deepinfer.llm import LLM

from .hf_reference import hf_greedy, ours_greedy, record_logits, save_tiny

STEPS = 16
ATOL = 1e-4

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

VARIANTS = {
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3-qknorm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}

PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40)), [7]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    config_cls, model_cls, extra = VARIANTS[request.param]
    config = config_cls(**{**BASE, **extra})
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(model_cls, config, path, shard="40KB" if request.param == "llama-tied" else None)
    return hf, str(path)


def test_logits_and_greedy_tokens_match_transformers(pair):
    hf, path = pair
    llm = LLM(path, kv_cache_memory=8 << 20, block_size=16)
    for prompt in PROMPTS:
        seen = record_logits(llm)
        (ours,) = ours_greedy(llm, [prompt], STEPS)
        theirs, hf_logits = hf_greedy(hf, prompt, STEPS)
        assert ours == theirs
        ours_logits = torch.cat(seen)
        assert ours_logits.shape == hf_logits.shape
        torch.testing.assert_close(ours_logits, hf_logits, atol=ATOL, rtol=0)
        llm.engine.executor.runner.model.compute_logits = type(llm.engine.executor.runner.model).compute_logits.__get__(llm.engine.executor.runner.model)


def test_batched_chunked_and_cached_runs_agree(pair):
    hf, path = pair
    expected = [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]
    for options in (dict(max_num_batched_tokens=8), dict(enable_chunked_prefill=True, max_num_seqs=1),
                    dict(enable_prefix_caching=False)):
        llm = LLM(path, kv_cache_memory=8 << 20, **options)
        assert ours_greedy(llm, PROMPTS, STEPS) == expected
        assert ours_greedy(llm, PROMPTS, STEPS) == expected  # second pass: warm prefix cache
