"""DeepSeek-V3: multi-head latent attention, MoE with grouped sigmoid routing and shared experts, MTP layers.

Checkpoints use DeepSeek's tensor names. The MTP layers sit after the main layers (model.layers.{L + k}.*:
enorm, hnorm, eh_proj, the transformer block, shared_head.norm / shared_head.head, embed_tokens); they are
loaded into `self.mtp` when the checkpoint has them, and dropped when it has none (transformers saves
DeepSeek-V3 without them but keeps num_nextn_predict_layers).
"""
from __future__ import annotations

import copy
import logging
import math
import re
from typing import Iterable

import torch
from torch import nn

from deepinfer.layers.mla import MLAttention
from deepinfer.layers.moe import FusedExperts, MoE, TopKRouter, number_moe_layers
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding, rope_frequencies
from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.models.base import CausalLM
from deepinfer.models.weights import check_complete, checkpoint_loaders, load_tensors
from deepinfer.models.llama import LlamaMLP
from deepinfer.spec.mtp import MTPLayer, MultiTokenPredictor

logger = logging.getLogger(__name__)

# topk_method -> (experts chosen within the best groups by, score-correction bias)
TOPK_METHODS = {"noaux_tc": ("top2_sum", True), "group_limited_greedy": ("max", False), "greedy": (None, False)}
# Copies of the main model's embedding and output head kept in each MTP layer; the report (§2.2) shares them.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def mla_softmax_scale(config) -> float:
    """1/sqrt(qk_head_dim), times mscale^2 under YaRN with mscale_all_dim (as DeepSeek's and transformers' code)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    factor = params.get("factor", 1.0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _check_supported(config) -> None:
    if getattr(config, "quantization_config", None):
        raise ValueError(f"quantized DeepSeek-V3 checkpoints are not supported ({config.quantization_config}); use bf16 weights")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    scoring = getattr(config, "scoring_func", "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring!r}")
    method = getattr(config, "topk_method", "noaux_tc")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {sorted(TOPK_METHODS)}, got {method!r}")


def _is_moe_layer(config, layer_idx: int) -> bool:
    return bool(config.n_routed_experts) and layer_idx >= config.first_k_dense_replace and (
        layer_idx % (getattr(config, "moe_layer_freq", 1) or 1) == 0
    )


def build_moe(config) -> MoE:
    group_score, bias = TOPK_METHODS[getattr(config, "topk_method", "noaux_tc")]
    grouped = group_score is not None
    gate = TopKRouter(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        scoring_func=getattr(config, "scoring_func", "sigmoid"),
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
        n_group=(config.n_group or 1) if grouped else 1,
        topk_group=(config.topk_group or 1) if grouped else 1,
        group_score=group_score or "top2_sum",
        correction_bias=bias,
    )
    experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if config.n_shared_experts:
        shared = LlamaMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
    return MoE(gate, experts, shared)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, cache_index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = MLAttention(
            config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, mla_softmax_scale(config),
            rotary, cache_index, eps, bool(getattr(config, "attention_bias", False)),
        )
        if _is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = build_moe(config)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """The K and V `forward` would cache, without the attention or the MLP (MTP upkeep rows)."""
        self.self_attn.write_kv(positions, self.input_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, rotary, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class DeepseekV3ForCausalLM(CausalLM):
    fp32_param_suffixes = (".gate.weight", ".gate.e_score_correction_bias")
    stacked = {
        ".q_a_proj.": (".qkv_a_proj.", 0),
        ".kv_a_proj_with_mqa.": (".qkv_a_proj.", 1),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        rope_config = copy.copy(config)
        rope_config.head_dim = config.qk_rope_head_dim  # the rotary part is all that RoPE touches
        num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        rotary = RotaryEmbedding(
            *rope_frequencies(rope_config, config.qk_rope_head_dim), max_positions + max(num_mtp, 1),
            interleaved=bool(getattr(config, "rope_interleave", True)),
        )
        self.model = DeepseekV3Model(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        number_moe_layers(layer.mlp for layer in self.model.layers)
        self.mtp: MultiTokenPredictor | None = None
        if num_mtp:
            self.mtp = MultiTokenPredictor([self._mtp_layer(config, rotary, k) for k in range(num_mtp)])

    @staticmethod
    def _mtp_layer(config, rotary: RotaryEmbedding, k: int) -> MTPLayer:
        # The block caches after the main layers: at L + k in the paged cache, or in a scratch one (spec/mtp.py).
        block = DeepseekV3DecoderLayer(config, config.num_hidden_layers + k, rotary,
                                       cache_index=config.num_hidden_layers + k)
        shape = (1, block.self_attn.cache_entry_dim, 0)
        return MTPLayer(config.hidden_size, config.rms_norm_eps, block, shape)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One single-head K row per token and layer: latent + RoPE key; no V (MLA recovers it from the latent). MTP
        layers, when loaded, cache after the main layers."""
        layers = list(self.model.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])
        return [KVCacheSpec(1, layer.self_attn.cache_entry_dim, 0) for layer in layers]

    def moe_layers(self) -> list[MoE]:
        """The main model's MoE layers in order (MTP's are not among them): EPLB's layer index is the place here."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def draft_logits(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP depth `depth` over one contiguous sequence (see spec/mtp.py): hidden [T, H] (this model's forward
        output for t_0..t_{T-1}), token_ids [T] = t_1..t_T at `positions` -> (logits [T, V] for t_2..t_{T+1}, h [T, H])."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP layers (num_nextn_predict_layers = 0 or no model.layers.{L}.* tensors)")
        out = self.mtp.run(depth, positions, self.model.embed_tokens(token_ids), hidden)
        return self.compute_logits(out), out

    def optional_weights(self) -> set[str]:
        return {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaders = {self._checkpoint_name(n): f for n, f in checkpoint_loaders(self, self.stacked).items()}
        first_mtp = self.config.num_hidden_layers
        mtp_layers = range(first_mtp, first_mtp + (len(self.mtp.layers) if self.mtp is not None else 0))
        mtp_names = {n for n in loaders if _layer_index(n) in mtp_layers}

        def skip(name: str) -> bool:
            shared_copy = _layer_index(name) in mtp_layers and name.endswith(_MTP_SHARED)
            return name.endswith(self.ignored_suffixes) or shared_copy

        seen = load_tensors(loaders, weights, skip, type(self).__name__)
        expected = set(loaders) - self.optional_weights()
        if self.mtp is not None and not seen & mtp_names:
            logger.info("checkpoint has no MTP layers (model.layers.%d.*): running without multi-token prediction", first_mtp)
            self.mtp = None
            expected -= mtp_names
        check_complete(expected, seen)
        self.tie_weights()

    def _checkpoint_name(self, name: str) -> str:
        """mtp.layers.{k}.block.X / mtp.layers.{k}.X -> model.layers.{L + k}.X (DeepSeek's MTP layout)."""
        match = re.match(r"mtp\.layers\.(\d+)\.(block\.)?", name)
        if match is None:
            return name
        return f"model.layers.{self.config.num_hidden_layers + int(match.group(1))}." + name[match.end():]


def _layer_index(name: str) -> int | None:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None
