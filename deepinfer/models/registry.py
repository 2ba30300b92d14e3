"""Architecture name (config.architectures[0]) -> model class, imported lazily."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("deepinfer.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("deepinfer.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("deepinfer.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("deepinfer.models.llama", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("deepinfer.models.gemma3", "Gemma3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("deepinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
