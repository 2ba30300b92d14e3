"""End to end with two builds of the compiled ops taking turns: the engine on another commit's kernel sources against
the engine on the current ones, the same requests, in one process. Kernel changes that keep the bits show here as
speed only: the two engines' greedy tokens must be equal (checked).

    git archive b3feb5d deepinfer/ops/csrc | tar -x -C /tmp/old
    python benchmarks/kernels_e2e.py --old /tmp/old/deepinfer/ops/csrc                  # batch 64 / 16 / 1, prompts
    python benchmarks/kernels_e2e.py --old /tmp/old/deepinfer/ops/csrc --shapes 64x512x1
    python benchmarks/kernels_e2e.py --old /tmp/old/deepinfer/ops/csrc --model gemma3-270m --shapes 1x128x256

A shape is requests x prompt tokens x output tokens (random ordinary token ids, greedy, EOS ignored); rounds
alternate which engine runs first; medians of --rounds, and the median and range of each round's old / new ratio
(the pair ran back to back: drift cancels). Run it once with --old pointing at the current sources to see this
machine's noise: at stop 41 the same sources on both sides read 1.003x and 1.025x at batch 64, and five runs of a
~4% change read 0.94-1.08x. A change that rounds differently (stop 49's folded offsets) runs with --other-bits: the
share of tokens before each request's first difference is printed instead of the check.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (machine_info, matched_prefix_share, ordinary_token_ids, paired_ratios, random_requests, take_turns,  # noqa: E402
                    write_json)


def engine_on(ops, model: str | None, threads: int, max_seqs: int):
    """An LLM whose executor loads `ops` (None: the current sources) as its compiled CPU ops."""
    from deepinfer import LLM
    from deepinfer.ops import cpu_ops

    current = cpu_ops.load
    if ops is not None:
        if not hasattr(ops, "attention_prefetch"):  # older sources fixed the level at build time and do not say
            ops.attention_prefetch = lambda: "the level its sources fix"
        cpu_ops.load = lambda isa="native": ops
    try:
        return LLM(model=model, num_threads=threads, max_num_seqs=max_seqs, enable_prefix_caching=False)
    finally:
        cpu_ops.load = current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="a copy of deepinfer/ops/csrc from the commit to compare with")
    parser.add_argument("--shapes", default="64x128x128,16x128x128,1x128x128,64x128x1,1x512x1")
    parser.add_argument("--model", default=None, help="a .gguf file, a bundled name (gemma3-270m) or a Hugging Face "
                        "directory; default: the bundled SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default="benchmarks/results/kernels_e2e.json")
    parser.add_argument("--other-bits", action="store_true",
                        help="the new kernels round differently (an arithmetic change): report the share of greedy "
                             "tokens equal up to each request's first difference instead of refusing")
    args = parser.parse_args()
    import torch

    from deepinfer import SamplingParams
    from deepinfer.ops import cpu_ops

    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    old_ops = cpu_ops.build("deepinfer_kernels_e2e_old", list(cpu_ops.ISA_FLAGS["native"]), args.old)
    max_seqs = max(16, max(b for b, _, _ in shapes))
    engines = {name: engine_on(ops, args.model, args.threads, max_seqs) for name, ops in (("old", old_ops), ("new", None))}
    ids = ordinary_token_ids(engines["new"].get_tokenizer())
    points = []
    for batch, prompt, out in shapes:
        reqs = random_requests(batch, (prompt, prompt), (1, 1), ids, batch)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=out)
        times, tokens = take_turns(engines, prompts, params, args.rounds)
        same = matched_prefix_share(tokens["new"], tokens["old"])
        if same < 1 and not args.other_bits:
            sys.exit(f"{batch}x{prompt}x{out}: the two builds' tokens differ")
        old, new = (statistics.median(times[n]) for n in ("old", "new"))
        pairs = paired_ratios(times["old"], times["new"])  # their spread says how far to trust the median
        rate = batch * out if out > 1 else batch * prompt  # output tokens/s, or prompt tokens/s for prefill shapes
        points.append({"batch": batch, "prompt": prompt, "output": out, "old_s": old, "new_s": new,
                       "old_tok_s": rate / old, "new_tok_s": rate / new, "speedup": old / new,
                       "paired_speedup": statistics.median(pairs), "paired_range": [pairs[0], pairs[-1]],
                       "tokens_equal_share": same})
        kind = "output" if out > 1 else "prompt"
        print(f"{batch:3d} x {prompt:4d} in x {out:4d} out: {kind} tok/s old {rate / old:8.1f} new {rate / new:8.1f} "
              f"({old / new:.3f}x; paired {statistics.median(pairs):.3f}x, {pairs[0]:.3f}-{pairs[-1]:.3f}), "
              + ("tokens equal" if same == 1 else f"{same:.1%} of tokens before the first difference"), flush=True)
    write_json({"benchmark": "kernels_e2e", "machine": machine_info(args.threads), "model": args.model, "old": args.old,
                "points": points}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
