"""Multi-turn chat on the real model: time to first token with the prefix cache off, on the device, and on disk after
a restart.

Every conversation shares one long system prompt (an agent's instructions and tool list); each turn appends a user
message to the previous turns and their answers, so turn k's prompt extends turn k-1's. All conversations' turn k
are submitted together (continuous batching), greedy, `--max-tokens` tokens each. Modes:

- off: `enable_prefix_caching=False`, every prompt computed in full;
- device: the block pool's prefix cache (the first conversation's first turn is cold);
- disk-restart: `kv_store="disk"`, and the engine is closed and a new one started before every turn (a cold
  device cache, the disk tier rescanned): turn k can only load what the engines before it saved, i.e. the
  shared system prompt and the earlier turns, never the new user message.

TTFT is first_token_time - arrival_time of each request; the goal is TTFT on turns after the first at least 5x lower
than with caching off. Throughput is (prompt + generated tokens) / wall time of the measured run. Also checks that
greedy answers are identical in every mode.

    python benchmarks/prefix_cache.py                                      # 4 conversations x 4 turns
    python benchmarks/prefix_cache.py --conversations 2 --turns 3 --max-tokens 8
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

TOOLS = ("search_orders", "refund_payment", "update_address", "check_stock", "schedule_delivery", "open_ticket",
         "lookup_customer", "apply_discount", "cancel_order", "send_invoice", "track_parcel", "escalate_to_human")
TOPICS = ("a late parcel", "a damaged lamp", "a double charge", "a new address", "a missing invoice", "a discount code",
          "an order for a wedding", "a parcel sent to the wrong city", "a broken zipper", "a gift card balance")


def system_prompt(num_tools: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = ["You are the support agent of a small online shop. Follow these rules strictly. Be brief and polite. "
             "Never promise refunds you cannot give. Ask for the order number when it is missing. "
             "You can call the following tools; describe the call you would make in one line."]
    for i in range(num_tools):
        name = TOOLS[i % len(TOOLS)] + (f"_v{i // len(TOOLS) + 1}" if i >= len(TOOLS) else "")
        args = ", ".join(rng.sample(["order_id", "customer_id", "amount", "currency", "address", "date", "sku",
                                      "quantity", "reason", "email", "priority"], 3))
        lines.append(f"- {name}({args}): use it when the customer asks about {rng.choice(TOPICS)}; "
                     f"confirm every argument with the customer first and report the result in one sentence.")
    return "\n".join(lines)


def user_message(conversation: int, turn: int) -> str:
    rng = random.Random(conversation * 1000 + turn)
    topic = rng.choice(TOPICS)
    return (f"Hello again, this is customer {1000 + conversation}. About {topic}: order {rng.randrange(10**5, 10**6)} "
            f"was placed {rng.randrange(2, 30)} days ago and I still need help. What should I do next?")


def run_workload(new_llm: Callable[[], Any], args: argparse.Namespace, label: str, restart: bool) -> dict[str, Any]:
    """`new_llm` builds an engine; with `restart` each turn gets a new one. Wall time counts generation only."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    system = system_prompt(args.tools)
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    records: list[dict[str, Any]] = []
    prompt_tokens = generated = 0
    wall = 0.0
    llm = new_llm()
    for turn in tqdm(range(1, args.turns + 1), desc=label, unit="turn", leave=False, disable=args.no_progress):
        if restart and turn > 1:
            release(llm)  # waits for the queued saves
            llm = new_llm()
        prompts = []
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": user_message(c, turn)})
            prompts.append(llm.engine.apply_chat_template(history))
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall += time.perf_counter() - started
        for c, (history, prompt, out) in enumerate(zip(histories, prompts, outs)):
            history.append({"role": "assistant", "content": out.outputs[0].text})
            m = out.metrics
            records.append({"conversation": c, "turn": turn, "prompt_tokens": len(prompt),
                            "cached_tokens": out.num_cached_tokens, "ttft_s": m.first_token_time - m.arrival_time,
                            "token_ids": out.outputs[0].token_ids})
            prompt_tokens += len(prompt)
            generated += len(out.outputs[0].token_ids)
    later = [r["ttft_s"] for r in records if r["turn"] > 1]
    first = [r["ttft_s"] for r in records if r["turn"] == 1]
    stats = llm.engine.stats()  # with restarts: the last engine's, i.e. the last turn's
    release(llm)
    return {
        "wall_s": wall,
        "throughput_tok_s": (prompt_tokens + generated) / wall,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "ttft_first_turn": summary(first),
        "ttft_later_turns": summary(later),
        "prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0,
        "kv_store": None if stats.kv_store is None else {
            "loaded_tokens": stats.kv_store.loaded_tokens, "failed_blocks": stats.kv_store.failed_blocks,
            "tiers": [{"name": t.name, "hits": t.hits, "bytes_read": t.bytes_read, "bytes_written": t.bytes_written}
                      for t in stats.kv_store.tiers]},
        "requests": records,
    }


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "mean": statistics.fmean(ordered), "n": len(ordered)}


