"""Command-line options of `deepinfer router` and of `deepinfer serve --data-parallel-size N [--ray]` (light
imports only: the parser is built before any command runs)."""
from __future__ import annotations

import argparse

from deepinfer.router.policy import POLICIES

PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


def add_router_args(parser: argparse.ArgumentParser, replicas: bool = True) -> None:
    """The router's options; `replicas`: whether the replica addresses are given (not when serve starts them)."""
    g = parser.add_argument_group("router")
    if replicas:
        g.add_argument("--replica", action="append", default=[], metavar="[ROLE=]URL",
                       help="a replica's address, e.g. http://10.0.0.5:8000; repeat for each. ROLE is its pool: "
                            "both (the default), prefill or decode")
        g.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                       help="disaggregated serving: replicas started with --role prefill (with --decode)")
        g.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                       help="disaggregated serving: replicas started with --role decode; a request is prefilled on "
                            "a --prefill replica, which hands its KV over, and decoded on one of these")
        g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        g.add_argument("--port", type=int, default=8000)
        g.add_argument("--model", default=None,
                       help="the served model, for its tokenizer; default: the path the replicas report")
        g.add_argument("--api-key", default=None, help="as for serve: require this key (tenant 'default')")
        g.add_argument("--api-key-file", default=None, metavar="PATH", help="as for serve: 'TENANT KEY' lines")
        g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--policy", default="cache_aware", choices=POLICIES, help="default %(default)s")
    g.add_argument("--cost-model", default=None, metavar="PATH",
                   help="JSON from benchmarks/calibrate_cost.py for the replicas' hardware (default: SmolLM2 on a "
                        "2-core CPU)")
    g.add_argument("--replica-api-key", default=None,
                   help="key the router sends replicas that require one (default: --api-key, else the first key "
                        "of --api-key-file)")
    g.add_argument("--poll-interval", type=float, default=0.5, help="seconds between probes and reports per replica")
    g.add_argument("--max-attempts", type=int, default=3, help="replicas tried per request before it streams")
    g.add_argument("--retry-wait", type=float, default=10.0, metavar="SECONDS",
                   help="a request lost on its replica waits this long for another to be in the rotation "
                        "(default %(default)s)")


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel (N replicas behind the router, which listens on --host/--port)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="replicas to start; above 1 (or with --ray) a router serves in front of them")
    g.add_argument("--ray", action="store_true", help="place the replicas as Ray actors across a Ray cluster")
    g.add_argument("--address", default=None,
                   help="with --ray: the cluster to join (e.g. 10.0.0.1:6379 or 'auto'); default: a local one")
    g.add_argument("--ray-placement", default="SPREAD", choices=PLACEMENT_STRATEGIES,
                   help="with --ray: placement group strategy over the replicas' bundles (default %(default)s)")
    g.add_argument("--ray-cpus-per-replica", type=float, default=1.0,
                   help="with --ray: CPUs each replica's bundle reserves (its torch threads unless --num-threads)")
    g.add_argument("--ray-gpus-per-replica", type=float, default=None,
                   help="with --ray: GPUs per replica (default 1 with --device cuda, else 0)")
    add_router_args(parser, replicas=False)


def check_data_parallel_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.address is not None and not args.ray:
        raise ValueError("--address names a Ray cluster: give it with --ray")
    if args.ray_cpus_per_replica <= 0:
        raise ValueError(f"--ray-cpus-per-replica must be > 0, got {args.ray_cpus_per_replica}")
