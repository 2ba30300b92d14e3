"""GGUF's 5-bit weights (Q5_0 / Q5_1 / Q5_K) kept at 5 bits against the same weights widened to 8-bit records, as
deepinfer stored them until stop 42: two engines on the same compiled ops in one process, generating the same
requests in turns; each round's back-to-back pair gives a ratio (median and range). Greedy tokens checked equal.

    python benchmarks/q5_layout.py                                   # Gemma 3 270M (its Q5_0 layers), batch 1
    python benchmarks/q5_layout.py --batch 64 --output-len 64 --rounds 4
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (machine_info, ordinary_token_ids, paired_ratios, random_requests, take_turns,  # noqa: E402
                    write_json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default="benchmarks/results/q5_layout.json")
    args = parser.parse_args()
    from deepinfer import LLM, SamplingParams
    from deepinfer.models import gguf_file
    from deepinfer.ops import quant_linear as ql

    five_bit = gguf_file.canonical

    def widened(*a, **k):
        c = five_bit(*a, **k)
        return ql.Canonical(dataclasses.replace(c.fmt, bits=8), c.u, c.scales, c.offsets) if c.fmt.bits == 5 else c

    opts = dict(num_threads=args.threads, max_num_seqs=max(args.batch, 16), enable_prefix_caching=False)
    gguf_file.canonical = widened  # the loader's reference: this engine packs 5-bit types as 8-bit records
    try:
        engines = {"8-bit": LLM(args.model, **opts)}
    finally:
        gguf_file.canonical = five_bit
    engines["5-bit"] = LLM(args.model, **opts)
    ids = ordinary_token_ids(engines["5-bit"].get_tokenizer())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in random_requests(
        args.batch, (args.prompt_len,) * 2, (args.output_len,) * 2, ids, args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times, tokens = take_turns(engines, prompts, params, args.rounds)
    if tokens["8-bit"] != tokens["5-bit"]:
        sys.exit("the two layouts' tokens differ")
    rate = {name: args.batch * args.output_len / statistics.median(t) for name, t in times.items()}
    pairs = paired_ratios(times["8-bit"], times["5-bit"])
    print(f"batch {args.batch}: output tok/s 8-bit {rate['8-bit']:.1f}, 5-bit {rate['5-bit']:.1f}; 5-bit speedup "
          f"paired {statistics.median(pairs):.3f}x ({pairs[0]:.3f}-{pairs[-1]:.3f}), tokens equal")
    write_json({"benchmark": "q5_layout", "machine": machine_info(args.threads), "model": args.model,
                "batch": args.batch, "output_tok_s": rate, "paired_speedup": statistics.median(pairs),
                "paired_range": [pairs[0], pairs[-1]]}, args.out)


if __name__ == "__main__":
    main()