def make_llm(args: argparse.Namespace, **options: Any) -> Any:
    from deepinfer.llm import LLM

    return LLM(args.model, kv_cache_memory=args.kv_cache_memory << 20, num_threads=args.threads, **options)


def release(llm: Any) -> None:
    llm.engine.close()
    del llm
    gc.collect()


def plot(results: dict[str, dict[str, Any]], turns: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, result in results.items():
        by_turn = [statistics.median(r["ttft_s"] for r in result["requests"] if r["turn"] == t) for t in range(1, turns + 1)]
        ax.plot(range(1, turns + 1), by_turn, "o-", label=mode)
    ax.set_yscale("log")
    ax.set_xticks(range(1, turns + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT, seconds (log)")
    ax.set_title("Multi-turn chat: time to first token by prefix-cache mode")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tools", type=int, default=24, help="tool lines in the shared system prompt (its length)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=512, help="MiB")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the dev machine is 2 shared cores)")
    parser.add_argument("--modes", default="off,device,disk-restart")
    parser.add_argument("--kv-store-path", default=None, help="disk tier directory (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "prefix_cache.json"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"off", "device", "disk-restart"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="deepinfer-kv-") as scratch:
        disk = args.kv_store_path or scratch
        options = {"off": dict(enable_prefix_caching=False), "device": {},
                   "disk-restart": dict(kv_store="disk", kv_store_path=disk)}
        for mode in tqdm(modes, desc="modes", disable=args.no_progress):
            results[mode] = run_workload(lambda o=options[mode]: make_llm(args, **o), args, mode, mode == "disk-restart")
            later = results[mode]["ttft_later_turns"]
            print(f"{mode:>13}: TTFT turns>1 p50 {later['p50'] * 1000:8.1f} ms p90 {later['p90'] * 1000:8.1f} ms; "
                  f"turn 1 p50 {results[mode]['ttft_first_turn']['p50'] * 1000:8.1f} ms; "
                  f"{results[mode]['throughput_tok_s']:7.1f} tok/s", file=sys.stderr)

    answers = {mode: [r["token_ids"] for r in result["requests"]] for mode, result in results.items()}
    reference = next(iter(answers.values()))
    speedups = {}
    if "off" in results:
        base = results["off"]["ttft_later_turns"]
        for mode, result in results.items():
            if mode != "off":
                speedups[mode] = {q: base[q] / result["ttft_later_turns"][q] for q in ("p50", "p90")}
    report = {
        "benchmark": "prefix_cache",
        "machine": machine_info(torch.get_num_threads()),
        "workload": {k: getattr(args, k) for k in ("conversations", "turns", "tools", "max_tokens", "kv_cache_memory")},
        "identical_greedy_answers": all(a == reference for a in answers.values()),
        "ttft_speedup_vs_off_later_turns": speedups,
        "modes": results,
    }
    write_json(report, args.out)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(results, args.turns, png)
    for mode, s in speedups.items():
        print(f"{mode}: TTFT on turns after the first is {s['p50']:.1f}x (p50) / {s['p90']:.1f}x (p90) lower than off",
              file=sys.stderr)
    print(f"identical greedy answers across modes: {report['identical_greedy_answers']}; wrote {args.out} and {png}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
