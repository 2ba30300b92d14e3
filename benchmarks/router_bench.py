"""Routers side by side on two real replicas: deepinfer's router and sglang-router, each with its cache-aware policy,
on the same multi-turn chat stream.

For each router: two fresh `deepinfer serve` replicas (cold caches; each pinned to one core with one thread where
the machine has two), the router in front, then C conversations run concurrently, each turn by turn: turn k's
prompt is a shared system prompt (one of S, an agent's instructions and tool list: benchmarks/prefix_cache.py),
the earlier turns and their answers, and a new user message; greedy, --max-tokens, streamed. Reported: wall time,
requests and output tokens per second, TTFT (first content event) percentiles, and the replicas' own prefix-cache
hit rate (vllm:prefix_cache_hits / queries, summed) and how many requests each replica served.

sglang-router (`pip install sglang-router`; its Rust router, `--backend openai --policy cache_aware`) rewrites a
chat request into its own schema and adds SGLang's fields (no_stop_trim, ignore_eos, continue_final_message,
skip_special_tokens, separate_reasoning, stream_reasoning, return_hidden_states), which deepinfer's strict server
refuses (400 naming the field), and it serves no /v1/completions in that mode. So every router reaches the replicas
through the same shim (a pass-through proxy in its own process) that drops those fields when they hold their
defaults (400 otherwise): the same extra hop for both.

    python benchmarks/router_bench.py                                   # deepinfer, sglang; 6 conversations x 3
    python benchmarks/router_bench.py --routers deepinfer,round_robin --conversations 4 --turns 2
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prefix_cache import system_prompt, user_message  # noqa: E402
from serving import percentiles  # noqa: E402

from deepinfer.router.launch import free_port, plan_cores  # noqa: E402

ROUTERS = ("deepinfer", "sglang", "round_robin", "least_load")  # the last two: deepinfer's router, other policies
# SGLang's additions to a chat request and the values that mean "as OpenAI": the shim drops them
SGLANG_DEFAULTS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                   "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                   "return_hidden_states": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default="deepinfer,sglang", help=f"comma list from {ROUTERS}")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=2, help="distinct shared system prompts")
    parser.add_argument("--tools", type=int, default=12, help="tool lines per system prompt (its length)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "router_bench.json"))
    args = parser.parse_args(argv)
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not args.routers or set(args.routers) - set(ROUTERS):
        parser.error(f"--routers must name some of {ROUTERS}, got {args.routers}")
    if "sglang" in args.routers and not _has_module("sglang_router"):
        parser.error("sglang-router is not installed: pip install sglang-router")
    return args


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---- processes --------------------------------------------------------------------------------------------------
def _wait(url: str, timeout_s: float, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout_s}s")


@contextlib.contextmanager
def processes(commands: list[tuple[list[str], list[int] | None]], logs: str) -> Iterator[list[subprocess.Popen]]:
    started = []
    try:
        for i, (cmd, cores) in enumerate(commands):
            log = open(f"{logs}-{i}.log", "w")
            pin = (lambda c=cores: os.sched_setaffinity(0, c)) if cores else None
            started.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin))
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.terminate()
        for p in started:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@contextlib.contextmanager
def deployment(args: argparse.Namespace, router: str, logs: str) -> Iterator[tuple[str, list[str]]]:
    """Two replicas, a shim in front of each (one process), the router: yields its URL and the replicas'."""
    blocks = plan_cores(sorted(os.sched_getaffinity(0)), 2)
    ports = [free_port() for _ in range(2)]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    serve = [sys.executable, "-m", "deepinfer.cli", "serve", "--host", "127.0.0.1", "--kv-cache-memory",
             args.kv_cache_memory, "--max-model-len", "4096", "--num-threads", str(len(blocks[0]) if blocks else 1)]
    serve += ["--model", args.model] if args.model else []
    with processes([(serve + ["--port", str(p)], blocks[i] if blocks else None) for i, p in enumerate(ports)],
                   f"{logs}-replica") as started:
        for url, p in zip(replicas, started):
            _wait(f"{url}/health", args.startup_timeout, p, f"replica {url}")
        shim_ports = [free_port() for _ in range(2)]
        shims = [f"http://127.0.0.1:{p}" for p in shim_ports]
        shim = [sys.executable, os.path.abspath(__file__), "shim",
                *(f"{p}={u}" for p, u in zip(shim_ports, replicas))]
        port = free_port()
        if router == "sglang":
            route = [sys.executable, "-m", "sglang_router.launch_router", "--backend", "openai", "--policy",
                     "cache_aware", "--worker-urls", *shims, "--host", "127.0.0.1", "--port", str(port),
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        else:
            policy = "cache_aware" if router == "deepinfer" else router
            route = [sys.executable, "-m", "deepinfer.cli", "router", "--port", str(port), "--policy", policy,
                     *(a for s in shims for a in ("--replica", s))]
        with processes([(shim, None), (route, None)], f"{logs}-{router}") as (shim_p, route_p):
            for url in shims:
                _wait(f"{url}/health", 30, shim_p, "shim")
            _wait(f"http://127.0.0.1:{port}/health", 60, route_p, router)
            yield f"http://127.0.0.1:{port}", replicas


def run_shim(pairs: list[str]) -> None:
    """A pass-through proxy per PORT=UPSTREAM that drops SGLang's default-valued chat fields."""

    def app_for(upstream: str) -> FastAPI:
        app = FastAPI()
        http = httpx.AsyncClient(base_url=upstream, timeout=None)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def proxy(path: str, request: Request) -> Response:
            body = await request.body()
            if request.method == "POST" and path == "v1/chat/completions":
                data = json.loads(body)
                for name, default in SGLANG_DEFAULTS.items():
                    if name in data and data.pop(name) != default:
                        return JSONResponse({"error": {"message": f"shim: {name} is not {default}"}}, 400)
                body = json.dumps(data).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
            upstream_request = http.build_request(request.method, "/" + path, params=request.query_params,
                                                  content=body or None, headers=headers)
            answer = await http.send(upstream_request, stream=True)
            kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}

            async def relay():
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                finally:
                    await answer.aclose()

            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(relay(), status_code=answer.status_code, headers=kept)
            content = await answer.aread()
            await answer.aclose()
            return Response(content, status_code=answer.status_code, headers=kept)

        return app

    async def serve_all() -> None:
        servers = [uvicorn.Server(uvicorn.Config(app_for(u), host="127.0.0.1", port=int(p), log_level="warning"))
                   for p, u in (pair.split("=", 1) for pair in pairs)]
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve_all())


