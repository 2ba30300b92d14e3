"""EPLB simulator: moe_lb of expert placements under synthetic, drifting MoE routing at DeepInfer's EP64 scale.

No model: token routing is sampled.

Scale (flags, all echoed in the JSON): `--ranks` 64 EP ranks, `--experts` 384 routed experts, `--redundant` 64
redundant slots (448 slots, 7 per rank), top-`--top-k` 8 experts per token, `--layers` 61 MoE layers,
`--tokens-per-rank` 256 tokens per rank per step (16,384 tokens per layer per step).

Routing. In each layer expert e has popularity w_e = zipf_e * exp(sigma * x_e): zipf_e = r^-skew for its place r in
a random permutation per layer (`--skew`), and x_e an Ornstein-Uhlenbeck walk, stationary N(0, 1), with correlation
time `--drift` steps (`--drift-sigma` = sigma; drift 0: x = 0, no drift). Every expert's popularity thus wanders
around its Zipf base at the same relative speed: RMS change of log w over 1000 steps = sigma * sqrt(2 (1 -
exp(-1000 / drift))), 16% at the defaults. A token takes `--top-k` distinct experts: draws from w, a repeat drawn
again (sampling without replacement, as a top-k over noisy router logits gives).

Time. `--steps` steps on one clock for drift and rebalancing. Tokens are sampled on every `--sample-every`-th step
only (16,384 x 8 choices x 61 layers per step is what costs); the tracker (EMA, half-life `--half-life` steps)
records those steps, so it sees 1 step in 20 where an engine sees every step: its estimates are noisier than a real
tracker's (8 layers, 1200 steps: "every 10" gave 1.052 with every step recorded, 1.059 with 1 in 20). moe_lb is averaged
over the sampled steps after `--warmup` steps, when the balancing policies first place experts. A placement applies
from the step it is computed (moving expert weights is free here) and is measured on steps the tracker has not seen.

Policies, all measured on the same sampled counts; tokens reach replicas by `eplb.route`'s rule (an expert's tokens
split evenly over its replicas), loads by `eplb.rank_loads`:
- round-robin: no balancing, no redundancy (384 slots, 6 per rank), expert e on rank e mod 64;
- static: `balanced_placement` once, from the tracker at the end of warm-up;
- every N: `balanced_placement` from the tracker every N steps (`--intervals`);
- hierarchical: `hierarchical_placement` over `--nodes` nodes, experts in `--hier-groups` contiguous groups, every
  `--hier-interval` steps (routing here is not group-limited, so this shows what the node constraint costs);
- hindsight (main scenario only): `balanced_placement` from the measured step's own counts. Unattainable (it knows the
  step's tokens before routing them): the floor for any placement fixed before the step;
- every N + load-aware split (main scenario only, what-if): the smallest interval's placement, but each replicated
  expert's tokens split over its replicas by water-filling on this step's rank loads (`load_aware_rank_loads`)
  instead of `eplb.route`'s even split; this attacks the sampling noise that no placement can;
- noise floor: uniform popularity, round-robin, a placement perfect for the expected load: what is left is the
  sampling noise of 256 tokens per rank.

Then the skew x drift sweep (`--sweep-skews`, `--sweep-drifts`) on `--sweep-layers` layers (layers are independent
and alike: fewer layers change the worst-layer figure, not the mean), and the time one placement takes at full scale.

    python benchmarks/eplb_sim.py                                # defaults + sweep: 100 s CPU, 3 min on 2 shared cores
    python benchmarks/eplb_sim.py --steps 1200 --sweep-skews ''   # main scenario only, shorter
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from deepinfer.distributed.eplb import (  # noqa: E402
    ExpertLoadTracker,
    Placement,
    TrackerConfig,
    balanced_placement,
    hierarchical_placement,
    moe_lb,
    rank_loads,
    round_robin_placement,
)

DEEPSEEK_MOE_LB = 1.090  # DeepSeek's reported figure, the reference line
GOAL = 1.05


@dataclass(frozen=True)
class Scenario:
    skew: float
    drift: float
    layers: int
    main: bool = False  # the main scenario also runs hindsight
    floor: bool = False  # the noise-floor run: round-robin only, `--floor-steps` sampled steps


class Routing:
    """Per-layer expert popularity (a Zipf base times a drifting factor) and token sampling."""

    def __init__(self, args: argparse.Namespace, skew: float, drift: float, layers: int) -> None:
        self.args, self.drift, self.layers, self.experts = args, drift, layers, args.experts
        self.popularity_rng = np.random.default_rng([args.seed, 0])
        self.token_rng = np.random.default_rng([args.seed, 1])
        zipf = np.arange(1, self.experts + 1, dtype=np.float64) ** -skew
        self.log_base = np.log(np.stack([zipf[self.popularity_rng.permutation(self.experts)] for _ in range(layers)]))
        self.walk = self.popularity_rng.standard_normal((layers, self.experts)) if drift else np.zeros((layers, 1))
        self._build_tables()

    def advance(self, steps: int) -> None:
        """The walk is an Ornstein-Uhlenbeck process per expert, stationary N(0, 1), correlation time `drift` steps;
        advancing several steps at once is exact."""
        if self.drift and steps:
            rho = np.exp(-steps / self.drift)
            noise = self.popularity_rng.standard_normal(self.walk.shape)
            self.walk = rho * self.walk + np.sqrt(1 - rho * rho) * noise
            self._build_tables()

    def weights(self) -> np.ndarray:
        """log w = log zipf[permuted rank] + sigma * walk: each expert's popularity wanders around its Zipf base by a
        log-normal factor (sigma `--drift-sigma`), every expert at the same relative speed."""
        return np.exp(self.log_base + self.args.drift_sigma * self.walk)

    def _build_tables(self) -> None:
        """Walker's alias tables, one per layer: draw u in [0, E), take e = floor(u); keep e if u < e + keep[e],
        otherwise take alias[e]. Stored as threshold = e + keep[e], so a draw is one comparison. float32: keep[e] is
        resolved to ~3e-5, a relative error below 0.2% on the rarest expert's probability at skew 1."""
        weights = self.weights()
        scaled = weights / weights.sum(axis=1, keepdims=True) * self.experts
        self.threshold = np.empty(scaled.shape, dtype=np.float32)
        self.alias = np.empty(scaled.shape, dtype=np.int16)
        for layer, q in enumerate(scaled):
            q = q.copy()
            keep, alias = np.ones(self.experts), np.arange(self.experts)
            small = [e for e in range(self.experts) if q[e] < 1.0]
            large = [e for e in range(self.experts) if q[e] >= 1.0]
            while small and large:
                s, g = small.pop(), large.pop()
                keep[s], alias[s] = q[s], g
                q[g] -= 1.0 - q[s]
                (small if q[g] < 1.0 else large).append(g)
            self.threshold[layer] = np.arange(self.experts) + keep
            self.alias[layer] = alias

    def _draw(self, layer: int, rows: int, columns: int) -> np.ndarray:
        u = self.token_rng.random((rows, columns), dtype=np.float32)
        u *= self.experts
        e = u.astype(np.intp)  # np.take converts narrower indices to intp anyway, slowly
        np.minimum(e, self.experts - 1, out=e)
        keep = u < np.take(self.threshold[layer], e)
        alias = np.take(self.alias[layer], e)
        return alias + (e.astype(np.int16) - alias) * keep  # np.where on a random mask is 30x slower

    def sample_counts(self, tokens: int) -> np.ndarray:
        """[layers, experts] int64: how many of `tokens` tokens chose each expert (top-k distinct per token)."""
        k = self.args.top_k
        counts = np.zeros((self.layers, self.experts), dtype=np.int64)
        for layer in range(self.layers):
            draws = self._draw(layer, k + 2, tokens)  # [draws, tokens]; a token takes its first k distinct draws
            while True:
                taken = np.empty(draws.shape, dtype=bool)
                have = np.zeros(draws.shape[1], dtype=np.int8)
                for j, x in enumerate(draws):
                    new = have < k
                    for i in range(j):
                        new &= draws[i] != x
                    taken[j] = new
                    have += new
                done = have == k
                counts[layer] += np.bincount(draws[taken & done], minlength=self.experts)
                if done.all():
                    break
                # the few tokens still short of k distinct experts start over with more draws
                draws = np.concatenate([draws[:, ~done], self._draw(layer, k + 2, int((~done).sum()))])
        return counts


