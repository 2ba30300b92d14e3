"""The model tests' core on a GPU, where one is present (`pytest -m cuda`); skipped with the reason elsewhere."""
import pytest
import torch
import transformers

from deepinfer.llm import LLM

from .hf_reference import hf_greedy, ours_greedy, save_tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.cuda
@needs_cuda
def test_tiny_llama_on_cuda_matches_transformers(tmp_path):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    llm = LLM(str(tmp_path), device="cuda", kv_cache_memory=8 << 20)
    assert llm.engine.compute.device == "cuda"
    prompts = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40))]
    assert ours_greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16)[0] for p in prompts]


@pytest.mark.cuda
@needs_cuda
def test_bundled_gguf_on_cuda_computes_dense():
    llm = LLM(device="cuda", kv_cache_memory=64 << 20)
    assert llm.engine.compute.name == "float32" and llm.engine.compute.device == "cuda"
    (out,) = llm.generate(["The capital of France is"], use_tqdm=False)
    assert out.outputs[0].token_ids


def test_rotary_tables_are_built_on_the_device_being_built_for():
    """transformers computes scaled RoPE frequencies on the CPU; the tables must follow the model's device (on a GPU
    this failed until the frequencies were moved). Runs everywhere: the meta device stands in for CUDA."""
    from deepinfer.layers.rotary import RotaryEmbedding, rope_frequencies

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    inv_freq, scaling = rope_frequencies(config, 16)
    assert inv_freq.device.type == "cpu"
    with torch.device("meta"):
        rotary = RotaryEmbedding(inv_freq, scaling, 32)
    assert rotary.cos.device.type == "meta" and rotary.cos.shape == (32, 8)
