"""Gemma 3 (text): interleaved sliding-window (local) and full (global) attention layers.

Differences from Llama: per-layer-type RoPE (local base 10k, global 1M), QK-norm, sandwich norms around
attention and MLP, RMSNorm scaling by (1 + w), embeddings scaled by sqrt(hidden), gelu-tanh MLP, scores
scaled by query_pre_attn_scalar**-0.5 rather than head_dim**-0.5, optional final logit soft-capping.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.activation import ActAndMul
from deepinfer.layers.attention import Attention
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.quantized import head_argmax
from deepinfer.layers.rotary import RotaryEmbedding, rope_frequencies
from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.models.base import CausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3's defaults, which configs converted from GGUF (and older transformers) leave implicit.
DEFAULT_PATTERN = 6  # every 6th layer is global
DEFAULT_LOCAL_ROPE_BASE = 10000.0
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)


def layer_types(config) -> list[str]:
    """Per layer SLIDING or FULL: config.layer_types, else every `sliding_window_pattern`-th layer is FULL."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None)
        pattern = pattern or DEFAULT_PATTERN
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    types = list(types)
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {n} entries of {SLIDING!r} or {FULL!r}, got {types}")
    return types


def _check_supported(config) -> None:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported (Attention has no score "
            "soft-capping); Gemma 3 checkpoints set it to null"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported by a causal LM")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_activation {activation!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}")


def _rotary(config, head_dim: int, layer_type: str, max_positions: int) -> RotaryEmbedding:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params or layer_type == FULL:
        return RotaryEmbedding(*rope_frequencies(config, head_dim, layer_type=layer_type), max_positions)
    # transformers < 5 keeps the local base in rope_local_base_freq; local layers never scale RoPE.
    base = float(getattr(config, "rope_local_base_freq", None) or DEFAULT_LOCAL_ROPE_BASE)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return RotaryEmbedding(inv_freq, 1.0, max_positions)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, list(self.sizes), bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.rotary = rotary
        scale = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, layer_idx, sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate])
        self.down_proj = Linear(intermediate, hidden)
        self.act = ActAndMul("gelu_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary, sliding_window)
        self.mlp = Gemma3MLP(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_scale = config.hidden_size**0.5
        self.layer_types = layer_types(config)
        rotaries = {t: _rotary(config, config.head_dim, t, max_positions) for t in sorted(set(self.layer_types))}
        windows = {SLIDING: config.sliding_window, FULL: None}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, rotaries[t], windows[t]) for i, t in enumerate(self.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        self.decode_stack = None  # decode steps' layers in one compiled call (transforms/fused_ops.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The reference rounds sqrt(hidden) to the compute dtype before scaling (it matters in bfloat16).
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.decode_stack is not None:
            out = self.decode_stack(x, positions)  # None: not a decode-only step
            if out is not None:
                return out
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    stacked = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        _check_supported(config)
        if SLIDING in layer_types(config) and not config.sliding_window:
            raise ValueError(f"config has sliding-window layers but sliding_window={config.sliding_window!r}")
        self.config = config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.model = Gemma3Model(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1) without the logits where the head can (layers/quantized.head_argmax);
        not under a softcap, whose rounding can make distinct logits equal."""
        return None if self.softcap is not None else head_argmax(self.lm_head, hidden)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [
            KVCacheSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.head_dim, layer.self_attn.attn.sliding_window)
            for layer in self.model.layers
        ]

    def optional_weights(self) -> set[str]:
        return {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", True) else set()

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
