"""A trained MTP draft head on disk (`deepinfer train-mtp` writes one): mtp.safetensors with the layer's tensors
under their checkpoint names (enorm, hnorm, eh_proj, block.* as a Hugging Face decoder layer names them,
shared_head.norm), and mtp.json saying which model it was trained for."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

WEIGHTS, META = "mtp.safetensors", "mtp.json"


@dataclass(frozen=True)
class MTPHeadMeta:
    base_model: str  # the model file it was trained on (its base name)
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    train: dict[str, Any]  # how it was trained: tokens, steps, seconds, acceptance measured at the end
    # token ids the head drafts from (the most frequent in its training text), or empty for the whole vocabulary:
    # drafts are verified exactly, so a smaller draft vocabulary only makes the LM head cheaper per draft
    draft_vocab: list[int] = field(default_factory=list)


def default_head_dir(model_path: str) -> str:
    """A per-user cache directory for the head of one model file (never inside the repository)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "deepinfer", "mtp", os.path.splitext(os.path.basename(model_path))[0])


def save_head(directory: str, tensors: dict[str, torch.Tensor], meta: MTPHeadMeta) -> str:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, META), "w") as f:
        json.dump(asdict(meta), f, indent=2)
    return directory


def load_head(model: torch.nn.Module, directory: str, hf_config: dict, prepare=None) -> MTPHeadMeta:
    """Builds the model's MTP layer (model.build_mtp()), loads the head into it and attaches it as model.mtp.
    prepare(mtp) runs before the weights load (the quantization transform); finalize(mtp) after, if it returns
    one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from deepinfer.models.weights import check_complete, checkpoint_loaders, load_tensors

    weights, meta_path = os.path.join(directory, WEIGHTS), os.path.join(directory, META)
    if not (os.path.isfile(weights) and os.path.isfile(meta_path)):
        raise ValueError(f"{directory!r} holds no MTP head ({WEIGHTS} and {META}); train one with deepinfer train-mtp")
    try:
        with open(meta_path) as f:
            meta = MTPHeadMeta(**json.load(f))
    except (ValueError, TypeError) as exc:  # not JSON, or not the fields train-mtp writes
        raise ValueError(f"the MTP head's {META} in {directory!r} cannot be read ({exc}); train the head again with "
                         f"deepinfer train-mtp") from exc
    wanted = (hf_config["hidden_size"], hf_config["vocab_size"], hf_config["num_hidden_layers"])
    if (meta.hidden_size, meta.vocab_size, meta.num_hidden_layers) != wanted:
        raise ValueError(f"the MTP head in {directory!r} was trained for {meta.base_model} (hidden "
                         f"{meta.hidden_size}, vocab {meta.vocab_size}, {meta.num_hidden_layers} layers), not this "
                         f"model (hidden {wanted[0]}, vocab {wanted[1]}, {wanted[2]} layers)")
    build = getattr(model, "build_mtp", None)
    if build is None:
        raise ValueError(f"{type(model).__name__} cannot take a separate MTP head")
    mtp = build()
    finalize = prepare(mtp) if prepare is not None else None
    layer = mtp.layers[0]
    loaders = checkpoint_loaders(layer, model.stacked)
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as exc:  # a truncated or corrupt file
        raise ValueError(f"the MTP head's weights {weights!r} cannot be read ({type(exc).__name__}: {exc}); train the "
                         f"head again with deepinfer train-mtp") from exc
    seen = load_tensors(loaders, tensors.items(), lambda name: False, "the MTP head")
    check_complete(loaders, seen)
    if finalize is not None:
        finalize(mtp)
    mtp.draft_vocab = torch.tensor(meta.draft_vocab, dtype=torch.int64) if meta.draft_vocab else None
    model.mtp = mtp.to(next(model.parameters()).device).eval()
    return meta
