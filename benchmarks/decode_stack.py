"""The decode stack on against off: whole engine decode steps, the two modes taking turns in one process on the
same requests (layers/decode_stack.py; off is the per-module path it replaces, with the same bits).

At each batch size, B requests with prompts of --prompt-len tokens are run until all of them decode together;
then steps alternate stack on / stack off (each advances every request by a token, so both see the same
contexts) and the medians are compared.

    python benchmarks/decode_stack.py                         # the bundled SmolLM2, batches 1, 16, 64
    python benchmarks/decode_stack.py --batch-sizes 1,8 --steps 40
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, ordinary_token_ids, random_requests, write_json  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode and batch size")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(batches), enable_prefix_caching=False)
    engine = llm.engine
    body = getattr(engine.executor.runner.model, "model", None)
    stack = getattr(body, "decode_stack", None)
    if stack is None:
        sys.exit("this model runs without a decode stack (see the start-up log for why): nothing to compare")
    token_ids = ordinary_token_ids(llm.get_tokenizer())
    points = []
    for batch in batches:
        reqs = random_requests(batch, (args.prompt_len, args.prompt_len), (1, 1), token_ids, batch)
        budget = engine.config.scheduler.max_num_batched_tokens
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=2 * args.steps + 4 + -(-batch * args.prompt_len // budget))
        ids = [f"s{batch}-{i}" for i in range(batch)]
        for rid, r in zip(ids, reqs):
            engine.add_request(rid, r.prompt_token_ids, params)
        times: dict[str, list[float]] = {"on": [], "off": []}
        while engine.has_unfinished_requests() and len(times["off"]) < args.steps:
            decoding = len(engine.scheduler.running) == batch and \
                all(q.num_tokens - q.num_computed_tokens == 1 for q in engine.scheduler.running)
            mode = "on" if len(times["on"]) <= len(times["off"]) else "off"
            body.decode_stack = stack if mode == "on" or not decoding else None
            start = time.perf_counter()
            engine.step()
            if decoding:
                times[mode].append(time.perf_counter() - start)
        body.decode_stack = stack
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        on, off = (1e3 * statistics.median(times[m]) for m in ("on", "off"))
        points.append({"batch": batch, "step_ms_on": on, "step_ms_off": off, "speedup": off / on,
                       "steps_per_mode": len(times["off"])})
        print(f"batch {batch:>4}: decode step {on:7.2f} ms with the stack, {off:7.2f} ms without: {off / on:.2f}x",
              flush=True)
    out = args.out or default_output_path("decode_stack")
    write_json({"benchmark": "decode_stack", "machine": machine_info(args.threads), "prompt_len": args.prompt_len,
                "points": points}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
