"""Two sets of engine options, A and B, side by side in one process: both engines generate the same requests in turn
(A then B, then B then A, ...), so load and thermal drift hit both alike; medians of the output tokens/s and their
ratio per batch size. Each round has new prompts, so neither engine finds them in its prefix cache. Only for options
that leave the engine computing on the calling thread (not async_scheduling=true, whose compute thread would share
this process's OpenMP pools).

    python benchmarks/ab_options.py --a kv_cache_dtype=float32 --b kv_cache_dtype=bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, ordinary_token_ids, random_requests, write_json  # noqa: E402


def options(pairs: list[str]) -> dict:
    out = {}
    for text in pairs:
        key, _, raw = text.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="an LLM option of engine A")
    parser.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="an LLM option of engine B")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from deepinfer import LLM, SamplingParams

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    common = dict(num_threads=args.threads, max_num_seqs=max(sizes), kv_cache_memory=1 << 30)
    llms = {"A": LLM(args.model, **common, **options(args.a)), "B": LLM(args.model, **common, **options(args.b))}
    ids = ordinary_token_ids(llms["A"].get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for batch in sizes:
        def fresh(seed: int) -> list[list[int]]:  # new prompts: no engine has them in its prefix cache yet
            return [r.prompt_token_ids for r in random_requests(batch, (args.prompt_len,) * 2,
                                                                (args.output_len,) * 2, ids, seed)]

        for llm in llms.values():  # warm-up at this batch's shapes
            llm.generate(fresh(batch), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        runs: dict[str, list[float]] = {"A": [], "B": []}
        for rep in range(args.repeats):
            prompts = fresh(1000 * batch + rep + 1)  # the same for A and B
            for name in ("AB" if rep % 2 == 0 else "BA"):
                start = time.perf_counter()
                llms[name].generate(prompts, params, use_tqdm=False)
                runs[name].append(batch * args.output_len / (time.perf_counter() - start))
        a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
        print(f"batch {batch:>4}: A {a:8.1f} tok/s  B {b:8.1f} tok/s  B/A {b / a:.3f}")
        rows.append({"batch": batch, "a_tok_s": runs["A"], "b_tok_s": runs["B"], "b_over_a": b / a})
    out = write_json({"machine": machine_info(args.threads), "a": options(args.a), "b": options(args.b),
                      "args": vars(args), "points": rows}, args.out or default_output_path("ab_options"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
