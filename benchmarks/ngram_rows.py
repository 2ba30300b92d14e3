"""What n-gram speculation's plan weighs, measured on SmolLM2 with spec_decode.py's prompts (batch 1, greedy):

- acceptance by match length: the model's greedy answers replayed; at each output position, the length n of the
  longest earlier match of the sequence's suffix (spec/ngram.match_ngram) and how many of its k drafts the answer
  goes on to confirm: P(draft j accepted | the ones before it were), per n (worker/speculative.MATCH_PRIORS);
- step cost by rows: engines with fixed draft lengths 1..k (`enable_mtp_varlen=False`) taking turns on the same
  prompts, the forward and LM-head time of every step by its row count (1 + drafts; 1 where no match was found),
  medians, against a one-row step (what speculative.RowCosts models).

    python benchmarks/ngram_rows.py                       # both, k = 8, 3 rounds
    python benchmarks/ngram_rows.py --skip-costs --k 6    # acceptance only (one engine, ~10 s)
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402
from spec_decode import workloads  # noqa: E402


def acceptance_by_match(llm, loads: dict[str, list[list[int]]], k: int, max_tokens: int) -> dict:
    from deepinfer import SamplingParams
    from deepinfer.config import SpecConfig
    from deepinfer.spec.ngram import match_ngram

    min_n, max_n = SpecConfig().ngram_min, SpecConfig().ngram_max  # the defaults
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    out = {}
    for name, prompts in loads.items():
        seen = collections.defaultdict(lambda: np.zeros(k + 1))  # [positions, accepted at 1.., k]
        for prompt in prompts:
            answer = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            seq = np.asarray(prompt + answer, dtype=np.int64)
            for t in range(len(prompt), len(seq) - 1):
                n, drafts = match_ngram(seq[:t], k, min_n, max_n)
                counts = seen[n]
                counts[0] += 1
                for j, (draft, actual) in enumerate(zip(drafts, seq[t:])):
                    if draft != actual:
                        break
                    counts[1 + j] += 1
        out[name] = {int(n): {"positions": int(c[0]),
                              "conditional": [round(float(c[j + 1] / c[j]), 3) for j in range(k) if c[j] > 0]}
                     for n, c in sorted(seen.items()) if n}
        out[name]["no_match_positions"] = int(seen[0][0]) if 0 in seen else 0
    return out


def step_costs(model: str | None, loads: dict[str, list[list[int]]], k: int, rounds: int, threads: int,
               max_tokens: int) -> dict:
    from deepinfer import LLM, SamplingParams

    times: dict[int, list[float]] = collections.defaultdict(list)
    engines = []
    for drafts in range(1, k + 1):
        llm = LLM(model, num_threads=threads, max_num_seqs=1, speculative_method="ngram",
                  num_speculative_tokens=drafts, enable_mtp_varlen=False)
        net, clock = llm.engine.executor.runner.model, {}
        forward, head = net.forward, net.greedy_tokens

        def timed_forward(ids, positions, *args, forward=forward, clock=clock, **kwargs):
            clock["start"], clock["rows"] = time.perf_counter(), ids.shape[0]
            return forward(ids, positions, *args, **kwargs)

        def timed_head(hidden, head=head, clock=clock):
            tokens = head(hidden)
            times[clock["rows"]].append(time.perf_counter() - clock["start"])
            return tokens

        net.forward, net.greedy_tokens = timed_forward, timed_head
        engines.append(llm)
    prompts = [p for ps in loads.values() for p in ps]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for llm in engines:  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    times.clear()
    for _ in range(rounds):
        for llm in engines:
            for p in prompts:
                llm.generate([p], params, use_tqdm=False)
    ms = {rows: 1e3 * statistics.median(v) for rows, v in sorted(times.items()) if rows <= k + 1 and len(v) >= 10}
    return {"ms": ms, "steps": {rows: len(times[rows]) for rows in ms},
            "ratio": {rows: round(t / ms[1], 3) for rows, t in ms.items()} if 1 in ms else {}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--k", type=int, default=8, help="drafts per match replayed; the deepest fixed length timed")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-costs", action="store_true", help="acceptance by match length only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from deepinfer import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=1)
    loads = workloads(llm.get_tokenizer())
    result = {"acceptance_by_match": acceptance_by_match(llm, loads, args.k, args.max_tokens)}
    del llm
    for name, rows in result["acceptance_by_match"].items():
        print(f"{name}: {rows['no_match_positions']} positions without a match")
        for n, row in rows.items():
            if n != "no_match_positions":
                print(f"  match of {n}: {row['positions']:>4} positions, acceptance by draft "
                      + " ".join(f"{a:.2f}" for a in row["conditional"]))
    if not args.skip_costs:
        result["step_costs"] = step_costs(args.model, loads, args.k, args.rounds, args.threads, args.max_tokens)
        print("step (forward + head) by rows, ms and against one row:",
              " ".join(f"{r}: {t:.2f} ({result['step_costs']['ratio'].get(r, 0):.2f}x)"
                       for r, t in result["step_costs"]["ms"].items()))
    out = args.out or default_output_path("ngram_rows")
    write_json({"benchmark": "ngram_rows", "args": vars(args), "machine": machine_info(args.threads), **result}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