def load_aware_rank_loads(counts: np.ndarray, placement: Placement, sweeps: int = 3) -> np.ndarray:
    """What-if, not in eplb.py: split each replicated expert's tokens of this step over its replicas by water-filling
    (replicas on less-loaded ranks take more; Gauss-Seidel over the experts, `sweeps` passes), instead of `route`'s
    even split. An engine would need every rank's counts before dispatch (an all-gather of [layers, experts] per
    step). Fractional tokens; rounding moves at most one token per slot."""
    ranks, per_rank = placement.num_ranks, placement.slots_per_rank
    rank_of_slot = np.arange(placement.num_slots) // per_rank
    loads = np.empty((placement.num_layers, ranks))
    for layer, row in enumerate(placement.slot_to_expert):
        replicas = placement.replica_counts[layer]
        share = counts[layer][row] / replicas[row]
        load = np.bincount(rank_of_slot, weights=share, minlength=ranks)
        groups = [np.flatnonzero(row == e) for e in np.flatnonzero(replicas > 1)]
        for _ in range(sweeps):
            for slots in groups:
                where = rank_of_slot[slots]
                base = load[where] - share[slots]
                total = share[slots].sum()
                # the water level: the largest n with level_n = (total + sum of the n lowest bases) / n >= n-th base
                lowest = np.sort(base)
                levels = (total + np.cumsum(lowest)) / np.arange(1, len(lowest) + 1)
                level = levels[np.flatnonzero(levels >= lowest)[-1]]
                new = np.maximum(0.0, level - base)
                load[where] += new - share[slots]
                share[slots] = new
        loads[layer] = load
    return loads


