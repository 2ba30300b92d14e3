"""The batch-invariant transform: swaps a built model's linear layers and norms, keeps its parameters."""
import pytest
import torch
import transformers

from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.transforms import batch_invariant as bi


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = Linear(16, [8, 8], bias=True)
        self.norm = RMSNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # deepinfer's Linear allocates uninitialized weights: fill every parameter
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))


def test_make_batch_invariant_swaps_layers_and_keeps_parameters():
    model = _Tiny()
    before = dict(model.named_parameters())
    x = torch.randn(5, 16)
    expected = (model.proj(x), model.norm(x), model.head(x))
    bi.make_batch_invariant(model)
    assert isinstance(model.proj, bi.InvariantLinear) and isinstance(model.head, bi.InvariantLinear)
    assert isinstance(model.norm, bi.InvariantRMSNorm)
    assert model.head.weight is model.embed.weight  # tied weights stay tied
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    for got, want in zip((model.proj(x), model.norm(x), model.head(x)), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_make_batch_invariant_rejects_moe_and_mla_models():
    from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match="MLAttention, MoE"):
        bi.make_batch_invariant(DeepseekV3ForCausalLM(config, 64))
