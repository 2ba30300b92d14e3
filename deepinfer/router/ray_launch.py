"""`deepinfer serve --ray --data-parallel-size N [--address HOST:PORT]`: the replicas as Ray actors across a
Ray cluster, the router in front of them in this process.

A placement group reserves one bundle per replica ({"CPU": --ray-cpus-per-replica, "GPU": ...}) with
--ray-placement (SPREAD by default: on different nodes where the cluster has room); each bundle holds one actor,
which starts a `deepinfer serve` process on its node's address and a free port (a Ray actor is a worker process,
not an HTTP server) and restarts it there if it fails. The router reaches each replica at that address, so the
nodes must reach each other on those ports. If an actor itself is lost (its node died), Ray restarts it in its
bundle, possibly elsewhere; the router follows its new address. Without --address a local Ray instance is started.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from deepinfer.router.launch import free_port, replica_args, start_replica, stop_processes

logger = logging.getLogger("deepinfer.router")

PLACEMENT_TIMEOUT_S = 120.0
WATCH_INTERVAL_S = 2.0


class ReplicaActor:
    """Runs one replica process on its node (the class is made a Ray actor in run_on_ray)."""

    def __init__(self, args: argparse.Namespace, threads: int) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        self.args = replica_args(args, host, free_port(host), threads)
        self.process = start_replica(self.args, None)
        self.restarts = 0

    def url(self) -> str:
        """The replica's address; starts its process again first if it failed (not if it drained and exited 0)."""
        code = self.process.poll()
        if code not in (None, 0):
            logger.warning("replica %s:%d exited with %s; restarting", self.args.host, self.args.port, code)
            self.restarts += 1
            self.process = start_replica(self.args, None)
        return f"http://{self.args.host}:{self.args.port}"

    def stop(self, timeout_s: float) -> None:
        stop_processes([self.process], timeout_s)


def _bundle(args: argparse.Namespace) -> dict[str, float]:
    gpus = args.ray_gpus_per_replica
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    return {"CPU": args.ray_cpus_per_replica, **({"GPU": gpus} if gpus else {})}


async def _watch(router, actors: list, urls: list[str]) -> None:
    """Keeps each actor's replica running and the router on its current address."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        for i, actor in enumerate(actors):
            try:
                url = await asyncio.wait_for(actor.url.remote(), 30)
            except Exception as e:  # noqa: BLE001 - an actor being restarted by Ray; the router routes around it
                logger.warning("replica actor %d does not answer: %s", i, e)
                continue
            if url != urls[i]:
                logger.warning("replica actor %d moved from %s to %s", i, urls[i], url)
                router.replace_replica(urls[i], url)
                urls[i] = url


def run_on_ray(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local cluster reports nothing anywhere
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deepinfer.router.launch import router_options
    from deepinfer.router.serve import router_config, serve_router

    ray.init(address=args.address, log_to_driver=True)
    n, bundle = args.data_parallel_size, _bundle(args)
    group = placement_group([bundle] * n, strategy=args.ray_placement)
    actors: list = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(f"the Ray cluster cannot place {n} bundles of {bundle} ({args.ray_placement}) within "
                             f"{PLACEMENT_TIMEOUT_S:.0f}s; it has {ray.available_resources()} available")
        remote = ray.remote(ReplicaActor)
        threads = max(1, int(args.ray_cpus_per_replica))
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
            actors.append(remote.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=-1,
                                         scheduling_strategy=strategy).remote(_actor_args(args), threads))
        urls = ray.get([a.url.remote() for a in actors], timeout=PLACEMENT_TIMEOUT_S)
        logger.info("%d replicas on Ray: %s", n, urls)
        config = router_config(router_options(args), urls)
        asyncio.run(serve_router(config, args.host, args.port, args.uvicorn_log_level,
                                 lambda router: _watch(router, actors, urls)))
    finally:
        if actors:
            ray.wait([a.stop.remote(args.drain_timeout + 5) for a in actors], num_returns=len(actors),
                     timeout=args.drain_timeout + 15)
            for a in actors:
                ray.kill(a)
        remove_placement_group(group)
        ray.shutdown()
    return 0


def _actor_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
