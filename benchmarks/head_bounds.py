"""How much of an 8-bit LM head a two-pass greedy argmax would have to compute exactly, for splits of each weight
u = 2^L h + l into a high plane of 8 - L bits (the first pass, w~ = d (2^L h + (2^L - 1) / 2 - 128)) and L low bits
(bounded by Cauchy-Schwarz, |z - z~| <= ||d (l - (2^L - 1) / 2)||_2 ||x||_2, as ops/csrc/split_head.cpp bounds
them): the share of 16-row blocks whose upper bound reaches the best lower bound. And what rounding the activations
to fewer bits (per 32-block, as the kernels do at 8) does to the logits and to the argmax. Rows: the final hidden
states of a few sampled chat answers. Float64 throughout; a measurement of the bounds, not of a kernel.

    python benchmarks/head_bounds.py --model PATH/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, write_json  # noqa: E402

PROMPTS = ["Write a short story about a dragon.", "Explain how a CPU cache works.", "def quicksort(arr):",
           "The history of Rome in three sentences:"]


def hidden_rows(llm, max_tokens: int) -> torch.Tensor:
    """The rows the LM head sees while the prompts are answered (sampled, so every step computes logits)."""
    from deepinfer import SamplingParams

    model, seen = llm.engine.executor.runner.model, []
    original = model.compute_logits

    def keep(hidden, *args, **kwargs):
        seen.append(hidden.detach().double().clone())
        return original(hidden, *args, **kwargs)

    model.compute_logits = keep
    tok = llm.get_tokenizer()
    llm.generate([tok(p).input_ids for p in PROMPTS], SamplingParams(temperature=0.8, max_tokens=max_tokens,
                                                                    seq_seed=1), use_tqdm=False)
    model.compute_logits = original
    return torch.cat(seen)


def head_blocks(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, d): a GGUF file's Q8_0 head (output.weight, else the tied token_embd.weight) as quants 0..255
    [V, K/32, 32] and scales [V, K/32], read by the loader's own block conversion (models/gguf_blocks.py)."""
    import gguf
    import numpy as np

    from deepinfer.models.gguf_blocks import QType, canonical

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    if head.tensor_type != QType.Q8_0:
        raise SystemExit(f"{head.name} is {head.tensor_type.name}: this probe reads Q8_0 heads")
    k, vocab = (int(n) for n in head.shape)
    c = canonical(QType.Q8_0, np.array(head.data), (vocab, k))
    return torch.from_numpy(c.u).to(torch.int32).view(vocab, -1, 32), torch.from_numpy(c.scales).double()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file whose head is Q8_0")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from deepinfer import LLM

    llm = LLM(args.model)
    x = hidden_rows(llm, args.max_tokens)
    u, d = head_blocks(args.model)
    vocab, k = u.shape[0], u.shape[1] * 32
    x = x[:, :k]
    w = (d[..., None] * (u - 128).double()).view(vocab, k)
    z = x @ w.T
    result = {"rows": len(x), "vocab": vocab, "splits": {}, "activation_bits": {}}
    for low in (2, 3, 4):
        half = (2**low - 1) / 2
        h, l = u >> low, u & (2**low - 1)
        approx = x @ (d[..., None] * (2**low * h.double() + half - 128)).view(vocab, k).T
        bound = ((d[..., None] * (l.double() - half)) ** 2).sum((1, 2)).sqrt()[None, :] * x.norm(dim=1, keepdim=True)
        best_lower = (approx - bound).max(1, keepdim=True).values
        blocks = (approx + bound >= best_lower).view(len(x), -1, 16).any(2).double().mean(1)
        name = f"{8 - low}/{low}"
        result["splits"][name] = {"block_share_median": blocks.median().item(), "block_share_max": blocks.max().item()}
        print(f"split {name}: exact blocks, median {blocks.median().item():.1%}, max {blocks.max().item():.1%}")
    top, gap = z.argmax(1), z.topk(2, 1).values
    for top_q in (127, 63):
        blocks_x = x.view(len(x), -1, 32)
        scale = blocks_x.abs().amax(2, keepdim=True) / top_q
        xq = (torch.round(blocks_x / scale.clamp_min(1e-30)) * scale).view(len(x), k)
        zq = xq @ w.T
        err = (zq - z).abs().max(1).values.median().item()
        agree = (zq.argmax(1) == top).double().mean().item()
        result["activation_bits"][str(top_q)] = {"max_logit_error_median": err, "argmax_agreement": agree}
        print(f"activations to +-{top_q}: largest logit error (median over rows) {err:.3f}, argmax agrees "
              f"{agree:.1%} (top-2 gap median {(gap[:, 0] - gap[:, 1]).median().item():.3f})")
    print(f"wrote {write_json(result, args.out or default_output_path('head-bounds'))}")


if __name__ == "__main__":
    main()
