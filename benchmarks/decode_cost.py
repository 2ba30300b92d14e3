"""Decode step cost against batch size and context length, and the context-length buckets it implies.

Runs B requests with prompts of L tokens to their decode phase and times decode steps (engine step times, the
median of --steps steps) for each (B, L) on a grid. Fits  step = a + b * B + c * B * L  (a: fixed per step, b: the
weights' work per row, c: attention per row and context token), then cuts context lengths into four buckets where
attention's share of a row's cost passes 1/4, 1/2 and 3/4, and gives the largest batch per bucket that keeps a step
under --itl-ms.

    python benchmarks/decode_cost.py                       # the bundled SmolLM2, its default (quantized) compute
    python benchmarks/decode_cost.py --engine-option dtype=float32
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--itl-ms", type=float, default=100.0, help="step-time target per bucket (default 100 ms)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    options = {k: json.loads(v) if v[:1] in "0123456789[{tf" else v
               for k, v in (o.split("=", 1) for o in args.engine_option)}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(batches),
              max_num_batched_tokens=max(2048, max(contexts)), kv_cache_memory=4 << 30, **options)
    engine, token_ids = llm.engine, ordinary_token_ids(llm.get_tokenizer())
    points = []
    for length in contexts:
        for batch in batches:
            reqs = random_requests(batch, (length, length), (1, 1), token_ids, batch * 7919 + length)
            # long enough that the first prompts still decode when the last ones finish their chunked prefill
            budget = engine.config.scheduler.max_num_batched_tokens
            params = SamplingParams(temperature=0, max_tokens=args.steps + 2 + -(-batch * length // budget),
                                    ignore_eos=True)
            ids = [f"c{length}-{batch}-{i}" for i in range(batch)]
            for rid, r in zip(ids, reqs):
                engine.add_request(rid, r.prompt_token_ids, params)
            times = []
            while engine.has_unfinished_requests():
                if len(times) >= args.steps:
                    for rid in ids:
                        engine.abort_request(rid)
                    break
                decoding = all(q.num_tokens - q.num_computed_tokens == 1 for q in engine.scheduler.running) \
                    and len(engine.scheduler.running) == batch
                start = time.perf_counter()
                engine.step()
                if decoding:
                    times.append(time.perf_counter() - start)
            if not times:  # the batch never decoded together: its KV does not fit the cache at once
                print(f"batch {batch:>4} context {length:>6}: skipped (the whole batch never decoded at once; "
                      f"its KV exceeds the cache)", flush=True)
                continue
            step = statistics.median(times)
            points.append({"batch": batch, "context": length, "step_ms": 1e3 * step})
            print(f"batch {batch:>4} context {length:>6}: decode step {1e3 * step:8.2f} ms", flush=True)
    x = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in points])
    y = np.array([p["step_ms"] for p in points])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    crossover = b / c if c > 0 else float("inf")  # context where attention costs a row as much as the weights
    edges = [crossover / 3, crossover, 3 * crossover]  # attention share 1/4, 1/2, 3/4
    buckets = []
    for low, high in zip([0] + edges, edges + [float("inf")]):
        worst = high if high != float("inf") else 4 * edges[-1]
        per_row = b + c * worst
        buckets.append({"context_from": round(low), "context_to": None if high == float("inf") else round(high),
                        "max_batch_under_itl": max(1, int((args.itl_ms - a) / per_row))})
    fit = {"fixed_ms": a, "per_row_ms": b, "per_row_per_context_token_us": 1e3 * c, "crossover_tokens": crossover}
    print(json.dumps(fit, indent=2))
    for bucket in buckets:
        print(bucket)
    out = args.out or default_output_path("decode_cost")
    write_json({"benchmark": "decode_cost", "compute": engine.compute.name, "points": points, "fit": fit,
                "buckets": buckets, "args": vars(args), "machine": machine_info(args.threads)}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
