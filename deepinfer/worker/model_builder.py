"""Config dict + weights -> a model on its device, ready to run."""
from __future__ import annotations

import logging

import torch

from deepinfer.models.registry import model_class

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def build_model(hf_config: dict, weights, dtype: str, device: str, max_positions: int,
                batch_invariant: bool = False) -> torch.nn.Module:
    klass = model_class(architecture_of(hf_config))
    config = hf_config_object(hf_config)
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device(device):
        model = klass(config, max_positions)
    model.load_weights(weights)
    keep = getattr(model, "fp32_param_suffixes", ())
    for name, param in model.named_parameters():  # buffers (RoPE tables) stay float32
        if not (keep and name.endswith(keep)):
            param.data = param.data.to(torch_dtype)
    if batch_invariant:  # a transform after build: model files stay unchanged
        from deepinfer.transforms.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    return model.eval()
