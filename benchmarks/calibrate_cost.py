"""Calibrates the router's cost model (deepinfer/router/policy.py:CostModel) on this machine's engine.

Times single engine steps of the offline engine (bundled SmolLM2, float32, greedy, --max-batch-tokens 2048):

- prefill: one request whose new tokens follow a cached prefix of 0, 2048 or 6144 tokens (the prefix cache serves
  it), in chunks of up to 2048 new tokens a step, so the attention term separates from the per-token term;
- decode: B requests of context L (the cached prefix plus 16 tokens of their own), their pure decode steps,
  B in 1, 8, 32 and L in 256, 2048, 6144.

Each point is the fastest of --repeats tries, one per pass over all points (fresh tokens each time, so no try hits
the cache of another): on a shared machine other processes only ever add time (with 2 threads on 2 busy cores
every parallel region waits for a descheduled thread, which can add seconds to a step), so the minimum is the best
estimate of the engine's own cost.

Then fits step = step_s + prefill_token_s * tokens + attention_pair_s * (query, key) pairs
+ decode_request_s * decoding requests + decode_context_s * their context tokens by least squares (coefficients
kept >= 0), prints it and writes JSON for `benchmarks/router_sim.py --cost-model PATH`. About 3 minutes with
2 threads on an idle 2-core machine (an estimate; 15 minutes at load average 6-8); the load average is recorded.

    python benchmarks/calibrate_cost.py                        # -> benchmarks/results/cost_model.json
    python benchmarks/calibrate_cost.py --threads 2 --out /tmp/cost.json
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from deepinfer.router.policy import CostModel, attention_pairs  # noqa: E402

PREFILL_POINTS = ((512, 0), (2048, 0), (512, 2048), (4096, 2048), (512, 6144))  # (new tokens, cached tokens)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (256, 2048, 6144)
DECODE_STEPS = 5
TAIL = 16  # each decoding request's own tokens after the shared prefix: one block
FEATURES = ("step_s", "prefill_token_s", "attention_pair_s", "decode_request_s", "decode_context_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048,
                        help="max_num_batched_tokens, also the cost model's budget (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="tries per point, the fastest kept (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "cost_model.json"), help="JSON path")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.max_batch_tokens < 512:
        parser.error("need --threads >= 1, --repeats >= 1 and --max-batch-tokens >= 512")
    return args


class StepTimer:
    """Submits requests to one engine and times each of its steps."""

    def __init__(self, llm: Any, seed: int) -> None:
        from deepinfer import SamplingParams

        self.engine = llm.engine
        self.rng = random.Random(seed)
        self.params = SamplingParams
        self.ids = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(n)]  # ordinary tokens of SmolLM2's vocabulary

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        for prompt in prompts:
            self.ids += 1
            self.engine.add_request(f"cal-{self.ids}", prompt,
                                    self.params(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        times = []
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        return times


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per measured point: its features, its fastest try and every try. Each pass goes over all points, so
    a point's tries are a minute apart: a neighbour's burst slows one try, not all of them."""
    from deepinfer import LLM

    llm = LLM(args.model, dtype="float32", num_threads=args.threads, max_num_batched_tokens=args.max_batch_tokens,
              max_num_seqs=max(DECODE_BATCHES), kv_cache_memory=1 << 30)
    timer = StepTimer(llm, args.seed)
    timer.run([timer.tokens(64)], 2)  # warm-up: first-call allocations and kernel loading
    budget = args.max_batch_tokens
    tries: dict[tuple[str, int, int], list[float]] = {}
    bar = tqdm(total=args.repeats * (len(PREFILL_POINTS) + len(DECODE_BATCHES) * len(DECODE_CONTEXTS)),
               desc="calibrate", unit="point", disable=args.no_progress)
    cached: dict[int, list[int]] = {0: []}  # prompts in the prefix cache, by length
    for _ in range(args.repeats):
        for n, context in PREFILL_POINTS:  # one request after a cached prefix; a step per budget of new tokens
            prompt = cached[context] + timer.tokens(n)
            times = timer.run([prompt], 1)
            for step, seconds in enumerate(times):
                chunk = min(budget, n - step * budget)
                tries.setdefault(("prefill", chunk, context + step * budget), []).append(seconds)
            cached[len(prompt)] = prompt  # the longer prefixes of later points and of the decode prompts
            bar.update(1)
        longest = cached[max(cached)]
        for length in DECODE_CONTEXTS:  # B requests on a cached prefix plus one block of their own
            for batch in DECODE_BATCHES:
                prompts = [longest[: length - TAIL] + timer.tokens(TAIL) for _ in range(batch)]
                times = timer.run(prompts, DECODE_STEPS + 2)
                # times[0] prefills the tails, times[1] is the first decode step (new shapes)
                tries.setdefault(("decode", batch, length), []).extend(times[2:2 + DECODE_STEPS])
                bar.update(1)
        bar.set_postfix(load=f"{os.getloadavg()[0]:.1f}")
    bar.close()
    rows = []
    for (kind, n, context), seconds in sorted(tries.items()):
        if kind == "prefill":
            rows.append({"kind": kind, "tokens": n, "context": context, "seconds": min(seconds), "tries": seconds,
                         "x": [1, n, attention_pairs(context, context + n), 0, 0]})
        else:  # a decode step's requests attend over their context plus the ~3 tokens generated by then
            rows.append({"kind": kind, "batch": n, "context": context, "seconds": min(seconds), "tries": seconds,
                         "x": [1, 0, 0, n, n * (context + 3)]})
    return rows


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares on relative error (each row weighted by 1/seconds, so short decode steps count as much as
    long prefills); a coefficient that comes out negative is dropped and the rest refitted."""
    import numpy as np

    x = np.array([r["x"] for r in rows], dtype=float)
    y = np.array([r["seconds"] for r in rows], dtype=float)
    w = 1.0 / y
    active = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    values = dict.fromkeys(FEATURES, 0.0)
    values.update({FEATURES[j]: float(c) for j, c in zip(active, coef)})
    return values


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    started = time.perf_counter()
    rows = measure(args)
    coefficients = fit(rows)
    model = CostModel(**coefficients, max_batch_tokens=args.max_batch_tokens)
    print(f"\n{'step':<34}{'measured s':>12}{'fitted s':>10}")
    for r in rows:
        label = (f"prefill {r['tokens']} tok after {r['context']}" if r["kind"] == "prefill"
                 else f"decode batch {r['batch']} context {r['context']}")
        r["fitted"] = model.step_seconds(*r["x"][1:])
        print(f"{label:<34}{r['seconds']:>12.4f}{r['fitted']:>10.4f}")
    print("\ncost model (seconds):")
    for name in FEATURES:
        print(f"  {name:<18}{coefficients[name]:.4g}")
    payload = {
        "benchmark": "calibrate_cost",
        "command": [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)],
        "cost_model": {**coefficients, "max_batch_tokens": args.max_batch_tokens},
        "machine": machine_info(args.threads),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "measurements": rows,
    }
    print(f"load average: start {load_start}, end {payload['load_average_end']}; {payload['seconds']:.0f}s")
    print(f"wrote {write_json(payload, args.out)}")


if __name__ == "__main__":
    main()
