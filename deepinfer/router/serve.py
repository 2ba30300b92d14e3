"""`deepinfer router`: its config from the command line (options in router/args.py), run under uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable

import uvicorn

from deepinfer.router.config import PoolConfig, RouterConfig, load_cost_model, parse_replica
from deepinfer.router.proxy import build_router_app
from deepinfer.router.router import Router
from deepinfer.server.auth import DEFAULT_TENANT, Tenants, read_key_file

logger = logging.getLogger("deepinfer.router")


def router_config(args: argparse.Namespace, urls: list[str] | None = None) -> RouterConfig:
    """The config from `deepinfer router` options; `urls` replaces --replica (serve starts its own replicas)."""
    if urls is not None:
        specs = [("both", u) for u in urls]
    else:
        specs = [parse_replica(s) for s in args.replica] + [("prefill", u) for u in getattr(args, "prefill", [])] \
            + [("decode", u) for u in getattr(args, "decode", [])]
    if not specs:
        raise ValueError("give the replicas: --replica URL (repeat), or --prefill URL... --decode URL...")
    cost = load_cost_model(args.cost_model)
    roles = list(dict.fromkeys(role for role, _ in specs))
    pools = tuple(PoolConfig(role, tuple(u for r, u in specs if r == role), args.policy, cost=cost) for role in roles)
    keys = [(DEFAULT_TENANT, args.api_key)] if args.api_key else []
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    # the replicas take the router's keys too (serve --data-parallel-size gives both the same): any one of them
    # lets the router read their state
    replica_key = args.replica_api_key or (keys[0][1] if keys else None)
    return RouterConfig(pools=pools, model=args.model, poll_interval_s=args.poll_interval,
                        max_attempts=args.max_attempts, retry_wait_s=args.retry_wait, replica_api_key=replica_key,
                        api_keys=tuple(keys))


async def serve_router(config: RouterConfig, host: str, port: int, log_level: str = "warning",
                       beside: Callable[[Router], Awaitable[None]] | None = None) -> None:
    """Serves until SIGINT / SIGTERM. `beside(router)` runs alongside (a launcher's supervisor); if it returns or
    raises, the router stops too."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe and report
    router = Router(config)
    app = build_router_app(router, Tenants.from_keys(list(config.api_keys)))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                           timeout_graceful_shutdown=5))
    logger.info("router on http://%s:%d: %s", host, port,
                "; ".join(f"{p.role} pool ({p.policy}): {', '.join(p.urls)}" for p in config.pools))
    if beside is None:
        await server.serve()
        return
    task = asyncio.ensure_future(beside(router))
    task.add_done_callback(lambda _: setattr(server, "should_exit", True))
    try:
        await server.serve()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


def run_router(args: argparse.Namespace) -> int:
    config = router_config(args)
    asyncio.run(serve_router(config, args.host, args.port, args.uvicorn_log_level))
    return 0
