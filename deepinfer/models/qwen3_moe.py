"""Qwen3-MoE: Qwen3 attention (QK norm) with softmax top-k routed experts and no shared expert."""
from __future__ import annotations

from deepinfer.layers.moe import FusedExperts, MoE, TopKRouter, number_moe_layers
from deepinfer.models.llama import Qwen3ForCausalLM


def _is_moe_layer(config, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        for i, layer in enumerate(self.model.layers):
            if _is_moe_layer(config, i):  # the dense MLP built by the Llama layer is replaced, never loaded
                gate = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  scoring_func="softmax", norm_topk_prob=bool(config.norm_topk_prob))
                layer.mlp = MoE(gate, FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size))
        number_moe_layers(layer.mlp for layer in self.model.layers)

    def moe_layers(self) -> list[MoE]:
        """The MoE layers in order: EPLB's layer index is the place here."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

