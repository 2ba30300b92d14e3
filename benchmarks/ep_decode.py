"""Expert-parallel decode on one machine: step time at EP = 1, 2, 4 on a small random DeepSeek-V3 (the shape of
benchmarks/deepseek_decode.py: hidden 1024, 16 experts, top-4), the combine's all_gather bytes, moe_lb, the time to
move experts between ranks, and the grouped expert GEMM against the per-expert Python loop it replaced.

EP = 1 runs in the engine's process; EP = N runs N rank processes that each compute the whole dense model on every
token and their own slots' experts (deepinfer/worker/ep_executor.py), each with --threads threads. On a machine
with fewer cores than N x threads the ranks share cores (oversubscribed): the step time then measures contention,
not what expert parallelism buys on separate devices.

    python benchmarks/ep_decode.py --ranks 1 2 4 --batch-sizes 1 32 --decode-steps 16 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from deepseek_decode import add_shape_args, deepinfer_decode, prompts_for, save_model, small_config  # noqa: E402

from deepinfer.distributed.eplb import Placement  # noqa: E402
from deepinfer.layers.moe import FusedExperts  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402


def loop_experts(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The per-expert Python loop FusedExperts ran before the grouped GEMM (same sort and combine)."""
    t, k = ids.shape
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=experts.num_experts)
    xs = x[order // k]
    out = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start : start + n], experts.gate_up_proj[expert]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, experts.down_proj[expert])
            start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out
    return (per_slot.view(t, k, -1).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def expert_compute(args: argparse.Namespace) -> list[dict[str, Any]]:
    hidden, inter = args.hidden, args.hidden // 2
    experts = FusedExperts(args.experts, hidden, inter)
    gen = torch.Generator().manual_seed(args.seed)
    experts.gate_up_proj.data = torch.randn(args.experts, 2 * inter, hidden, generator=gen) * 0.02
    experts.down_proj.data = torch.randn(args.experts, hidden, inter, generator=gen) * 0.02
    rows = []
    for tokens in args.expert_tokens:
        x = torch.randn(tokens, hidden, generator=gen)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, args.top_k, generator=gen)
        row: dict[str, Any] = {"tokens": tokens}
        for name, run in (("loop_ms", lambda: loop_experts(experts, x, ids, weights)),
                          ("grouped_ms", lambda: experts(x, ids, weights))):
            run()
            times = []
            for _ in range(args.expert_repeats):
                begin = time.perf_counter()
                run()
                times.append((time.perf_counter() - begin) * 1e3)
            row[name] = statistics.median(times)
        rows.append(row)
        print(f"experts, {tokens:>4} tokens: loop {row['loop_ms']:.2f} ms, grouped {row['grouped_ms']:.2f} ms")
    return rows


def decode(args: argparse.Namespace, path: str, ranks: int) -> dict[str, Any]:
    options: dict[str, Any] = dict(dtype="float32", num_threads=args.threads, enable_prefix_caching=False,
                                   max_num_seqs=max(args.batch_sizes), kv_cache_memory=256 << 20,
                                   max_num_batched_tokens=max(2048, max(args.batch_sizes) * args.prompt_len))
    if ranks > 1:
        options.update(expert_parallel_size=ranks, moe_lb_window=args.decode_steps - 1)
    started = time.perf_counter()
    llm = LLM(path, **options)
    row: dict[str, Any] = {"ranks": ranks, "startup_s": time.perf_counter() - started, "batches": []}
    try:
        for batch in args.batch_sizes:
            step_ms = []
            for repeat in range(args.repeats + 1):  # repeat 0 warms up
                prompts = prompts_for(batch, args.prompt_len, args.vocab, args.seed + repeat)
                seconds = deepinfer_decode(llm, prompts, args.decode_steps)
                if repeat:
                    step_ms.append(seconds / args.decode_steps * 1e3)
            entry: dict[str, Any] = {"batch": batch, "step_ms": statistics.median(step_ms), "runs_step_ms": step_ms}
            load = llm.engine.stats().moe_load
            if load is not None:  # the window holds the last run's decode steps only
                entry.update(exchange_bytes_per_step=load.exchange_bytes_per_step, moe_lb=load.moe_lb,
                             moe_lb_worst=load.moe_lb_worst)
            row["batches"].append(entry)
            print(f"EP={ranks} batch {batch:>3}: {entry['step_ms']:.1f} ms/step"
                  + (f", all_gather {entry['exchange_bytes_per_step'] / 2**10:.0f} KiB/step per rank, "
                     f"moe_lb {entry['moe_lb']:.2f}" if load is not None else ""))
        if ranks > 1:  # the worst move: every slot gets another rank's expert, one layer per step boundary
            executor = llm.engine.executor
            table = executor.placement.slot_to_expert
            executor.rebalance(Placement(np.roll(table, table.shape[1] // ranks, axis=1), table.max() + 1, ranks))
            pauses = []
            while True:
                started = time.perf_counter()
                if not executor.move_next_layer():
                    break
                pauses.append(time.perf_counter() - started)
            row.update(move_layer_s=pauses, experts_moved=llm.engine.stats().moe_load.experts_moved)
            print(f"EP={ranks}: moving every expert ({row['experts_moved']} copies) took "
                  f"{', '.join(f'{p * 1e3:.0f}' for p in pauses)} ms (one pause per MoE layer)")
    finally:
        llm.engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    add_shape_args(parser, decode_steps=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (per rank)")
    parser.add_argument("--expert-tokens", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--expert-repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "ep_decode.json"))
    args = parser.parse_args()
    if args.decode_steps < 2:
        parser.error("--decode-steps must be >= 2")
    torch.set_num_threads(args.threads)

    experts = expert_compute(args)
    config = small_config(args)
    with tempfile.TemporaryDirectory(prefix="ep-bench-") as path:
        save_model(config, path, args.seed)
        runs = [decode(args, path, ranks) for ranks in args.ranks]
    write_json({"benchmark": "ep_decode", "args": vars(args), "machine": machine_info(args.threads),
                "cores": os.cpu_count(), "expert_compute": experts, "decode": runs}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
