"""Disaggregated prefill/decode (1 prefill + 1 decode replica behind the router) versus one combined engine, on this
machine, at several request rates: TTFT and ITL p50/p99, output throughput, and what the KV hand-off costs per prompt
token on each path (direct: zmq between the two processes; store: the disk tier both share).

The hardware is the same for every deployment: the combined engine runs on every core with as many threads; with
disaggregation the cores are split in two blocks, the prefill replica pinned to the first and the decode replica to
the second, each with that many threads. The router and this load generator run unpinned. Every request streams
(Poisson arrivals at the rate, seeded random-word prompts, greedy).

    python benchmarks/disagg.py --rates 0.5,1,2 --num-prompts 16 --input-len 256 --output-len 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_bench import _wait, processes  # noqa: E402
from serving import Prompt, one_request, percentiles, synthetic_prompts  # noqa: E402

from deepinfer.router.launch import free_port, plan_cores  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "disagg.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--deployments", default="combined,direct,store")
    p.add_argument("--rates", default="0.5,1,2", help="requests per second, comma-separated")
    p.add_argument("--num-prompts", type=int, default=16, help="per rate")
    p.add_argument("--input-len", type=int, default=256, help="words per prompt (about one token each)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", default=RESULTS)
    return p.parse_args(argv)


def serve_cmd(args: argparse.Namespace, port: int, threads: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "4096", "--num-threads", str(threads), *extra]
    return cmd + (["--model", args.model] if args.model else [])


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


async def load(url: str, prompts: list[Prompt], rate: float, seed: int) -> tuple[list, float]:
    opts = argparse.Namespace(temperature=0.0, endpoint="completions")
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=f"{url}/v1", limits=limits, timeout=httpx.Timeout(600)) as http:
        model = (await http.get("/models")).raise_for_status().json()["data"][0]["id"]
        rng = random.Random(seed)
        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(http, opts, model, prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def measure(args: argparse.Namespace, name: str, url: str, prefill: str | None, decode: str | None) -> list[dict]:
    rows = []
    warm = synthetic_prompts(2, args.input_len, 4, seed=args.seed + 99)
    asyncio.run(load(url, warm, 100.0, 0))
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        prompts = synthetic_prompts(args.num_prompts, args.input_len, args.output_len, seed=args.seed + i)
        before = (scrape(prefill), scrape(decode)) if prefill else None
        load_before = os.getloadavg()[0]
        results, duration = asyncio.run(load(url, prompts, rate, args.seed + i))
        ok = [r for r in results if r.ok]
        row: dict[str, Any] = {
            "deployment": name, "rate": rate, "completed": len(ok), "errors": len(results) - len(ok),
            "duration_s": duration, "output_tok_s": sum(r.output_tokens for r in ok) / duration,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "itl_s": percentiles([g for r in ok for g in r.itl]),
            "loadavg_1m": (load_before, os.getloadavg()[0]),
        }
        if before is not None:
            after = (scrape(prefill), scrape(decode))

            def diff(side: int, metric: str, **labels: str) -> float:
                return total(after[side], metric, **labels) - total(before[side], metric, **labels)

            handed = diff(1, "deepinfer:kv_handoffs_total", outcome="remote")
            # the prefill's time to make the hand-off ready (store: its saves landing) plus the decode's wait for it
            latency = diff(0, "deepinfer:kv_handoff_offer_seconds_total") \
                + diff(1, "deepinfer:kv_handoff_latency_seconds_sum")
            sent = diff(0, "deepinfer:kv_handoff_bytes_sum")
            tokens = row["prompt_tokens"] or 1
            row["handoff"] = {
                "requests": handed, "received": diff(1, "deepinfer:kv_handoffs_total", outcome="received"),
                "fallbacks": diff(1, "deepinfer:kv_handoffs_total", outcome="fallback"),
                "cost_mean_ms": 1e3 * latency / max(1.0, diff(1, "deepinfer:kv_handoff_latency_seconds_count")),
                "us_per_prompt_token": 1e6 * latency / tokens, "bytes_per_prompt_token": sent / tokens,
                "pull_throughput_MBps": diff(1, "deepinfer:kv_handoff_received_bytes_total") / 1e6
                / max(1e-9, diff(1, "deepinfer:kv_handoff_transfer_seconds_total")),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_deployment(args: argparse.Namespace, name: str, logs: str) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0))
    if name == "combined":
        port = free_port()
        with processes([(serve_cmd(args, port, len(cores), "--role", "both"), None)], f"{logs}-{name}") as (p,):
            _wait(f"http://127.0.0.1:{port}/health", args.startup_timeout, p, "combined engine")
            return measure(args, name, f"http://127.0.0.1:{port}", None, None)
    blocks = plan_cores(cores, 2) or [cores, cores]
    ports = [free_port() for _ in range(3)]
    store = ("--kv-store", "disk", "--kv-store-path", tempfile.mkdtemp(prefix="disagg-kv-")) if name == "store" else ()
    engines = [(serve_cmd(args, ports[0], len(blocks[0]), "--role", "prefill", "--kv-handoff", name, *store),
                blocks[0]), (serve_cmd(args, ports[1], len(blocks[1]), "--role", "decode", *store), blocks[1])]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with processes(engines, f"{logs}-{name}") as started:
        for url, p in zip(urls, started):
            _wait(f"{url}/health", args.startup_timeout, p, url)
        router = [sys.executable, "-m", "deepinfer.cli", "router", "--port", str(ports[2]), "--prefill", urls[0],
                  "--decode", urls[1]]
        with processes([(router, None)], f"{logs}-{name}-router") as (r,):
            _wait(f"{urls[2]}/health", 120, r, "router")
            return measure(args, name, urls[2], urls[0], urls[1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs = os.path.join(tempfile.mkdtemp(prefix="disagg-bench-"), "log")
    rows = []
    for name in args.deployments.split(","):
        rows += run_deployment(args, name, logs)
    print(f"\n{'deployment':10s} {'rate':>5s} {'TTFT p50':>9s} {'p99':>7s} {'ITL p50':>8s} {'p99':>7s} {'tok/s':>6s} "
          f"{'hand-off us/tok':>15s} {'B/tok':>7s} {'load':>9s}")
    for r in rows:
        h = r.get("handoff")
        print(f"{r['deployment']:10s} {r['rate']:5.2f} {r['ttft_s']['p50']:9.2f} {r['ttft_s']['p99']:7.2f} "
              f"{r['itl_s']['p50'] * 1e3:7.0f}m {r['itl_s']['p99'] * 1e3:6.0f}m {r['output_tok_s']:6.1f} "
              f"{(h['us_per_prompt_token'] if h else 0):15.1f} {(h['bytes_per_prompt_token'] if h else 0):7.0f} "
              f"{r['loadavg_1m'][0]:4.1f}-{r['loadavg_1m'][1]:<4.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "cpus": len(os.sched_getaffinity(0)), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}; logs under {os.path.dirname(logs)}")


if __name__ == "__main__":
    main()
