"""Soak: locust holds N concurrent streaming requests against a server for a while, then checks what it served.

Each locust user loops: a streamed greedy completion of one of --prompts prompts, whose answer was taken first with
the prompt alone; a different answer under load counts as a failure ("wrong answer"), as does any error, a missing
[DONE] or a short answer. One request in --leave-every leaves after two events (a client that disconnects), which
exercises the abort path under load. Meanwhile the server's resident memory is sampled; at the end the server must be
idle with every KV block back in the free pool.

Verdict (exit 0 only if all hold): zero failed requests; resident memory after warm-up grows by at most
max(--rss-bound-mib, --rss-bound-pct of the warm RSS); KV usage 0 with nothing running or waiting at the end.

    python benchmarks/soak.py --users 200 --duration 600                 # starts the bundled model's server
    python benchmarks/soak.py --model tiny --users 200 --duration 30     # the tiny random model (what CI runs)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID ...  # a running, --batch-invariant server

The answer check needs a --batch-invariant server (the servers this script starts are): without it a greedy answer
may legitimately change with the batch around it.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()  # noqa: E402 - locust's gevent needs it before anything opens a socket

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402

import gevent  # noqa: E402
import psutil  # noqa: E402
import requests  # noqa: E402
from locust import HttpUser, constant, task  # noqa: E402
from locust.env import Environment  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "test-model"  # the name running_server serves under
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point").split()


def make_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def completion(base: str, headers: dict, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = requests.post(f"{base}/v1/completions", json=body, headers=headers, timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


class Config:
    """What the locust users read (locust builds users from a class, so the run's settings live here)."""

    prompts: list[str] = []
    expected: list[str] = []
    headers: dict[str, str] = {}
    max_tokens = 32
    leave_every = 20
    counts = {"ok": 0, "wrong": 0, "left": 0}
    stream_seconds: list[float] = []  # whole streams, request sent to [DONE]


class Streamer(HttpUser):
    wait_time = constant(0)

    @task
    def stream(self) -> None:
        i = random.randrange(len(Config.prompts))
        leave = Config.leave_every and random.randrange(Config.leave_every) == 0
        body = {"model": MODEL, "prompt": Config.prompts[i], "max_tokens": Config.max_tokens, "temperature": 0,
                "stream": True}
        name = "leave after 2 events" if leave else "stream"
        sent = time.monotonic()
        with self.client.post("/v1/completions", json=body, headers=Config.headers, stream=True, name=name,
                              catch_response=True, timeout=600) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {response.text[:200]}")
                return
            events = []
            try:
                for line in response.iter_lines(decode_unicode=True):
                    if line and line.startswith("data: "):
                        events.append(line[6:])
                        if leave and len(events) == 2:
                            Config.counts["left"] += 1
                            response.success()
                            return  # closing the response disconnects mid-stream
            except Exception as e:  # noqa: BLE001 - a broken stream is a failed request, never a hidden one
                response.failure(f"the stream broke after {len(events)} events: {type(e).__name__}: {e}")
                return
            if not events or events[-1] != "[DONE]":
                response.failure(f"the stream ended without [DONE] after {len(events)} events")
                return
            chunks = [json.loads(e) for e in events[:-1]]
            if any("error" in c for c in chunks):
                response.failure(f"error event: {[c for c in chunks if 'error' in c][0]}")
                return
            text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]
            if text != Config.expected[i] or finish not in ("length", "stop"):
                Config.counts["wrong"] += 1
                response.failure(f"wrong answer for prompt {i}: {text[:80]!r} (finish {finish})")
                return
            Config.counts["ok"] += 1
            Config.stream_seconds.append(time.monotonic() - sent)
            response.success()


def sample_rss(pid: int | None, samples: list[tuple[float, int]], stop: list[bool]) -> None:
    if pid is None:
        return
    process = psutil.Process(pid)
    while not stop:
        samples.append((time.monotonic(), process.memory_info().rss))
        gevent.sleep(0.25)


def _percentile(values: list[float], q: float) -> float | None:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))], 2) if values else None


