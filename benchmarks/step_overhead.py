"""Where a decode step's time goes outside the forward, on decode steps only (the sweep's per-step figures average in
the prompt steps, whose long forwards make the rest look small), with the decode batch moved on from step to step
(worker/decode_batch.py) and with the inputs built anew every step, taking turns in one process; or (`--compare
head`) with the LM head's fused argmax and with logits plus the sampler's argmax. The same greedy tokens either way
(checked).

    python benchmarks/step_overhead.py --batch-sizes 1,16,64
    python benchmarks/step_overhead.py --compare head [--model PATH/gemma-3-270m-q4_k_m.gguf]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")
VARIANTS = {"inputs": ("moved", "built"), "head": ("fused", "logits")}  # (new, old) taking turns


def decode_round(llm, batch: int, prompt_len: int, steps: int, moved: bool, tag: str,
                 output_kind: str = "final_only") -> tuple[dict, list]:
    """`batch` requests prefilled, then `steps` decode steps timed; per-phase ms per step, and the tokens."""
    from deepinfer import SamplingParams

    engine, runner = llm.engine, llm.engine.executor.runner
    held = runner.decode_batch
    runner.decode_batch = held if moved else None
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, output_kind=output_kind)
    try:
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", [1000 + (7 * i + t) % 20000 for t in range(prompt_len)], params)
        ids = [f"{tag}-{i}" for i in range(batch)]
        while not all(engine.scheduler.requests[i].output_token_ids for i in ids):  # every prompt computed
            engine.step()
        for _ in range(2):
            engine.step()
        before = engine.step_times.copy()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        spent = engine.step_times.since(before)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        runner.decode_batch = held
    ms = spent.per_step_ms()
    point = {p: ms[p] for p in PHASES}
    point["wall_ms"] = 1e3 * wall / steps
    point["outside_forward"] = spent.outside_forward
    tokens = sorted((o.request_id.split("-", 1)[1], o.outputs[0].token_ids) for o in outputs if o.finished)
    return point, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--output-kind", default="final_only", choices=("cumulative", "delta", "final_only"),
                        help="what each step hands back (final_only: as LLM.generate; cumulative: as a stream)")
    parser.add_argument("--compare", default="inputs", choices=tuple(VARIANTS),
                        help="inputs: the decode batch moved on vs built anew; head: the LM head's fused argmax vs "
                             "logits and the sampler's argmax (the decode batch moved on in both)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from deepinfer import LLM

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(sizes), kv_cache_memory=1 << 30)
    model = llm.engine.executor.runner.model
    new, old = VARIANTS[args.compare]
    rows = []
    for batch in sizes:
        decode_round(llm, batch, args.prompt_len, 8, True, f"warm{batch}", args.output_kind)
        runs: dict[str, list[dict]] = {new: [], old: []}
        tokens: dict[str, list] = {}
        for rnd in range(args.rounds):
            for name in ((new, old) if rnd % 2 == 0 else (old, new)):
                if name == "logits":
                    model.greedy_tokens = lambda hidden: None  # the model's head, then the sampler's argmax
                point, tokens[name] = decode_round(llm, batch, args.prompt_len, args.steps, name != "built",
                                                   f"b{batch}r{rnd}{name}", args.output_kind)
                model.__dict__.pop("greedy_tokens", None)
                runs[name].append(point)
        assert [t for _, t in tokens[new]] == [t for _, t in tokens[old]], "tokens differ"
        row = {"batch": batch}
        for name, points in runs.items():
            row[name] = {k: statistics.median(p[k] for p in points) for k in points[0]}
        row["speedup_wall"] = row[old]["wall_ms"] / row[new]["wall_ms"]
        rows.append(row)
        for name in (old, new):
            r = row[name]
            print(f"batch {batch:3d} {name:6s}: step {r['wall_ms']:.2f} ms, outside the forward "
                  f"{100 * r['outside_forward']:.1f}% (" + ", ".join(f"{p} {r[p]:.3f}" for p in PHASES
                                                                    if p != "forward") + " ms)")
        print(f"batch {batch:3d}: {new} / {old} step time {1 / row['speedup_wall']:.3f} "
              f"(speedup {row['speedup_wall']:.3f}x), tokens equal")
    out = args.out or default_output_path("step_overhead")
    write_json({"machine": machine_info(args.threads), "args": vars(args), "rows": rows}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