@dataclass
class PolicyResult:
    policy: str
    interval: int | None  # steps between placements; None: placed once (or never)
    moe_lb_mean: float  # mean over measured steps of the mean over layers
    moe_lb_worst: float  # mean over measured steps of the worst layer
    moe_lb_worst_max: float  # the worst layer of the worst step
    placements: int
    placement_seconds: float  # mean time of one placement computation (all layers)


def simulate(args: argparse.Namespace, scenario: Scenario, progress: bool, position: int) -> dict[str, Any]:
    routing = Routing(args, scenario.skew, scenario.drift, scenario.layers)
    layers, experts, ranks = scenario.layers, args.experts, args.ranks
    slots = experts + args.redundant
    tokens = args.tokens_per_rank * ranks
    tracker = ExpertLoadTracker(TrackerConfig(layers, experts, decay=0.5 ** (args.sample_every / args.half_life)))

    def global_policy(loads: np.ndarray) -> Placement:
        return balanced_placement(loads, slots, ranks)

    def hierarchical(groups: int) -> Callable[[np.ndarray], Placement]:
        return lambda loads: hierarchical_placement(loads, slots, ranks, args.nodes, groups)

    # name -> (interval: None = once at warm-up, 0 = never; how to compute it from the tracker's loads)
    policies: dict[str, tuple[int | None, Callable[[np.ndarray], Placement] | None]] = {"round-robin": (0, None)}
    if not scenario.floor:
        policies["static"] = (None, global_policy)
        policies.update({f"every {n}": (n, global_policy) for n in args.intervals})
        policies.update({f"hierarchical {args.nodes}x{ranks // args.nodes}, {g} groups": (args.hier_interval,
                                                                                          hierarchical(g))
                         for g in args.hier_groups})
    placement = {name: round_robin_placement(layers, experts, ranks) for name in policies}
    timings: dict[str, list[float]] = {name: [] for name in policies}
    per_step: dict[str, list[tuple[float, float]]] = {name: [] for name in policies}
    what_if = f"every {min(args.intervals)} + load-aware split (what-if)"
    if scenario.main:
        for name in ("hindsight", what_if):
            timings[name], per_step[name] = [], []

    warmup = 0 if scenario.floor else args.warmup
    steps = warmup + args.floor_steps * args.sample_every if scenario.floor else args.steps
    last_sampled = 0
    label = f"skew {scenario.skew:g} drift {scenario.drift:g} L{layers}" + (" (noise floor)" if scenario.floor else "")
    for step in tqdm(range(steps), desc=label, unit="step", disable=not progress, position=position, leave=False,
                     mininterval=1.0):
        if step >= warmup and not scenario.floor:
            for name, (interval, compute) in policies.items():
                due = step == warmup if interval is None else interval and (step - warmup) % interval == 0
                if compute is not None and due:
                    started = time.perf_counter()
                    placement[name] = compute(tracker.loads)
                    timings[name].append(time.perf_counter() - started)
        if step % args.sample_every:
            continue
        routing.advance(step - last_sampled)  # popularity is only observed on sampled steps
        last_sampled = step
        counts = routing.sample_counts(tokens)
        if step >= warmup:
            for name, p in placement.items():
                lb = moe_lb(rank_loads(counts, p))
                per_step[name].append((lb.mean, lb.worst))
            if scenario.main:
                started = time.perf_counter()
                p = global_policy(counts)
                timings["hindsight"].append(time.perf_counter() - started)
                lb = moe_lb(rank_loads(counts, p))
                per_step["hindsight"].append((lb.mean, lb.worst))
                lb = moe_lb(load_aware_rank_loads(counts, placement[f"every {min(args.intervals)}"]))
                per_step[what_if].append((lb.mean, lb.worst))
        tracker.record(counts)

    intervals = {name: interval for name, (interval, _) in policies.items()} | {what_if: min(args.intervals)}
    rows = []
    for name, values in per_step.items():
        means, worsts = zip(*values)
        rows.append(PolicyResult(
            policy="noise floor (uniform, round-robin)" if scenario.floor else name,
            interval=intervals.get(name) or None, moe_lb_mean=statistics.fmean(means),
            moe_lb_worst=statistics.fmean(worsts), moe_lb_worst_max=max(worsts), placements=len(timings[name]),
            placement_seconds=statistics.fmean(timings[name]) if timings[name] else 0.0))
    return {"scenario": asdict(scenario), "measured_steps": len(per_step["round-robin"]),
            "results": [asdict(r) for r in rows]}


