"""The sampler alone on a batch of logits the size of SmolLM2's vocabulary: milliseconds a call per sampling setting,
the torch path against the compiled ops (argmax_rows, sample_id_order; for top-k / top-p rows sort_descending,
sample_sorted, row_sums), the same tokens checked. --scale sets how peaked the rows are (flat rows' nucleus reaches
past topk's prefixes into the whole-row sort).

    python benchmarks/sampler.py --batch 64 --vocab 49152 [--scale 1.0]
    python benchmarks/sampler.py --engine --batch 64      # in the engine: chat prompts, temperature 0.8, top_p 0.95

--engine runs the bundled model on `--batch` chat requests (128 tokens each, seeded) with the top-k / top-p rows'
compiled ops off (the torch path) and on, taking turns `--rounds` times in one process: the sampler's ms a step,
output tokens/s, and the same tokens checked.
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
    parser.add_argument("--engine", action="store_true", help="in the engine, on chat requests (see above)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.engine:
        return engine_rounds(args)
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


def engine_rounds(args: argparse.Namespace) -> None:
    from deepinfer import LLM, SamplingParams

    llm = LLM(None, num_threads=args.threads)
    engine, runner = llm.engine, llm.engine.executor.runner
    compiled = runner.sampler.prob_order
    if compiled is None:
        raise SystemExit("the compiled CPU ops are not available here: nothing to compare")
    topics = ["the history of Rome", "how a bicycle works", "cooking pasta", "the water cycle", "learning a language",
              "black holes", "a trip to Japan", "writing a poem about autumn"]
    prompts = [f"<|im_start|>user\nTell me about {topics[i % 8]} in detail, part {i}.<|im_end|>\n"
               f"<|im_start|>assistant\n" for i in range(args.batch)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, ignore_eos=True, seed=7)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    points, tokens = {"torch": [], "compiled": []}, {}
    for _ in range(args.rounds):
        for which, ops in (("torch", None), ("compiled", compiled)):
            runner.sampler.prob_order = ops
            before = engine.step_times.copy()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            spent = engine.step_times.since(before)
            tokens[which] = [list(o.outputs[0].token_ids) for o in outputs]
            points[which].append({"sample_ms_per_step": 1e3 * spent.sample / spent.steps,
                                  "output_tok_s": sum(map(len, tokens[which])) / wall})
            print(f"{which:9s} sampler {points[which][-1]['sample_ms_per_step']:.2f} ms a step, "
                  f"{points[which][-1]['output_tok_s']:.1f} output tokens/s", flush=True)
    runner.sampler.prob_order = compiled
    assert tokens["torch"] == tokens["compiled"], "the compiled ops changed the tokens"
    medians = {w: {k: statistics.median(p[k] for p in pts) for k in pts[0]} for w, pts in points.items()}
    print("medians:", medians, "(same tokens)")
    out = args.out or default_output_path("sampler-engine")
    write_json({"machine": machine_info(args.threads), "args": vars(args), "rounds": points, "medians": medians}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
