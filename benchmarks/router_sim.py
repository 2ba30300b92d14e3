"""Router policies on a Mooncake-format trace: N simulated replicas behind deepinfer/router/policy.py:pick.

A discrete-event simulation of N replicas (benchmarks/router_replica_sim.py: continuous batching like
core/scheduler.py, an LRU prefix cache of --capacity blocks). Step times come from the router's CostModel (the
router's default, deepinfer/router/config.py:DEFAULT_COST, or --cost-model PATH from benchmarks/calibrate_cost.py).
The router sees each replica through ReplicaState: incremental reports (load, added and evicted keys) applied once
they are --report-interval seconds old, plus its own optimistic update for each request it routes.

The trace gives one hash id per 512-token block, so each request's key chain has one key per 512 tokens
(block_key chained over the hash ids, so a key names its whole prefix); the last, partial block is cacheable too
(the trace's convention; the engine itself only caches full blocks).

Definitions:
- oracle hit rate: an infinite cache shared by all replicas, in trace order: a block is a hit if any earlier request
  had it. Hit rate: blocks a replica had cached at admission / all prompt blocks. Reported relative to the oracle.
- throughput vs ideal: I(N) / max_r W_r. W_r is replica r's compute seconds (its step times minus the fixed
  per-step cost step_s, which batching amortises and routing does not decide). W* is the compute of the same trace
  with the oracle's hits, each request's prefill and decode priced by the same cost model; the perfectly balanced
  run with the ideal shared cache gives each replica I(N) = max(W* / N, the largest single request's compute),
  since a request runs on one replica. It factors into cache efficiency W* / sum_r W_r and balance
  max(mean_r W_r, largest request) / max_r W_r. In a saturated run the busiest replica sets the makespan, so this
  is the throughput ratio.
- online reference: the same ratio for greedy list scheduling (each request, in arrival order, to the replica with
  the least compute so far, knowing every request's exact work and the oracle's hits). A request that arrives late
  and large lands on a replica that already has its share, so no online router reaches 1.0 on a heavy-tailed
  trace; this shows how close one with perfect information gets.
- time scale: arrival times are multiplied by it; by default it is chosen so that W* fills --utilisation (0.75) of
  the N replicas over the trace's span (reported; a policy with fewer hits than the oracle runs hotter, and one
  at utilisation > 1 is saturated: its queues grow for the whole run).
- TTFT: first token (the end of the step that computes the last prompt token) minus arrival, seconds of the cost
  model's machine.

    python benchmarks/router_sim.py                                  # 3 policies x 8 and 64 replicas, ~15 s
    python benchmarks/router_sim.py --replicas 8 --policies cache_aware --cache-weight 4 --recent-weight 1
    python benchmarks/router_sim.py --trace other.jsonl --cost-model benchmarks/results/cost_model.json
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from router_replica_sim import BLOCK, Job, Replica, TraceRequest, cached_tokens  # noqa: E402

from deepinfer.core.prefix_cache import block_key, root_key  # noqa: E402
from deepinfer.router.config import load_cost_model  # noqa: E402
from deepinfer.router.policy import (POLICIES, CostModel, ReplicaState, RoutingConfig, attention_pairs,  # noqa: E402
                                     pick)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "data", "mooncake_synthetic_trace.jsonl")
RESULTS = os.path.join(HERE, "results")
# The cost model defaults to the router's (deepinfer/router/config.py:DEFAULT_COST: the bundled SmolLM2 on this
# 2-core VM, good to about +-30%). Attention per (query, key) pair costs as much as a prompt token's linear layers at
# ~1,900 tokens of context there, so the trace's long prompts (up to 191k tokens) are attention-bound.

# cache_aware as tuned on the default trace and cost model (the policy's defaults), except the balance window: here
# a request averages ~200 s of compute and the largest ~38,000 s, and every window that triggers (tried 3,000 s to
# 100,000 s) moves follow-ups of the longest conversations off the replica holding their prefix: hit rate and
# throughput drop. So the window is set wide enough never to trigger on this trace.
DEFAULT_ROUTING = RoutingConfig(balance_abs_s=1e6, block_size=BLOCK)


def load_trace(path: str, limit: int | None = None, max_input: int | None = None) -> list[TraceRequest]:
    """Reads Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids) and builds each key chain;
    `limit` keeps the first requests, `max_input` drops longer prompts."""
    root = root_key("mooncake-trace", None)
    memo: dict[tuple[bytes, int], bytes] = {}
    requests = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if not row["hash_ids"] or row["input_length"] < 1 or row["output_length"] < 1:
                raise ValueError(f"{path}: request {len(requests)} needs hash_ids and lengths >= 1, got {row}")
            keys, parent = [], root
            for h in row["hash_ids"]:
                parent = memo.get((parent, h)) or memo.setdefault((parent, h), block_key(parent, [h]))
                keys.append(parent)
            if max_input is None or row["input_length"] <= max_input:
                requests.append(TraceRequest(len(requests), row["timestamp"] / 1000, row["input_length"],
                                             row["output_length"], tuple(keys)))
            if limit and len(requests) == limit:
                break
    start = requests[0].arrival
    return [TraceRequest(r.index, r.arrival - start, r.input_len, r.output_len, r.keys) for r in requests]


def decode_work(r: TraceRequest, cost: CostModel) -> float:
    """Compute seconds of a request's decode steps: the first token comes from its prefill, each later one attends
    over the prompt and the tokens generated so far."""
    steps = r.output_len - 1
    return steps * cost.decode_request_s + cost.decode_context_s * (steps * r.input_len + steps * (steps + 1) // 2)


@dataclass(frozen=True)
class Oracle:
    """An infinite cache shared by every replica, in trace order: a block is a hit if any earlier request had it."""

    hit_rate: float
    works: tuple[float, ...] = field(repr=False)  # each request's compute seconds with these hits, in trace order

    @property
    def work_s(self) -> float:  # W*
        return sum(self.works)

    def ideal_per_replica(self, n: int) -> float:
        """The busiest replica's compute in a perfect split: W*/N, unless one request alone is more (a request
        runs on one replica)."""
        return max(self.work_s / n, max(self.works))

    def online_reference(self, n: int) -> float:
        """Throughput vs ideal of greedy list scheduling: each request, in arrival order, to the replica with the
        least compute so far, knowing every request's exact work and the oracle's hits. What an online router
        with perfect information reaches on this metric: below 1 when a large request arrives late."""
        loads = [0.0] * n
        for w in self.works:
            heapq.heapreplace(loads, loads[0] + w)
        return self.ideal_per_replica(n) / max(loads)


def oracle(requests: Sequence[TraceRequest], cost: CostModel) -> Oracle:
    seen: set[bytes] = set()
    hits = blocks = 0
    works = []
    for r in requests:
        matched = next((i for i, k in enumerate(r.keys) if k not in seen), len(r.keys))
        hits += sum(k in seen for k in r.keys)
        blocks += len(r.keys)
        seen.update(r.keys)
        cached = cached_tokens(matched, r.input_len)
        prefill = cost.prefill_work(r.input_len - cached, attention_pairs(cached, r.input_len))
        works.append(prefill + decode_work(r, cost))
    return Oracle(hits / blocks, tuple(works))


@dataclass
class RunResult:
    policy: str
    replicas: int
    time_scale: float
    hit_rate: float
    hit_rate_vs_oracle: float
    throughput_vs_ideal: float
    online_reference: float  # Oracle.online_reference(N)
    cache_efficiency: float  # W* / sum of replica compute
    balance: float  # max(mean replica compute, largest request) / max replica compute
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    utilisation: float  # sum of busy seconds / (N * last arrival)
    completed: int
    evictions: int
    reasons: dict[str, int]
    wall_s: float


def simulate(requests: Sequence[TraceRequest], n: int, policy: str, cost: CostModel, routing: RoutingConfig,
             args: argparse.Namespace, time_scale: float, ideal: Oracle, progress: bool) -> RunResult:
    started = time.perf_counter()
    replicas = [Replica(i, args.capacity, cost, args.max_num_seqs) for i in range(n)]
    states = [ReplicaState(f"r{i}") for i in range(n)]
    decay = routing.decay()
    events: list[tuple[float, int, int]] = []  # (time, order, replica) step completions
    order = 0
    jobs: list[Job] = []
    reasons: Counter[str] = Counter()
    arrivals = deque(requests)
    bar = tqdm(total=len(requests), desc=f"{policy} N={n}", unit="req", leave=False, disable=not progress)

    def start(rep: Replica, now: float) -> None:
        nonlocal order
        seconds = rep.plan_step()
        if seconds is not None:
            order += 1
            heapq.heappush(events, (now + seconds, order, rep.index))

    while arrivals or events:
        if arrivals and (not events or arrivals[0].arrival * time_scale <= events[0][0]):
            r = arrivals.popleft()
            now = r.arrival * time_scale
            for i, rep in enumerate(replicas):
                if rep.dirty and now - rep.last_report >= args.report_interval:
                    states[i] = states[i].apply(rep.report(now))
            d = pick(r.keys, r.input_len, states, cost, policy, counter=len(jobs), config=routing)
            reasons[d.reason] += 1
            states = [s.decayed(decay) for s in states]
            states[d.index] = states[d.index].with_routed(r.keys, r.input_len, d, BLOCK)
            rep = replicas[d.index]
            job = Job(r, now, cached_tokens(rep.matched_prefix(r.keys), r.input_len))
            jobs.append(job)
            rep.enqueue(job)
            if rep.stepping is None:
                start(rep, now)
            bar.update(1)
        else:
            now, _, i = heapq.heappop(events)
            replicas[i].finish_step(now)
            start(replicas[i], now)
    bar.close()

    ttft = sorted(j.first_token - j.arrival for j in jobs if j.first_token is not None)
    completed = sum(j.first_token is not None and j.generated >= j.request.output_len for j in jobs)
    blocks = sum(len(j.request.keys) for j in jobs)
    hit_rate = sum(j.matched for j in jobs) / blocks
    compute = [rep.compute_s for rep in replicas]
    span = max(r.arrival for r in requests) * time_scale or 1.0
    return RunResult(
        policy=policy, replicas=n, time_scale=time_scale, hit_rate=hit_rate,
        hit_rate_vs_oracle=hit_rate / ideal.hit_rate, throughput_vs_ideal=ideal.ideal_per_replica(n) / max(compute),
        online_reference=ideal.online_reference(n), cache_efficiency=ideal.work_s / sum(compute),
        balance=max(statistics.mean(compute), max(ideal.works)) / max(compute), ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p99_s=_quantile(ttft, 0.99), ttft_mean_s=statistics.mean(ttft),
        utilisation=sum(rep.busy_s for rep in replicas) / (n * span), completed=completed,
        evictions=sum(rep.evictions for rep in replicas), reasons=dict(reasons), wall_s=time.perf_counter() - started)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DEFAULT_ROUTING
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=TRACE, help="Mooncake-format JSONL (default: the bundled synthetic trace)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--max-input", type=int, default=None, help="drop requests with longer prompts (tokens)")
    parser.add_argument("--replicas", default="8,64", help="comma list of cluster sizes (default %(default)s)")
    parser.add_argument("--policies", default=",".join(POLICIES[::-1]), help="comma list from %(default)s")
    parser.add_argument("--cost-model", default=None, help="JSON from calibrate_cost.py (default: built-in numbers)")
    parser.add_argument("--capacity", type=int, default=8192,
                        help="prefix-cache blocks of 512 tokens per replica (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="running requests per replica (default 128)")
    parser.add_argument("--utilisation", type=float, default=0.75,
                        help="sets the default time scale: W* fills this share of the replicas (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=None, help="multiply arrival times by this instead")
    parser.add_argument("--report-interval", type=float, default=1.0,
                        help="seconds between a replica's reports to the router (default %(default)s)")
    parser.add_argument("--cache-weight", type=float, default=d.cache_weight, help="default %(default)s")
    parser.add_argument("--recent-weight", type=float, default=d.recent_weight, help="default %(default)s")
    parser.add_argument("--recent-decisions", type=int, default=d.recent_decisions, help="default %(default)s")
    parser.add_argument("--balance-abs", type=float, default=d.balance_abs_s, help="seconds (default %(default)s)")
    parser.add_argument("--balance-rel", type=float, default=d.balance_rel, help="default %(default)s")
    parser.add_argument("--max-kv-usage", type=float, default=d.max_kv_usage, help="default %(default)s")
    parser.add_argument("--out", default=os.path.join(RESULTS, "router_sim.json"), help="JSON path; a PNG beside it")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.replicas = [int(v) for v in args.replicas.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--replicas must be comma-separated integers, got {args.replicas!r}")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.replicas or min(args.replicas) < 1:
        parser.error(f"--replicas must be integers >= 1, got {args.replicas}")
    if not args.policies or set(args.policies) - set(POLICIES):
        parser.error(f"--policies must name some of {POLICIES}, got {args.policies}")
    if not 0 < args.utilisation <= 1 or args.capacity < 1 or args.max_num_seqs < 1 or args.report_interval < 0:
        parser.error("need 0 < --utilisation <= 1, --capacity >= 1, --max-num-seqs >= 1, --report-interval >= 0")
    return args


def plot(rows: list[RunResult], path: str, title: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.replicas for r in rows})
    policies = list(dict.fromkeys(r.policy for r in rows))
    panels = (("throughput_vs_ideal", "throughput / ideal"), ("hit_rate_vs_oracle", "hit rate / oracle"),
              ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.8))
    width = 0.8 / len(policies)
    for ax, (metric, label) in zip(axes, panels):
        for j, policy in enumerate(policies):
            values = [next((getattr(r, metric) for r in rows if r.policy == policy and r.replicas == n), 0)
                      for n in sizes]
            ax.bar([i + j * width for i in range(len(sizes))], values, width, label=policy, color=f"C{j}")
        ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(sizes))], [f"N={n}" for n in sizes])
        ax.set_title(label, fontsize=10)
        if metric == "throughput_vs_ideal":  # the online reference of each cluster size, across its bars
            for i, n in enumerate(sizes):
                ref = next(r.online_reference for r in rows if r.replicas == n)
                ax.hlines(ref, i - width / 2, i + width * (len(policies) - 0.5), color="black",
                          label="online reference" if i == 0 else None)
        if metric.startswith("ttft"):
            ax.set_yscale("log")
        else:
            ax.axhline(0.95, color="gray", linestyle="--", linewidth=0.8)
            ax.set_ylim(0, 1.05)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cost = load_cost_model(args.cost_model)
    routing = RoutingConfig(cache_weight=args.cache_weight, recent_weight=args.recent_weight,
                            recent_decisions=args.recent_decisions, balance_abs_s=args.balance_abs,
                            balance_rel=args.balance_rel, max_kv_usage=args.max_kv_usage, block_size=BLOCK)
    requests = load_trace(args.trace, args.limit, args.max_input)
    largest = max(len(r.keys) for r in requests)
    if largest > args.capacity:
        raise SystemExit(f"--capacity {args.capacity} blocks cannot hold the largest request ({largest} blocks)")
    ideal = oracle(requests, cost)
    span = max(r.arrival for r in requests) or 1.0
    print(f"{len(requests)} requests over {span:.0f}s; oracle hit rate {ideal.hit_rate:.3f}; W* = {ideal.work_s:.0f}s "
          f"compute, largest request {max(ideal.works):.0f}s; capacity {args.capacity} blocks/replica; "
          f"cost model {asdict(cost)}")
    rows: list[RunResult] = []
    for n in args.replicas:
        scale = args.time_scale or ideal.work_s / (n * args.utilisation * span)
        for policy in args.policies:
            rows.append(simulate(requests, n, policy, cost, routing, args, scale, ideal, not args.no_progress))
    header = (f"{'N':>4}  {'policy':<12}{'tput/ideal':>11}{'online ref':>11}{'cache eff':>10}{'balance':>9}"
              f"{'hit':>7}{'hit/orc':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'util':>7}{'done':>7}{'scale':>8}")
    print(header, "-" * len(header), sep="\n")
    for r in rows:
        print(f"{r.replicas:>4}  {r.policy:<12}{r.throughput_vs_ideal:>11.3f}{r.online_reference:>11.3f}"
              f"{r.cache_efficiency:>10.3f}{r.balance:>9.3f}{r.hit_rate:>7.3f}{r.hit_rate_vs_oracle:>9.3f}"
              f"{r.ttft_p50_s:>10.1f}{r.ttft_p99_s:>10.1f}{r.utilisation:>7.2f}{r.completed:>7}{r.time_scale:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    payload = {
        "benchmark": "router_sim",
        "command": [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)],
        "args": vars(args),
        "trace": {"path": args.trace, "requests": len(requests), "span_s": span},
        "cost_model": asdict(cost),
        "routing": asdict(routing),
        "oracle": {"hit_rate": ideal.hit_rate, "work_s": ideal.work_s, "largest_request_s": max(ideal.works),
                   "ideal_per_replica_s": {n: ideal.ideal_per_replica(n) for n in args.replicas}},
        "results": [asdict(r) for r in rows],
    }
    payload["plot"] = plot(rows, os.path.splitext(args.out)[0] + ".png",
                           f"{os.path.basename(args.trace)}: {len(requests)} requests, capacity {args.capacity} "
                           f"blocks/replica, utilisation target {args.utilisation}")
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}" + (f" and {payload['plot']}" if payload["plot"] else ""))


if __name__ == "__main__":
    main()
