"""A tiny random Llama with the bundled SmolLM2 tokenizer: the real tokenizer and chat template, a model that runs
thousands of tokens a second on a CPU. Fuzzing, soak and fault tests exercise the server and the KV store, not the
weights, so they use it to keep CI fast; what they check (no error, the same tokens as without the fault) holds for
any deterministic model. `python tests/reliability/tiny.py DIR` writes one for the scripts in benchmarks/.
"""
from __future__ import annotations

import json
import os
import sys

import torch

VOCAB = 49152  # SmolLM2's
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_tiny_model(path: str, seed: int = 0, changed_weight: str | None = None) -> str:
    """Writes config.json, model.safetensors and the tokenizer into `path`; returns it.

    changed_weight: the name of one tensor whose first element is changed after the seeded init (the same file
    names and sizes, one weight different: what the KV store's model identity must tell apart).
    """
    from safetensors.torch import save_file

    from deepinfer.models.loader import load_model_files, load_tokenizer

    os.makedirs(path, exist_ok=True)
    load_tokenizer(load_model_files(None)).save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    gen = torch.Generator().manual_seed(seed)
    h, inter, layers = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    q, kv = CONFIG["num_attention_heads"] * CONFIG["head_dim"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    # wide random weights, so that logits are far from uniform and greedy tokens depend on the whole context
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.3)
               for name, shape in shapes.items()}
    if changed_weight is not None:
        tensors[changed_weight].view(-1)[0] += 1.0
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
