"""The model tests' core on a GPU, where one is present (`pytest -m cuda`); skipped with the reason elsewhere."""
import pytest
import torch
import transformers

from deepinfer.llm import LLM

from .hf_reference import hf_greedy, ours_greedy, save_tiny

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def test_tiny_llama_on_cuda_matches_transformers(tmp_path):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    llm = LLM(str(tmp_path), device="cuda", kv_cache_memory=8 << 20)
    assert llm.engine.compute.device == "cuda"
    prompts = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40))]
    assert ours_greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16)[0] for p in prompts]


def test_bundled_gguf_on_cuda_computes_dense():
    llm = LLM(device="cuda", kv_cache_memory=64 << 20)
    assert llm.engine.compute.name == "float32" and llm.engine.compute.device == "cuda"
    (out,) = llm.generate(["The capital of France is"], use_tqdm=False)
    assert out.outputs[0].token_ids