def wait_idle(base: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        text = requests.get(f"{base}/metrics", timeout=30).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage"))}
        idle = values.get("vllm:num_requests_running") == values.get("vllm:num_requests_waiting") == 0
        if idle and values.get("vllm:kv_cache_usage_perc") == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def memory_verdict(samples: list[tuple[float, int]], warmup: float, bound_mib: float, bound_pct: float) -> dict:
    """Flat means: after warm-up, the median RSS of each quarter of the run stays within the bound of the first
    quarter's. Medians, because a step's activations come and go (200 rows of logits alone are ~40 MB on the tiny
    model's vocabulary), so single samples swing; a leak moves every later median up."""
    if not samples:
        return {"sampled": False, "ok": True}
    start = samples[0][0]
    after = [rss / 2**20 for t, rss in samples if t - start >= warmup] or [samples[-1][1] / 2**20]
    quarter = max(1, len(after) // 4)
    parts = [after[i : i + quarter] for i in range(0, quarter * min(4, len(after)), quarter)]
    medians = [sorted(part)[len(part) // 2] for part in parts if part]
    drift = max(abs(m - medians[0]) for m in medians)
    bound = max(bound_mib, medians[0] * bound_pct / 100)
    return {"sampled": True, "quarter_medians_mib": [round(m, 1) for m in medians], "drift_mib": round(drift, 1),
            "bound_mib": round(bound, 1), "min_mib": round(min(after), 1), "max_mib": round(max(after), 1),
            "first_mib": round(samples[0][1] / 2**20, 1), "samples": len(samples), "ok": drift <= bound,
            "series_mib": [round(rss / 2**20) for _, rss in samples[:: max(1, len(samples) // 60)]]}


def run(base: str, pid: int | None, args: argparse.Namespace) -> dict:
    Config.prompts = make_prompts(args.prompts, args.prompt_words, args.seed)
    Config.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    Config.max_tokens, Config.leave_every = args.max_tokens, args.leave_every
    Config.expected = [completion(base, Config.headers, p, args.max_tokens) for p in Config.prompts]  # alone
    random.seed(args.seed)
    env = Environment(user_classes=[Streamer], host=base)
    runner = env.create_local_runner()
    samples: list[tuple[float, int]] = []
    stop: list[bool] = []
    sampler = gevent.spawn(sample_rss, pid, samples, stop)
    started = time.monotonic()
    runner.start(args.users, spawn_rate=args.spawn_rate)
    gevent.sleep(args.duration)
    runner.stop()  # in-flight requests are interrupted; those were counted by locust as they ended
    ran = time.monotonic() - started
    stop.append(True)
    sampler.join(timeout=5)
    idle = wait_idle(base)
    total = env.stats.total
    errors = {f"{e.name}: {e.error}"[:200]: e.occurrences for e in env.stats.errors.values()}
    report = {
        "users": args.users, "seconds": round(ran, 1), "max_tokens": args.max_tokens,
        "requests": total.num_requests, "failures": total.num_failures, "errors": errors,
        "answers_checked": Config.counts["ok"], "wrong_answers": Config.counts["wrong"],
        "left_early": Config.counts["left"], "requests_per_s": round(total.num_requests / ran, 2),
        "first_byte_p50_ms": total.median_response_time,
        "stream_p50_s": _percentile(Config.stream_seconds, 0.5), "stream_p95_s": _percentile(Config.stream_seconds, 0.95),
        "tokens_per_s": round(Config.counts["ok"] * args.max_tokens / ran, 1),
        "memory": memory_verdict(samples, args.warmup if args.warmup is not None else ran / 5, args.rss_bound_mib,
                                 args.rss_bound_pct),
        "idle_after": idle,
    }
    report["kv_blocks_returned"] = idle.get("vllm:kv_cache_usage_perc") == 0 and \
        idle.get("vllm:num_requests_running") == idle.get("vllm:num_requests_waiting") == 0
    report["ok"] = (report["failures"] == 0 and report["wrong_answers"] == 0 and report["answers_checked"] > 0
                    and report["memory"]["ok"] and report["kv_blocks_returned"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running --batch-invariant server (default: start one)")
    parser.add_argument("--pid", type=int, default=None, help="the running server's pid, for its memory")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="for the started server: a path, or 'tiny' (default: bundled)")
    parser.add_argument("--users", type=int, default=200, help="concurrent streams")
    parser.add_argument("--spawn-rate", type=float, default=50)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before memory counts (default 1/5)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--leave-every", type=int, default=20, help="one request in N disconnects early (0: none)")
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    parser.add_argument("--rss-bound-pct", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        base, pid = args.url, args.pid
        if base is None:
            from tests.server.conftest import running_server

            model_args: tuple[str, ...] = ("--kv-cache-memory", "1GiB", "--max-model-len", "1024")
            if args.model == "tiny":
                from tests.reliability.tiny import make_tiny_model

                tiny = make_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()))
                model_args = ("--model", tiny, "--max-model-len", "128", "--kv-cache-memory", "64MiB",
                              "--num-threads", "1")
            elif args.model:
                model_args = (*model_args, "--model", args.model)
            server = stack.enter_context(running_server(*model_args, "--batch-invariant", "--max-num-seqs",
                                                        str(max(256, args.users))))
            base, pid = server.url, server.process.pid
        report = run(base, pid, args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
