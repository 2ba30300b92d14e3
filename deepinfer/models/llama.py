"""The Llama family in one file: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3 (QK norm)."""
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
from deepinfer.spec.mtp import MTPLayer, MultiTokenPredictor


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, list(self.sizes), bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False) and qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx, window)

    def _qkv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(*self._qkv(positions, x)))

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Only the K and V `forward` would cache, for rows whose output nobody reads."""
        _, k, v = self._qkv(positions, x)
        self.attn.write(k, v)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ActAndMul("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """The K and V `forward` would cache, without the attention or the MLP (MTP upkeep rows)."""
        self.self_attn.write_kv(positions, self.input_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(*rope_frequencies(config, head_dim), max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, qkv_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_stack = None  # decode steps' layers in one compiled call (transforms/fused_ops.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.decode_stack is not None:
            out = self.decode_stack(x, positions)  # None: not a decode-only step
            if out is not None:
                return out
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    stacked = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, max_positions, qkv_bias, self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp: MultiTokenPredictor | None = None  # an MTP draft head, attached after loading (build_mtp)
        self._qkv_bias = qkv_bias

    def build_mtp(self) -> MultiTokenPredictor:
        """An (untrained) DeepSeek-style MTP layer for this model: a decoder layer like the others, caching after
        them. spec/mtp_head.py loads a trained one into it."""
        config = self.config
        rotary = self.model.layers[0].self_attn.rotary
        block = LlamaDecoderLayer(config, config.num_hidden_layers, rotary, self._qkv_bias, self.qk_norm)
        attn = block.self_attn
        return MultiTokenPredictor([MTPLayer(config.hidden_size, config.rms_norm_eps, block,
                                             (attn.num_kv_heads, attn.head_dim, attn.head_dim))])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1) without the logits where the head can (layers/quantized.head_argmax)."""
        return head_argmax(self.lm_head, hidden)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per attention layer; an attached MTP layer caches after the main ones."""
        layers = list(self.model.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])
        return [
            KVCacheSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.head_dim, layer.self_attn.attn.sliding_window)
            for layer in layers
        ]

    def optional_weights(self) -> set[str]:
        return {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
