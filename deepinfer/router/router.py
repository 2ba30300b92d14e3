"""The router: one component holding a pool of replicas per role, keeping each replica's health and state current,
and choosing the replica for each request. Everything runs on one event loop, so nothing here takes a lock.

Per replica two loops run every poll_interval_s: a /health probe (a dead process leaves the rotation at the first
refused connection, a stalled one after failed_probes timeouts) and a state report (load and a diff of its cached
block keys; a snapshot after a gap or a restart), so the policy sees what each replica holds within about a second.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import httpx

from deepinfer.router.config import RouterConfig
from deepinfer.router.pool import Pool
from deepinfer.router.prompt import PromptReader
from deepinfer.router.replica import Replica

logger = logging.getLogger("deepinfer.router")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools = {p.role: Pool(p) for p in config.pools}
        self.prompts = PromptReader()
        headers = {"Authorization": f"Bearer {config.replica_api_key}"} if config.replica_api_key else {}
        # one client for probes and reports, one for forwarded requests: a burst of requests never delays a probe
        self.control = httpx.AsyncClient(headers=headers, timeout=config.state_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout_s), limits=limits)
        self._tasks: list[asyncio.Task] = []
        self.tokenizer_settled = False  # loaded, or failed to (then requests are routed by load alone)
        self._loops: dict[Replica, list[asyncio.Task]] = {}  # each replica's probe and state loops

    @property
    def replicas(self) -> list[Replica]:
        return [r for pool in self.pools.values() for r in pool.replicas]

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode pools: requests go through router/handoff.py."""
        return "prefill" in self.pools

    def pool_for(self, path: str) -> Pool:
        """The pool a request goes to first: `both`, or with disaggregation `prefill`."""
        return self.pools["prefill" if self.disaggregated else "both"]

    def any_replica(self, exclude: Collection[Replica] = ()) -> Replica | None:
        """A routable replica for requests with nothing to route on (models, tokenize): the least busy."""
        ready = [r for r in self.replicas if r.routable and r not in exclude]
        return min(ready, key=lambda r: (r.in_flight, r.state.queued_prefill_tokens), default=None)

    async def wait_routable(self, pool: Pool | None, exclude: Collection[Replica], timeout_s: float) -> bool:
        """Waits up to timeout_s for a routable replica of `pool` (any pool if None) not in `exclude`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not any(r.routable and r not in exclude for r in (pool.replicas if pool else self.replicas)):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    @property
    def healthy(self) -> bool:
        """Every pool that can serve a whole request (`both`, `decode`: without a prefill replica a decode replica
        computes the prompt itself) has a routable replica, and the tokenizer has settled (until then requests are
        routed by load alone: /health answers 503 meanwhile, so a deployment sends traffic once routing is
        cache-aware)."""
        whole = [p for role, p in self.pools.items() if role != "prefill"]
        return self.tokenizer_settled and all(any(r.routable for r in p.replicas) for p in whole)

    # ---- life cycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._load_tokenizer(), name="router-tokenizer")]
        for pool in self.pools.values():
            for r in pool.replicas:
                self._watch(pool, r)

    async def stop(self) -> None:
        tasks = self._tasks + [t for loops in self._loops.values() for t in loops]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.aclose()
        await self.control.aclose()

    async def _load_tokenizer(self) -> None:
        model = self.config.model
        while model is None:  # the path the first replica reports: the router runs beside it or on a shared mount
            model = next((r.model_path for r in self.replicas if r.model_path), None)
            if model is None:
                await asyncio.sleep(self.config.poll_interval_s)
        try:
            await asyncio.to_thread(self.prompts.load, model)
        except Exception:  # noqa: BLE001 - the router still routes, by load alone
            logger.exception("cannot load the tokenizer of %s: routing by load only; pass --model", model)
        finally:
            self.tokenizer_settled = True

    def replace_replica(self, old_url: str, new_url: str) -> None:
        """A replica moved (restarted elsewhere): the new address takes its place, with a fresh state."""
        for pool in self.pools.values():
            for i, old in enumerate(pool.replicas):
                if old.url == old_url:
                    for task in self._loops.pop(old, ()):
                        task.cancel()
                    old.mark_down(f"moved to {new_url}")  # requests in flight there are cut
                    pool.replicas[i] = Replica(new_url, pool.role)
                    self._watch(pool, pool.replicas[i])
                    return
        raise ValueError(f"no replica at {old_url}")

    def _watch(self, pool: Pool, replica: Replica) -> None:
        self._loops[replica] = [asyncio.create_task(self._probe_loop(replica), name=f"probe {replica.url}"),
                                asyncio.create_task(self._state_loop(pool, replica), name=f"state {replica.url}")]

    async def _probe_loop(self, replica: Replica) -> None:
        c = self.config
        while True:
            await replica.probe(self.control, c.probe_timeout_s, c.failed_probes)
            await asyncio.sleep(c.poll_interval_s)

    async def _state_loop(self, pool: Pool, replica: Replica) -> None:
        while True:
            try:
                await replica.refresh(self.control, self.config.state_timeout_s)
                if replica.model_key is not None:
                    pool.admit_report(replica)
            except httpx.TransportError:
                pass  # the probe loop decides about health
            except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as e:
                logger.warning("replica %s: bad state report (%s); asking for a snapshot", replica.url, e)
                replica.epoch = replica.seq = None
            await asyncio.sleep(self.config.poll_interval_s)

    def summary(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "tokenizer": self.prompts.model_path,
                "pools": {role: {"policy": p.config.policy, "model_key": p.model_key, "block_size": p.block_size,
                                 "routed": p.routed, "replicas": [r.summary() for r in p.replicas]}
                          for role, p in self.pools.items()}}
