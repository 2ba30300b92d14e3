"""Transformers as the reference for the bundled SmolLM2 GGUF (dequantized, float32)."""
from __future__ import annotations

import os

import torch

from deepinfer.models.gguf_views import plain_gguf_views
from deepinfer.models.loader import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
]
NUM_TOKENS = 32


def transformers_greedy(prompts: list[str], num_tokens: int = NUM_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(None)
    directory, name = os.path.dirname(path), os.path.basename(path)
    with plain_gguf_views():
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            out.append(_greedy_ignoring_eos(model, ids, num_tokens))
    return out


def _greedy_ignoring_eos(model, ids: torch.Tensor, num_tokens: int) -> list[int]:
    """Plain argmax decoding with the model's KV cache; EOS is an ordinary token here (like ignore_eos)."""
    result = model(ids, use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        token = int(result.logits[0, -1].argmax())
        tokens.append(token)
        result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return tokens


if __name__ == "__main__":  # regenerate the golden file: python -m tests.e2e.reference
    import json

    golden = {p: t for p, t in zip(PROMPTS, transformers_greedy(PROMPTS))}
    path = os.path.join(os.path.dirname(__file__), "golden", "smollm2_greedy.json")
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
    print(f"wrote {path}")
