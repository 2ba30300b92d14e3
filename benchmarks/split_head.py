"""An 8-bit LM head in split planes (DEEPINFER_SPLIT_HEAD=1, ops/quant_linear.SplitWeight) against the 8-bit layout:
the head alone (greedy argmax and logits of one row) and one user's decoding end to end, greedy and sampled
(seeded), the two engines taking turns in one process; same tokens checked.

    python benchmarks/split_head.py [--model PATH] [--rounds 4] [--out results/split_head.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.ops import quant_linear as ql  # noqa: E402

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain how a refrigerator works.",
           "def quicksort(items):", "List five facts about the Moon."]


def engine(model: str | None, split: bool) -> LLM:
    os.environ["DEEPINFER_SPLIT_HEAD"] = "1" if split else "0"
    return LLM(model, num_threads=2)


def head_times(off: LLM, on: LLM, rounds: int) -> dict:
    """ms per call of the head's argmax and logits for one row."""
    head = off.engine.executor.runner.model.lm_head.weight
    packed, kernels = head.packed, head.kernels
    split = on.engine.executor.runner.model.lm_head.weight.packed
    g = torch.Generator().manual_seed(0)
    # random rows: their outputs are flatter than a model's own final states, so more blocks pass the bound and the
    # two-pass argmax gains less here than in the decode below
    rows = [torch.randn(1, packed.k, generator=g) for _ in range(8)]
    out = {}
    for name, fn in (("argmax", ql.argmax), ("logits", ql.linear)):
        times = {"8bit": [], "split": []}
        for _ in range(rounds):
            for key, w in (("8bit", packed), ("split", split)):
                t = time.perf_counter()
                for x in rows * 4:
                    fn(kernels, x, w)
                times[key].append((time.perf_counter() - t) / (4 * len(rows)) * 1e3)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
        out[name]["speedup"] = statistics.median(a / b for a, b in zip(times["8bit"], times["split"]))
    return out


def decode(llm: LLM, max_tokens: int, temperature: float = 0.0) -> tuple[float, list]:
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    return sum(len(x) for x in tokens) / (time.perf_counter() - t), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/split_head.json")
    args = ap.parse_args()
    off, on = engine(args.model, False), engine(args.model, True)
    if not isinstance(on.engine.executor.runner.model.lm_head.weight.packed, ql.SplitWeight):
        sys.exit("this model's LM head is not an 8-bit symmetric head: nothing to split")
    head = head_times(off, on, args.rounds)
    rates = {"greedy": {"8bit": [], "split": []}, "sampled": {"8bit": [], "split": []}}
    decode(off, 8), decode(on, 8)  # warm
    for _ in range(args.rounds):
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            for key, llm in (("8bit", off), ("split", on)):
                rate, tokens = decode(llm, args.max_tokens, temperature)
                rates[mode][key].append(rate)
                if key == "8bit":
                    want = tokens
                elif tokens != want:
                    sys.exit(f"the split head changed the {mode} tokens")
    result = {"model": args.model or "bundled SmolLM2", "head_ms": head,
              "decode_tokens_per_s": {mode: {k: statistics.median(v) for k, v in r.items()} for mode, r in rates.items()},
              "decode_speedup": {mode: statistics.median(b / a for a, b in zip(r["8bit"], r["split"]))
                                 for mode, r in rates.items()},
              "rounds": rates}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