# ---- the workload -----------------------------------------------------------------------------------------------
async def converse(http: httpx.AsyncClient, model: str, c: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system_prompt(args.tools, seed=c % args.system_prompts)}]
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": user_message(c, turn)})
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True}
        start, first, text, error = time.perf_counter(), None, [], None
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            if answer.status_code != 200:
                error = f"{answer.status_code}: {(await answer.aread())[:200]!r}"
            else:
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            text.append(piece)
        done = time.perf_counter()
        turns.append({"conversation": c, "turn": turn, "ttft_s": (first or done) - start, "e2e_s": done - start,
                      "events": len(text), "error": error})
        messages.append({"role": "assistant", "content": "".join(text)})
    return turns


def replica_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for url in urls:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            for s in family.samples:
                if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                              "vllm:request_success_total", "vllm:generation_tokens_total"):
                    samples[s.name] = samples.get(s.name, 0.0) + s.value
        out[url] = samples
    return out


def run_router(args: argparse.Namespace, router: str, logs: str) -> dict[str, Any]:
    with deployment(args, router, logs) as (url, replicas):
        model = httpx.get(f"{replicas[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        load_start = os.getloadavg()

        async def run_all() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                done = await asyncio.gather(*(converse(http, model, c, args) for c in range(args.conversations)))
            return [t for turns in done for t in turns]

        start = time.perf_counter()
        turns = asyncio.run(run_all())
        wall = time.perf_counter() - start
        counters = replica_counters(replicas)
    queries = sum(c.get("vllm:prefix_cache_queries_total", 0) for c in counters.values())
    hits = sum(c.get("vllm:prefix_cache_hits_total", 0) for c in counters.values())
    output = sum(c.get("vllm:generation_tokens_total", 0) for c in counters.values())
    ok = [t for t in turns if t["error"] is None]
    later = [t["ttft_s"] for t in ok if t["turn"] > 0]
    return {"router": router, "requests": len(turns), "errors": len(turns) - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tok_s": output / wall,
            "ttft_s": percentiles([t["ttft_s"] for t in ok]), "ttft_later_turns_s": percentiles(later),
            "hit_rate": hits / queries if queries else 0.0,
            "requests_per_replica": [c.get("vllm:request_success_total", 0) for c in counters.values()],
            "load_average_start": load_start, "load_average_end": os.getloadavg(), "turns": turns}


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "shim":
        run_shim(sys.argv[2:])
        return
    args = parse_args(argv)
    logs = os.path.join(tempfile.mkdtemp(prefix="router_bench-"), "log")
    print(f"process logs: {os.path.dirname(logs)}")
    results = []
    for router in args.routers:
        print(f"{router}: starting replicas, shim and router (load average {os.getloadavg()[0]:.1f})", flush=True)
        results.append(run_router(args, router, logs))
        r = results[-1]
        print(f"  {r['requests']} requests, {r['errors']} errors, {r['wall_s']:.1f}s, {r['requests_per_s']:.2f} req/s, "
              f"{r['output_tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_s']['p50']:.2f}s p90 {r['ttft_s']['p90']:.2f}s "
              f"(turns 2+: p50 {r['ttft_later_turns_s']['p50'] or 0:.2f}s), hit rate {r['hit_rate']:.3f}, "
              f"requests per replica {r['requests_per_replica']}", flush=True)
    payload = {"benchmark": "router_bench", "command": [os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])],
               "args": vars(args), "machine": machine_info(1), "results": results}
    print(f"wrote {write_json(payload, args.out)}")


if __name__ == "__main__":
    main()
