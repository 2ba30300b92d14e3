"""Quantized compute end to end: the default for a GGUF model, measured against the exact float32 path.

Stated shares (measured on the bundled SmolLM2 Q4_1, see the README's accuracy table): teacher-forced on the float32
greedy continuations of the golden prompts, the quantized model's top-1 token agrees at >= 90% of positions.
"""
import json
import os

import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.layers.quantized import QuantizedEmbedding, QuantizedLinear
from deepinfer.llm import LLM
from deepinfer.models.loader import resolve_model_path

from ..models.hf_reference import save_tiny

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "smollm2_greedy.json")
TEACHER_FORCED_AGREEMENT = 0.90


@pytest.fixture(scope="module")
def quant():
    llm = LLM(kv_cache_memory=256 << 20, batch_invariant=True)
    assert llm.engine.compute.name == "float32+gguf"
    return llm


def teacher_forced_agreement(llm: LLM, continuations: dict[str, list[int]]) -> float:
    tok = llm.get_tokenizer()
    agree = total = 0
    for prompt, tokens in continuations.items():
        ids = tok(prompt).input_ids
        seq = ids + tokens
        (out,) = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        for i in range(len(ids), len(seq)):
            top = max(out.prompt_logprobs[i].items(), key=lambda kv: kv[1])[0]
            agree += top == seq[i]
            total += 1
    return agree / total


def test_gguf_default_agrees_with_float32_greedy(quant):
    with open(GOLDEN) as f:
        golden = json.load(f)  # float32 greedy tokens (transformers and our dense path agree on them)
    assert teacher_forced_agreement(quant, golden) >= TEACHER_FORCED_AGREEMENT


def test_weights_stay_near_the_file_size(quant):
    model = quant.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    assert len(layers) == 30 * 4 + 2  # fused qkv, o, fused gate|up, down per layer; embedding; tied head
    packed = {id(m.weight): m.weight.nbytes for m in layers}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one table for the head and the lookup
    assert not any(p.numel() > 1 << 20 for p in model.parameters())  # no dense copy of a matrix kept
    assert sum(packed.values()) <= 1.2 * os.path.getsize(resolve_model_path(None))


SYSTEM = ("<|im_start|>system\nYou are a careful assistant. Answer briefly, in plain words, and never repeat the "
          "question back to the user.<|im_end|>\n")


def _requests():
    prompts = [SYSTEM + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("What is the capital of France?", "Write a haiku.", "Count to five.", "Name a fruit.")]
    return prompts, [SamplingParams(temperature=0.8, top_p=0.9, seq_seed=i, max_tokens=12, logprobs=2)
                     for i in range(len(prompts))]


def _key(out):
    seq = out.outputs[0]
    return seq.token_ids, seq.logprobs


def test_batch_invariance_holds_in_quantized_mode(quant):
    """Every row of a quantized linear layer runs the same code whatever the batch: alone, in a crowd, with its
    prompt chunked and after a prefix hit, a seeded request gives the same tokens and logprobs, bit for bit."""
    prompts, params = _requests()
    alone = [_key(quant.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    crowd_prompts = prompts + [f"Filler prompt number {i} with some words" for i in range(6)]
    crowd_params = params + [SamplingParams(temperature=0, max_tokens=20 - i) for i in range(6)]
    crowd = quant.generate(crowd_prompts, crowd_params, use_tqdm=False)
    assert [_key(o) for o in crowd[: len(prompts)]] == alone
    chunked = LLM(kv_cache_memory=64 << 20, batch_invariant=True, max_num_batched_tokens=5,
                  enable_prefix_caching=False)
    assert [_key(o) for o in chunked.generate(prompts, params, use_tqdm=False)] == alone
    again = quant.generate(prompts, params, use_tqdm=False)  # prompts now in the prefix cache
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert [_key(o) for o in again] == alone


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_and_int4_quantize_safetensors_at_load(tmp_path, mode):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    hf = save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    llm = LLM(str(tmp_path), quantization=mode, kv_cache_memory=8 << 20)
    assert llm.engine.compute.name == f"float32+{mode}"
    model = llm.engine.executor.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert model.lm_head.weight.packed.fmt.bits == 8  # the head stays int8 under int4
    prompt = [5, 17, 99, 3, 250, 11, 42]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    # greedy: a sampled token outside the top 20 would join the dict with a tail logprob, whose quantization error is
    # larger (an unseeded draw made this flaky)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)
    top = out.outputs[0].logprobs[0]
    want_lp = torch.log_softmax(want, -1)
    err = max(abs(lp - float(want_lp[t])) for t, lp in top.items())
    assert err < (0.05 if mode == "int8" else 0.4), err


def test_quantization_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="computes activations in float32"):
        LLM(quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="int3")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    save_tiny(transformers.LlamaForCausalLM, config, tmp_path)
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        LLM(str(tmp_path), quantization="gguf")
    assert LLM(str(tmp_path), kv_cache_memory=1 << 20).engine.compute.name == "float32"
    assert LLM(dtype="float32", kv_cache_memory=8 << 20).engine.compute.name == "float32"
