"""An 8-bit LM head's greedy argmax in two passes (ops/quant_linear.bounded_argmax) against the exact fused argmax
(quant_linear_argmax), the head alone, on the model's own final states: 64 chat-like prompts decode a few greedy
tokens, the rows the head sees at 64 are kept, and both ops take turns on the first M of them (medians). Checks the
indices are the same. End to end: `python benchmarks/ab_options.py --a bounded_head=false --b bounded_head=true`.

    python benchmarks/bounded_head.py [--model gemma3-270m] [--rows 1,2,4,16,64] [--out results/bounded_head.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine_info, median_seconds, write_json  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.ops import quant_linear as ql  # noqa: E402

TOPICS = ["the moon", "a robot", "rivers", "python lists", "bread", "the French revolution", "volcanoes", "chess",
          "jazz", "bees", "glass", "trains", "tea", "snow", "maps", "whales"]
VERBS = ["Explain", "Write a short poem about", "List three facts about", "Describe"]


def final_states(llm: LLM, keep: int = 2) -> torch.Tensor:
    """The rows the head's argmax receives while 64 prompts decode (the steps of all 64, after the first few)."""
    seen: list[torch.Tensor] = []
    real = ql.argmax

    def record(kernels, x, w):
        if x.shape[0] == 64:
            seen.append(x.clone())
        return real(kernels, x, w)

    ql.argmax = record
    try:
        prompts = [f"{v} {t}." for v in VERBS for t in TOPICS]
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        ql.argmax = real
    return torch.cat(seen[4 : 4 + keep])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rows", default="1,2,4,16,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default="benchmarks/results/bounded_head.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_threads=args.threads, bounded_head=False)
    head = llm.engine.executor.runner.model.lm_head.weight
    kernels, w = head.kernels, head.packed
    if not ql.boundable(w):
        raise SystemExit(f"the head is not an 8-bit symmetric weight: {getattr(w, 'fmt', w)}")
    bound = ql.argmax_bound(kernels, w)
    x = final_states(llm)
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        xm = x[:m].contiguous()
        same = torch.equal(ql.argmax(kernels, xm, w), ql.bounded_argmax(kernels, xm, w, bound))
        exact, bounded = [], []
        for _ in range(3):  # the two ops take turns
            exact.append(median_seconds(lambda: ql.argmax(kernels, xm, w), args.repeats) * 1e3)
            bounded.append(median_seconds(lambda: ql.bounded_argmax(kernels, xm, w, bound), args.repeats) * 1e3)
        row = {"rows": m, "exact_ms": statistics.median(exact), "bounded_ms": statistics.median(bounded),
               "same_indices": same}
        row["speedup"] = row["exact_ms"] / row["bounded_ms"]
        rows.append(row)
        print(f"{m:4d} rows: exact {row['exact_ms']:7.2f} ms  two passes {row['bounded_ms']:7.2f} ms  "
              f"{row['speedup']:.2f}x  same indices: {same}", flush=True)
    write_json({"model": args.model, "isa": kernels.isa(), "threads": args.threads, "rows": rows,
                "machine": machine_info(args.threads)}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
