"""The fused-glue transform: norms, gated activations, rotary embeddings and KV cache writes of a built model
compute through the compiled CPU ops (ops/csrc/layer_ops.cpp), one call each instead of several torch ops; and a
Llama-family or Gemma 3 model on quantized weights gets its decode stack (layers/decode_stack.py): a decode-only step's
layers in one call; so does an MTP draft layer whose block is such a layer (its drafting rows in one call).

Rotary and the cache write give the same bits as the torch ops they replace. The norm and the activation round
differently (a fixed per-row order, C exp / tanh). Every op here computes a row on its own in a fixed order, so
the batch-invariant mode takes all of them, the decode stack included, in place of its torch-level fold norm.
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from torch import nn

from deepinfer.layers.activation import ActAndMul
from deepinfer.layers.attention import Attention
from deepinfer.layers.decode_stack import NORMS, DecodeStack
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.quantized import QuantizedLinear
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.gemma3 import Gemma3DecoderLayer, Gemma3MLP, Gemma3Model
from deepinfer.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from deepinfer.spec.mtp import MTPLayer

logger = logging.getLogger("deepinfer")


def enable_fused_ops(model: nn.Module, ops: ModuleType) -> int:
    """Points every supported layer at `ops`, in place; returns how many layers changed."""
    kinds = (RotaryEmbedding, Attention, RMSNorm, ActAndMul)
    changed = 0
    for module in model.modules():
        if type(module) in kinds:
            module.ops = ops
            changed += 1
    if hasattr(ops, "DecodeStack"):
        for module in model.modules():
            if isinstance(module, (LlamaModel, Gemma3Model)):
                _attach_stack(ops, module, [_parts(layer) for layer in module.layers], module.norm,
                              "decode stack (decode steps' layers in one compiled call)")
            elif isinstance(module, MTPLayer):  # a draft head's block and its output norm, the same way
                _attach_stack(ops, module, [_parts(module.block)], module.shared_head.norm, "MTP layer's decode stack")
                eh = module.eh_proj
                if module.decode_stack is not None and isinstance(eh, QuantizedLinear) and eh.weight.packed is not None:
                    module.decode_stack.input_stage = (module.enorm, module.hnorm, eh)  # the layer's input in it too
    return changed


def _attach_stack(ops: ModuleType, module: nn.Module, layers: list, final_norm: nn.Module, what: str) -> None:
    """module.decode_stack: the layers and final norm in one compiled call, or None where the stack cannot run them."""
    why = _stack_blocker(layers, final_norm)
    module.decode_stack = None if why else DecodeStack(ops, layers, final_norm)
    logger.info("%s: %s", what, why or "on")


def _parts(layer: nn.Module) -> dict[str, Any] | None:
    """A decoder layer's parts by role (layers/decode_stack.py), or None for a layer kind the stack does not run."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer) is LlamaDecoderLayer and type(mlp) is LlamaMLP:
        norms = dict(norm_in=layer.input_layernorm, pre_ffn=layer.post_attention_layernorm)
    elif type(layer) is Gemma3DecoderLayer and type(mlp) is Gemma3MLP:
        norms = dict(norm_in=layer.input_layernorm, post_attn=layer.post_attention_layernorm,
                     pre_ffn=layer.pre_feedforward_layernorm, post_ffn=layer.post_feedforward_layernorm)
    else:
        return None
    return dict(norms, qkv=attn.qkv_proj, q_norm=attn.q_norm, k_norm=attn.k_norm, rotary=attn.rotary,
                attn=attn.attn, o=attn.o_proj, gate_up=mlp.gate_up_proj, act=mlp.act, down=mlp.down_proj,
                shape=(attn.num_heads, attn.num_kv_heads, attn.head_dim))


def _stack_blocker(layers: list[dict[str, Any] | None], final_norm: nn.Module) -> str | None:
    """Why the decode stack cannot compute this model exactly as its modules do; None when it can."""
    if not layers or any(parts is None for parts in layers):
        return "off (not a plain Llama or Gemma 3 decoder layer)"
    if len({parts["shape"] for parts in layers}) != 1:
        return "off (layers differ in head shape)"
    for parts in layers:
        linears = [parts[name] for name in ("qkv", "o", "gate_up", "down")]
        if not all(isinstance(m, QuantizedLinear) and m.weight.packed is not None for m in linears):
            return "off (needs quantized weights on the compiled kernels)"
        if parts["rotary"].ops is None or parts["rotary"].interleaved:
            return "off (rotary layout)"
        norms = [parts[name] for name in NORMS if parts.get(name) is not None]
        if any(n.ops is None for n in norms + [final_norm]) or parts["act"].ops is None:
            return "off (norm or activation not on the fused ops)"
        if parts["attn"].head_dim not in (64, 128, 256):
            return "off (head dim)"
    if len({parts["attn"].scale for parts in layers}) != 1 or len({parts["act"].act for parts in layers}) != 1:
        return "off (layers differ in attention scale or activation)"
    return None
