"""Config dict + weights -> a model on its device, ready to run."""
from __future__ import annotations

import logging
from types import ModuleType

import torch

from deepinfer.models.registry import model_class
from deepinfer.ops.cpu_ops import cpu_isa_flags
from deepinfer.transforms.batch_invariant import make_batch_invariant
from deepinfer.transforms.fused_ops import enable_fused_ops
from deepinfer.transforms.onednn import native_bf16, prepack_bf16_linears
from deepinfer.transforms.quantize import finalize_quantized, prepare_quantized

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn}  # fp8_e4m3: KV caches only


def hf_config_object(hf_config: dict):
    """A transformers config object for the dict, so defaults and RoPE parameters match the reference."""
    from transformers import AutoConfig

    fields = dict(hf_config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("model config has no 'model_type'")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError) as e:
        raise ValueError(f"unsupported model_type {model_type!r}: {e}") from e


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("model config names no architecture ('architectures' is empty)")
    return archs[0]


def compute_layers(module: torch.nn.Module, ops: ModuleType | None, batch_invariant: bool, fused_glue: bool) -> None:
    """Points a built model (or its MTP layers) at what computes them, in place: the batch-invariant forms (linear
    layers; norms where the fused ops do not take them) and the fused compiled ops, per-row and so batch invariant
    as they stand, the decode stack included. Model files stay unchanged (quantized layers already are)."""
    glue = fused_glue and ops is not None
    if batch_invariant:
        make_batch_invariant(module, ops, norms=not glue)
    if glue:
        enable_fused_ops(module, ops)


def build_model(hf_config: dict, weights, dtype: str, device: str, max_positions: int,
                batch_invariant: bool = False, quantization: str | None = None, ops: ModuleType | None = None,
                fused_glue: bool = False, huge_pages: bool = True, split_head: int | None = None,
                amx_prefill: bool = False) -> torch.nn.Module:
    """quantization: None (dense weights in dtype) or a transforms/quantize.py mode; its layers compute with the
    compiled ops (ops/cpu_ops.py), or on dequantized float32 weights when `ops` is None. fused_glue: norms,
    activations, rotary and cache writes through the compiled ops too (transforms/fused_ops.py). huge_pages: packed
    weights in 2 MiB pages (ops/huge_pages.py). split_head: an 8-bit LM head of at least this many bytes in split
    planes (greedy steps of few rows read 5/8 of it; ops/quant_linear.SplitWeight); None: not split. amx_prefill:
    quantized linear layers (not the head) compute prompt rows in bfloat16 on AMX tiles."""
    klass = model_class(architecture_of(hf_config))
    config = hf_config_object(hf_config)
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device(device):
        model = klass(config, max_positions)
    summary = prepare_quantized(model, quantization, ops) if quantization else None
    model.load_weights(weights)
    if summary is not None:
        summary = finalize_quantized(model, summary, huge_pages, split_head, tiles=amx_prefill)
        logger.info("quantization %s: %d layers on packed blocks (%.1f MiB; %s)%s%s", summary.mode, summary.quantized,
                    summary.weight_bytes / 2**20, summary.pages(),
                    f"; prompt rows on AMX tiles in {summary.tile_layers} layers" if summary.tile_layers else "",
                    f"; dense: {', '.join(summary.dense)}" if summary.dense else "")
    keep = getattr(model, "fp32_param_suffixes", ())
    for name, param in model.named_parameters():  # buffers (RoPE tables) stay float32
        if not (keep and name.endswith(keep)):
            param.data = param.data.to(torch_dtype)
    compute_layers(model, ops, batch_invariant, fused_glue)
    if torch_dtype == torch.bfloat16 and device == "cpu" and not batch_invariant:
        if native_bf16(cpu_isa_flags()):
            logger.info("bfloat16: %d linear layers pre-packed for oneDNN", prepack_bf16_linears(model))
        else:
            logger.warning("this CPU has no native bfloat16 (AVX512-BF16 or AMX): bfloat16 matmuls run in slow "
                           "emulation, 10-100x slower than float32 on an AVX2-only machine; use the default "
                           "(quantized for GGUF) or --dtype float32")
    return model.eval()
