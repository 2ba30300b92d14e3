"""The fused-glue transform: norms, gated activations, rotary embeddings and KV cache writes of a built model
compute through the compiled CPU ops (ops/csrc/layer_ops.cpp), one call each instead of several torch ops; and a
Llama-family model on quantized weights gets its decode stack (layers/decode_stack.py): a decode-only step's
layers in one call.

Rotary and the cache write give the same bits as the torch ops they replace. The norm and the activation round
differently (a fixed per-row order, C exp / tanh), so the batch-invariant mode, whose reproducibility promise is
tied to its own kernels, takes only the bit-exact two (and no decode stack, which uses all four).
"""
from __future__ import annotations

import logging
from types import ModuleType

from torch import nn

from deepinfer.layers.activation import ActAndMul
from deepinfer.layers.attention import Attention
from deepinfer.layers.decode_stack import DecodeStack
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.quantized import QuantizedLinear
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel

logger = logging.getLogger("deepinfer")


def enable_fused_ops(model: nn.Module, ops: ModuleType, exact_only: bool = False) -> int:
    """Points every supported layer at `ops`, in place; returns how many layers changed."""
    kinds = (RotaryEmbedding, Attention) if exact_only else (RotaryEmbedding, Attention, RMSNorm, ActAndMul)
    changed = 0
    for module in model.modules():
        if type(module) in kinds:
            module.ops = ops
            changed += 1
    if not exact_only and hasattr(ops, "DecodeStack"):
        for module in model.modules():
            if isinstance(module, LlamaModel):
                why = _stack_blocker(module)
                module.decode_stack = None if why else _decode_stack(module, ops)
                logger.info("decode stack (decode steps' layers in one compiled call): %s", why or "on")
    return changed


def _stack_blocker(model: LlamaModel) -> str | None:
    """Why the decode stack cannot compute this model exactly as its modules do; None when it can."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP:
            return "off (not a plain Llama decoder layer)"
        if attn.q_norm is not None:
            return "off (QK norm)"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, QuantizedLinear) and m.weight.packed is not None for m in linears):
            return "off (needs quantized weights on the compiled kernels)"
        if attn.rotary.ops is None or attn.rotary.interleaved:
            return "off (rotary layout)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.ops is None or n.offset != 0 for n in norms) or mlp.act.ops is None:
            return "off (norm or activation not on the fused ops)"
        if attn.attn.head_dim not in (64, 128, 256):
            return "off (head dim)"
    if model.norm.ops is None or model.norm.offset != 0 or not model.layers:
        return "off (final norm)"
    return None


def _decode_stack(model: LlamaModel, ops: ModuleType) -> DecodeStack:
    first = model.layers[0].self_attn
    layers = [dict(norm1=layer.input_layernorm, qkv=layer.self_attn.qkv_proj, attn=layer.self_attn.attn,
                   o=layer.self_attn.o_proj, norm2=layer.post_attention_layernorm, gate_up=layer.mlp.gate_up_proj,
                   down=layer.mlp.down_proj) for layer in model.layers]
    return DecodeStack(ops, layers, model.norm, (first.num_heads, first.num_kv_heads, first.head_dim),
                       first.attn.scale, model.layers[0].mlp.act.act, first.rotary.cos, first.rotary.sin)