def time_rebalance(args: argparse.Namespace, repeats: int = 5) -> dict[str, Any]:
    """Seconds for one placement at full scale, from Zipf loads (the main scenario's skew), median of `repeats`."""
    rng = np.random.default_rng(args.seed)
    zipf = np.arange(1, args.experts + 1, dtype=np.float64) ** -args.skew
    loads = np.stack([zipf[rng.permutation(args.experts)] for _ in range(args.layers)]) * 1e4
    slots = args.experts + args.redundant
    policies = {"balanced (global)": lambda: balanced_placement(loads, slots, args.ranks)}
    for g in args.hier_groups:
        policies[f"hierarchical, {g} groups"] = lambda g=g: hierarchical_placement(loads, slots, args.ranks,
                                                                                    args.nodes, g)
    timings = {}
    for name, run in policies.items():
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        timings[name] = {"median_s": statistics.median(seconds), "min_s": min(seconds)}
    return {"layers": args.layers, "slots": slots, "ranks": args.ranks, "repeats": repeats, "policies": timings}


def plot(main: dict[str, Any], floor: dict[str, Any], sweep: list[dict[str, Any]], args: argparse.Namespace,
         path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    never = 10 * max(args.intervals)  # where "static" sits on the interval axis

    def curve(run: dict[str, Any]) -> tuple[list[int], list[float]]:
        by_name = {r["policy"]: r for r in run["results"]}
        xs = [n for n in args.intervals] + [never]
        ys = [by_name[f"every {n}"]["moe_lb_mean"] for n in args.intervals] + [by_name["static"]["moe_lb_mean"]]
        return xs, ys

    fig, ax = plt.subplots(figsize=(8, 5.5))
    drifts = sorted({run["scenario"]["drift"] for run in sweep})
    skews = sorted({run["scenario"]["skew"] for run in sweep})
    for run in sweep:  # colour: drift, marker: skew
        s = run["scenario"]
        ax.plot(*curve(run), "--", marker="os^dv"[skews.index(s["skew"]) % 5], lw=1, alpha=0.7,
                color=f"C{drifts.index(s['drift'])}",
                label=f"skew {s['skew']:g}, drift {s['drift']:g} ({s['layers']} layers)")
    s = main["scenario"]
    ax.plot(*curve(main), "o-", lw=2.5, color="black",
            label=f"main: skew {s['skew']:g}, drift {s['drift']:g} ({s['layers']} layers)")
    by_name = {r["policy"]: r for r in main["results"]}
    for name, style in (("hindsight", ":"), (f"every {min(args.intervals)} + load-aware split (what-if)", "-")):
        if name in by_name:
            ax.axhline(by_name[name]["moe_lb_mean"], color="tab:green", ls=style, lw=1, label=f"main: {name}")
    ax.axhline(floor["results"][0]["moe_lb_mean"], color="tab:purple", ls=":", lw=1,
               label="noise floor (uniform load, round-robin)")
    ax.axhline(DEEPSEEK_MOE_LB, color="tab:red", ls="--", label=f"DeepSeek reported {DEEPSEEK_MOE_LB}")
    ax.axhline(GOAL, color="gray", ls="-.", label=f"goal {GOAL}")
    ax.set_xscale("log")
    ax.set_xticks(args.intervals + [never], [str(n) for n in args.intervals] + ["static"])
    ax.set_xlabel("steps between rebalances")
    ax.set_ylabel("moe_lb (max rank load / mean, mean over layers)")
    ax.set_title(f"EPLB: EP{args.ranks}, {args.experts} experts + {args.redundant} redundant, top-{args.top_k}, "
                 f"{args.tokens_per_rank} tokens/rank/step")
    ax.legend(fontsize=6.5, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def drift_rate(sigma: float, drift: float) -> float:
    """RMS change of log-popularity over 1000 steps."""
    return sigma * float(np.sqrt(2 * (1 - np.exp(-1000 / drift)))) if drift else 0.0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64, help="EP ranks")
    parser.add_argument("--experts", type=int, default=384, help="routed experts per layer")
    parser.add_argument("--redundant", type=int, default=64, help="redundant slots per layer (64: one per rank)")
    parser.add_argument("--top-k", type=int, default=8, help="distinct experts per token")
    parser.add_argument("--layers", type=int, default=61, help="MoE layers (main scenario)")
    parser.add_argument("--tokens-per-rank", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of expert popularity (main)")
    parser.add_argument("--drift", type=float, default=20000,
                        help="correlation time of the popularity walk, in steps; 0: no drift (main)")
    parser.add_argument("--drift-sigma", type=float, default=0.5, help="the walk's amplitude in log-popularity")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--sample-every", type=int, default=20, help="tokens are sampled on every N-th step")
    parser.add_argument("--warmup", type=int, default=200, help="steps before the first placement")
    parser.add_argument("--half-life", type=float, default=25, help="the load tracker's EMA half-life, in steps")
    parser.add_argument("--intervals", type=_ints, default=[10, 100, 1000], help="rebalancing intervals, steps")
    parser.add_argument("--nodes", type=int, default=8, help="nodes for the hierarchical policy")
    parser.add_argument("--hier-groups", type=_ints, default=[8, 32], help="expert groups for the hierarchical policy")
    parser.add_argument("--hier-interval", type=int, default=100, help="hierarchical policy's rebalancing interval")
    parser.add_argument("--floor-steps", type=int, default=30, help="sampled steps of the noise-floor run")
    parser.add_argument("--sweep-skews", type=_floats, default=[0.3, 0.5, 0.8])
    parser.add_argument("--sweep-drifts", type=_floats, default=[0.0, 20000, 2000])
    parser.add_argument("--sweep-layers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=min(2, len(os.sched_getaffinity(0))), help="processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "eplb_sim.json"), help="the PNG goes beside it")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args(argv)
    if args.experts % args.ranks or (args.experts + args.redundant) % args.ranks:
        parser.error(f"--experts ({args.experts}) and --experts + --redundant ({args.experts + args.redundant}) "
                     f"must be multiples of --ranks ({args.ranks})")
    if args.sample_every <= 0 or args.warmup % args.sample_every:
        parser.error("--warmup must be a multiple of --sample-every, and both step counts positive")
    return args


def _run(job: tuple[argparse.Namespace, Scenario, bool, int]) -> dict[str, Any]:
    return simulate(*job)


def print_tables(main: dict[str, Any], floor: dict[str, Any], sweep: list[dict[str, Any]],
                 timing: dict[str, Any], args: argparse.Namespace) -> None:
    s = main["scenario"]
    print(f"\nEP{args.ranks}: {args.experts} experts + {args.redundant} redundant slots "
          f"({(args.experts + args.redundant) // args.ranks} per rank), top-{args.top_k}, {s['layers']} layers, "
          f"{args.tokens_per_rank} tokens/rank/step; skew {s['skew']:g}, drift time {s['drift']:g} steps, sigma "
          f"{args.drift_sigma:g} ({drift_rate(args.drift_sigma, s['drift']):.0%} per 1000 steps); "
          f"{args.steps} steps, sampled every {args.sample_every} "
          f"({main['measured_steps']} measured after {args.warmup} warm-up); EMA half-life {args.half_life:g} steps")
    print(f"{'policy':<40} {'interval':>8} {'moe_lb mean':>11} {'worst layer':>11} {'worst max':>9} "
          f"{'placements':>10} {'s/placement':>11}")
    for r in main["results"] + floor["results"]:
        interval = "-" if r["interval"] is None else str(r["interval"])
        print(f"{r['policy']:<40} {interval:>8} {r['moe_lb_mean']:>11.4f} {r['moe_lb_worst']:>11.4f} "
              f"{r['moe_lb_worst_max']:>9.4f} {r['placements']:>10} {r['placement_seconds']:>11.3f}")
    if sweep:
        names = [r["policy"] for r in sweep[0]["results"]]
        short = [n.replace("hierarchical ", "hier ").replace(f"{args.nodes}x{args.ranks // args.nodes}, ", "")
                 for n in names]
        print(f"\nsweep, {args.sweep_layers} layers, moe_lb mean over layers (worst layer in the JSON); drift: "
              f"correlation time in steps, /1000: RMS change of log-popularity per 1000 steps")
        print(f"{'skew':>5} {'drift':>6} {'/1000':>6} " + " ".join(f"{n:>16}" for n in short))
        for run in sweep:
            by_name = {r["policy"]: r for r in run["results"]}
            skew, drift = run["scenario"]["skew"], run["scenario"]["drift"]
            print(f"{skew:>5g} {drift:>6g} {drift_rate(args.drift_sigma, drift):>6.0%} "
                  + " ".join(f"{by_name[n]['moe_lb_mean']:>16.4f}" for n in names))
    print(f"\none placement at {timing['layers']} layers x {timing['slots']} slots onto {timing['ranks']} ranks "
          f"(median of {timing['repeats']}):")
    for name, t in timing["policies"].items():
        print(f"  {name:<28} {t['median_s'] * 1e3:8.1f} ms (min {t['min_s'] * 1e3:.1f} ms)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    main_scenario = Scenario(args.skew, args.drift, args.layers, main=True)
    floor_scenario = Scenario(0.0, 0.0, args.layers, floor=True)
    sweep_scenarios = [Scenario(skew, drift, args.sweep_layers) for skew in args.sweep_skews
                       for drift in args.sweep_drifts]
    progress = not args.no_progress
    jobs = [(args, main_scenario, progress, 1), (args, floor_scenario, False, 0)]
    jobs += [(args, s, False, 0) for s in sweep_scenarios]
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        runs = list(tqdm(pool.map(_run, jobs), total=len(jobs), desc="scenarios", unit="scenario",
                         disable=not progress, position=0))
    main_run, floor_run, sweep_runs = runs[0], runs[1], runs[2:]
    timing = time_rebalance(args)
    print_tables(main_run, floor_run, sweep_runs, timing, args)

    png = plot(main_run, floor_run, sweep_runs, args, os.path.splitext(args.out)[0] + ".png")
    report = {
        "benchmark": "eplb_sim", "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "args": vars(args), "machine": machine_info(threads=1),
        "definitions": {
            "moe_lb": "per MoE layer: max over ranks of the tokens a rank's slots receive / mean over ranks; "
                      "'mean' averages layers, 'worst' is the worst layer; both averaged over measured steps",
            "popularity": "w_e = zipf_e * exp(drift_sigma * x_e); zipf_e = r^-skew, r the expert's place in a "
                          "random permutation per layer",
            "drift": "x_e: Ornstein-Uhlenbeck, stationary N(0, 1), correlation time `drift` steps (0: x = 0)",
            "drift_rms_log_change_per_1000_steps": drift_rate(args.drift_sigma, args.drift),
            "tokens": "each token draws top_k distinct experts from w (repeats redrawn)",
            "tracker": "EMA of sampled counts, decay 0.5 ** (sample_every / half_life) per record",
            "replica_routing": "an expert's tokens split evenly over its replicas (eplb.route)",
        },
        "deepseek_reported_moe_lb": DEEPSEEK_MOE_LB, "goal": GOAL,
        "main": main_run, "noise_floor": floor_run, "sweep": sweep_runs, "rebalance_timing": timing,
        "wall_s": time.perf_counter() - started, "plot": png,
    }
    write_json(report, args.out)
    print(f"\nwrote {args.out}" + (f" and {png}" if png else "") + f" in {report['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
