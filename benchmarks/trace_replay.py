"""Prefix-cache hit rate on the Mooncake synthetic trace, through the engine's own block pool, scheduler and KV store.

No model: a stand-in worker loads what the scheduler plans to load (a `get` per block) and saves what it plans to
save (a `put` per newly full block), so the hit rates come from exactly the code that serves requests: the chained
block keys, the device LRU free queue, the store's `contains` / LRU / TTL, and the rule that the block holding the
last prompt token is always computed. Tokens are synthesized per hash id (block h holds h*512 .. h*512+511).

Requests run one after another in trace order, each admitted, prefilled in one step and finished (one output
token), so capacity acts through eviction only; the store's clock is the trace's own timestamps. Two ideals:
the trace's (a block hits if its hash id was seen before) and the engine's with infinite capacity (the same,
minus the partial last block and the block of the last prompt token, which are never reused).

    python benchmarks/trace_replay.py                   # full trace, ~1 minute per configuration on one core
    python benchmarks/trace_replay.py --limit 1000      # the first 1000 requests
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.kvstore import AsyncSaver, KVStoreConfig, MemoryStore
from deepinfer.kvstore.connector import KVStoreConnector
from deepinfer.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "data", "mooncake_synthetic_trace.jsonl")
BLOCK = 512  # the trace's block size
PAYLOAD = b"\0" * 64  # stands in for a block's KV; store capacities are set in blocks
KEY_BYTES = 16
UNLIMITED = 1 << 30


@dataclass(frozen=True)
class Row:
    device_blocks: int
    store_blocks: int  # 0: no store
    hit_rate: float
    device_hit_rate: float
    store_hit_rate: float
    device_evictions: int
    store_evictions: int
    seconds: float


def load_trace(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows[:limit] if limit else rows


def prompt_tokens(row: dict) -> list[int]:
    tokens: list[int] = []
    for h in row["hash_ids"]:
        tokens.extend(range(h * BLOCK, h * BLOCK + BLOCK))
    return tokens[: row["input_length"]]


def ideal_hit_rates(trace: list[dict]) -> tuple[float, float]:
    """(the trace's ideal, the engine's ideal): both with an infinite cache."""
    seen: set[int] = set()
    trace_hits = engine_hits = total = 0
    for row in trace:
        run = 0
        for h in row["hash_ids"]:
            if h not in seen:
                break
            run += 1
        n = row["input_length"]
        trace_hits += min(run * BLOCK, n)
        engine_hits += min(run, (n - 1) // BLOCK) * BLOCK
        total += n
        seen.update(row["hash_ids"])
    return trace_hits / total, engine_hits / total


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def stand_in_worker(plan: StepPlan, scheduler: Scheduler, store: MemoryStore | None) -> StepResult:
    result = StepResult()
    for request_id, refs in plan.kv_loads.items():
        for i, ref in enumerate(refs):
            if store.get(ref.key) is None:
                result.kv_load_failures[request_id] = i
                break
    if store is not None:
        for refs in plan.kv_saves.values():
            for ref in refs:
                store.put(ref.key, PAYLOAD, ref.ttl_class)
    for request_id, n in plan.num_tokens.items():
        request = scheduler.requests[request_id]
        if request_id not in result.kv_load_failures and request.num_computed_tokens + n == request.num_tokens:
            result.sampled[request_id] = [0]
    return result


def replay(trace: list[dict], device_blocks: int, store_blocks: int, progress: bool) -> Row:
    started = time.perf_counter()
    clock = Clock()
    kv = KVCacheManager(device_blocks, BLOCK, True, "mooncake-trace")
    store = connector = None
    if store_blocks:
        store = MemoryStore(KVStoreConfig(kinds=("memory",), memory_bytes=store_blocks * (KEY_BYTES + len(PAYLOAD))), clock)
        connector = KVStoreConnector(store, AsyncSaver(store), BLOCK)  # the worker puts synchronously instead
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=UNLIMITED), kv, UNLIMITED, connector)
    params = SamplingParams(max_tokens=1, kv_ttl_class="chatbot")
    total = 0
    label = f"device {device_blocks} + store {store_blocks}" if store_blocks else f"device {device_blocks}"
    for i, row in enumerate(tqdm(trace, desc=label, unit="req", disable=not progress, leave=False)):
        clock.now = 1_700_000_000.0 + row["timestamp"] / 1000
        scheduler.add(Request(str(i), prompt_tokens(row), params, 0, clock.now))
        total += row["input_length"]
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            if not plan.num_tokens:
                raise RuntimeError(f"request {i} ({row['input_length']} tokens) does not fit {device_blocks} blocks")
            scheduler.update(plan, stand_in_worker(plan, scheduler, store))
    store_hits = connector.stats().loaded_tokens if connector else 0
    row = Row(
        device_blocks=device_blocks,
        store_blocks=store_blocks,
        hit_rate=(kv.prefix_hits + store_hits) / total,
        device_hit_rate=kv.prefix_hits / total,
        store_hit_rate=store_hits / total,
        device_evictions=kv.pool.stats().evictions,
        store_evictions=store.stats().tiers[0].evictions if store else 0,
        seconds=time.perf_counter() - started,
    )
    if connector:
        connector.close()
    return row


def plot(rows: list[Row], ideals: dict[str, float], device_for_store: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    device = sorted((r.device_blocks, r.hit_rate) for r in rows if not r.store_blocks)
    tiered = sorted((device_for_store + r.store_blocks, r.hit_rate) for r in rows if r.store_blocks)
    ax.plot(*zip(*device), "o-", label="device block pool only")
    if tiered:
        ax.plot(*zip(*tiered), "s-", label=f"{device_for_store}-block device pool + host-memory store")
    ax.axhline(ideals["trace"], ls="--", color="gray", label=f"trace ideal {ideals['trace']:.1%}")
    ax.axhline(ideals["engine"], ls=":", color="black", label=f"engine ideal (infinite) {ideals['engine']:.1%}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"total capacity, blocks of {BLOCK} tokens")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_title("Mooncake synthetic trace: prefix-cache hit rate vs capacity")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--device-blocks", default="512,1024,2048,4096,8192,16384,32768",
                        help="device pool sizes to sweep, without a store")
    parser.add_argument("--store-device-blocks", type=int, default=512, help="device pool size under the store sweep")
    parser.add_argument("--store-blocks", default="1024,4096,16384,32768,65536", help="store capacities to sweep")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "trace_replay.json"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    trace = load_trace(args.trace, args.limit)
    largest = max((row["input_length"] + BLOCK - 1) // BLOCK for row in trace)
    unique = len({h for row in trace for h in row["hash_ids"]})
    trace_ideal, engine_ideal = ideal_hit_rates(trace)
    configs = [(int(d), 0) for d in args.device_blocks.split(",") if d]
    configs += [(args.store_device_blocks, int(s)) for s in args.store_blocks.split(",") if s and int(s)]
    configs.append((unique + largest + 1, 0))  # never evicts: must reach the engine ideal
    rows = []
    for device, store in tqdm(configs, desc="configurations", disable=args.no_progress):
        if device < largest + 1:
            print(f"skipping {device} device blocks: the largest request needs {largest + 1}", file=sys.stderr)
            continue
        rows.append(replay(trace, device, store, not args.no_progress))
        r = rows[-1]
        print(f"device {device:>6} store {store:>6}: hit {r.hit_rate:6.2%} (device {r.device_hit_rate:6.2%}, "
              f"store {r.store_hit_rate:6.2%})  {r.seconds:5.1f}s", file=sys.stderr)
    ideals = {"trace": trace_ideal, "engine": engine_ideal}
    report = {
        "trace": os.path.relpath(args.trace, HERE), "requests": len(trace), "block_size": BLOCK,
        "unique_blocks": unique, "largest_request_blocks": largest,
        "input_tokens": sum(row["input_length"] for row in trace), "ideal_hit_rate": ideals,
        "rows": [asdict(r) for r in rows],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(rows, ideals, args.store_device_blocks, png)
    print(f"wrote {args.out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
