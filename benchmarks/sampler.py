"""The sampler alone on a batch of logits the size of SmolLM2's vocabulary: milliseconds a call per sampling setting,
the torch path against the compiled ops (argmax_rows, sample_id_order; for top-k / top-p rows sort_descending,
sample_sorted, row_sums), the same tokens checked. --scale sets how peaked the rows are (flat rows' nucleus reaches
past topk's prefixes into the whole-row sort).

    python benchmarks/sampler.py --batch 64 --vocab 49152 [--scale 1.0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_k 40 + top_p 0.9": dict(temperature=0.7, top_k=40, top_p=0.9),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--scale", type=float, default=3.0, help="logits ~ N(0, scale^2): larger is more peaked")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from deepinfer import SamplingParams
    from deepinfer.ops import cpu_ops
    from deepinfer.sample import Sampler, SamplingRow
    from deepinfer.sample.prob_order import ProbOrderOps

    torch.set_num_threads(args.threads)
    kernels = cpu_ops.load()
    samplers = {"torch": Sampler()}
    if kernels is not None:
        samplers["compiled"] = Sampler(kernels.argmax_rows, kernels.sample_id_order,
                                       ProbOrderOps.of(kernels))
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * args.scale
    results = []
    for name, kw in SETTINGS.items():
        params = SamplingParams(**kw)
        rows = [SamplingRow(params, seed=i, position=9, prompt_token_ids=[1], output_token_ids=[2],
                            eos_token_ids=frozenset()) for i in range(args.batch)]
        point, tokens = {"setting": name}, {}
        for which, sampler in samplers.items():
            tokens[which] = sampler(logits, rows).token_ids  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                sampler(logits, rows)
                times.append(1e3 * (time.perf_counter() - start))
            point[f"{which}_ms"] = statistics.median(times)
        assert len({tuple(t) for t in tokens.values()}) == 1, f"{name}: tokens differ"
        results.append(point)
        print(f"{name:22s} " + "  ".join(f"{w} {point[f'{w}_ms']:.2f} ms" for w in samplers) + "  (same tokens)")
    out = args.out or default_output_path("sampler")
    write_json({"machine": machine_info(args.threads), "args": vars(args), "results": results}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
