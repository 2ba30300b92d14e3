"""Tiny random Qwen3-MoE through the engine: the MoE layer is not DeepSeek-specific (softmax routing, no
shared expert, a dense layer from mlp_only_layers). Logits within atol 1e-4 of transformers, float32."""
import pytest
import torch
import transformers

from deepinfer.llm import LLM
from deepinfer.models import registry

from .hf_reference import hf_greedy, ours_greedy, record_logits, save_tiny

STEPS = 12
PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 30))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("qwen3-moe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add synchronisation
    yield save_tiny(transformers.Qwen3MoeForCausalLM, config, path), str(path)
    torch.set_num_threads(threads)


def test_the_registry_serves_qwen3_moe():
    assert "Qwen3MoeForCausalLM" in registry.supported_architectures()
    assert registry.model_class("Qwen3MoeForCausalLM").__module__ == "deepinfer.models.qwen3_moe"


def test_logits_tokens_and_expert_counts(pair):
    hf, path = pair
    llm = LLM(path, kv_cache_memory=4 << 20, enable_prefix_caching=False, num_threads=1)
    model = llm.engine.executor.runner.model
    executor, steps = llm.engine.executor, []
    execute = executor.execute

    def recording(plan):  # each step's expert counts travel on StepResult.expert_counts
        result = execute(plan)
        if result.expert_counts is not None:
            steps.append(result.expert_counts)
        return result

    executor.execute = recording
    for prompt in PROMPTS:
        seen = record_logits(llm)
        (ours,) = ours_greedy(llm, [prompt], STEPS)
        model.compute_logits = type(model).compute_logits.__get__(model)
        theirs, hf_logits = hf_greedy(hf, prompt, STEPS)
        assert ours == theirs
        torch.testing.assert_close(torch.cat(seen), hf_logits, atol=1e-4, rtol=0)
    counts = [[sum(step[i][e] for step in steps) for e in range(len(steps[0][i]))] for i in range(len(steps[0]))]
    assert len(counts) == 2 and all(sum(c) == sum(len(p) + STEPS - 1 for p in PROMPTS) * 2 for c in counts)
