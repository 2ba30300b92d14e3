"""One replica as the router sees it: its health from /health probes, its load and cached block keys from its
reports (server/replica_api.py), and the requests the router has in flight there."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import httpx

from deepinfer.router.policy import ReplicaReport, ReplicaState
from deepinfer.server.replica_api import STATE_PATH, decode_keys

logger = logging.getLogger("deepinfer.router")

# STARTING: no answer yet; OK: in the rotation; UNREADY: answers 503 (loading, draining); DOWN: unreachable or
# failing its probes (requests in flight there are cut: retried, or ended with an error event); MISMATCH: serves
# another model or block size than the rest of its pool
HEALTH = ("starting", "ok", "unready", "down", "mismatch")
LOAD_FIELDS = ("queued_prefill_tokens", "queued_prefill_pairs", "running_requests", "running_context_tokens",
               "waiting_requests", "kv_usage")


class Replica:
    def __init__(self, url: str, role: str) -> None:
        self.url, self.role = url, role
        self.health = "starting"
        self.state = ReplicaState(replica_id=url, url=url, healthy=False)
        self.epoch: str | None = None  # the replica's key log, and the last event applied
        self.seq: int | None = None
        self.model_key: str | None = None
        self.block_size: int | None = None
        self.model_path: str | None = None
        self.prefix_queries = self.prefix_hits = 0  # the replica's own prefix-cache counters (tokens)
        self.snapshots = self.diffs = 0
        self.in_flight = 0
        self.failed_probes = 0
        self._down = asyncio.Event()  # set while DOWN: forwarders watch it to stop waiting on a lost replica

    @property
    def routable(self) -> bool:
        return self.health == "ok" and self.model_key is not None

    def routing_view(self, usable: bool) -> ReplicaState:
        """The state pick() sees: healthy only if routable and `usable` (not already tried for this request)."""
        return replace(self.state, healthy=self.routable and usable)

    async def wait_down(self) -> None:
        await self._down.wait()

    # ---- health ------------------------------------------------------------------------------------------------
    def mark_down(self, reason: str) -> None:
        """Out of the rotation; its cache is forgotten (a process that comes back starts empty, and one that only
        stalled sends a snapshot)."""
        if self.health != "down":
            logger.warning("replica %s is down: %s", self.url, reason)
        self.health = "down"
        self.state = ReplicaState(replica_id=self.url, url=self.url, healthy=False)
        self.epoch = self.seq = None
        self._down.set()

    def _mark(self, health: str, reason: str = "") -> None:
        if health != self.health:
            log = logger.info if health == "ok" else logger.warning
            log("replica %s: %s -> %s%s", self.url, self.health, health, f" ({reason})" if reason else "")
        self.health = health
        self._down.clear()

    async def probe(self, http: httpx.AsyncClient, timeout_s: float, failed_limit: int) -> None:
        """One /health probe. Refused or reset: down at once (the process is gone); timeouts: down after
        failed_limit in a row (a stalled process); 503: unready; 200: ok once the replica has reported its state."""
        try:
            answer = await http.get(f"{self.url}/health", timeout=timeout_s)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
            self.failed_probes = failed_limit
            if self.health != "starting":  # not up yet: it may still be binding its port
                self.mark_down(f"{type(e).__name__}: {e}")
            return
        except httpx.HTTPError as e:
            self.failed_probes += 1
            if self.failed_probes >= failed_limit:
                self.mark_down(f"{self.failed_probes} probes failed, the last with {type(e).__name__}")
            return
        self.failed_probes = 0
        if self.health == "mismatch":
            return
        if answer.status_code != 200:
            self._mark("unready", f"/health answered {answer.status_code}")
        else:
            self._mark("ok")  # routable once it has reported its state as well

    # ---- reports -----------------------------------------------------------------------------------------------
    async def refresh(self, http: httpx.AsyncClient, timeout_s: float) -> None:
        """Fetches and applies one state report: a diff since the last, or a snapshot."""
        params = {} if self.seq is None else {"since": self.seq, "epoch": self.epoch}
        answer = await http.get(f"{self.url}{STATE_PATH}", params=params, timeout=timeout_s)
        if answer.status_code == 503:
            return
        answer.raise_for_status()
        self.apply(answer.json())

    def apply(self, data: dict[str, Any]) -> None:
        snapshot = bool(data["snapshot"])
        if not snapshot and (data["epoch"] != self.epoch or self.seq is None):
            raise ValueError(f"replica {self.url} sent a diff for log {data['epoch']} after {self.epoch}")
        self.model_key, self.block_size = str(data["model_key"]), int(data["block_size"])
        self.model_path = data.get("model_path")
        load = data["load"]
        report = ReplicaReport(seq=self.state.seq + 1, **{name: load[name] for name in LOAD_FIELDS},
                               added=decode_keys(data["added"]), evicted=decode_keys(data["evicted"]),
                               snapshot=snapshot)
        self.state = self.state.apply(report)
        self.epoch, self.seq = str(data["epoch"]), int(data["seq"])
        self.prefix_queries, self.prefix_hits = int(data["prefix_cache"]["queries"]), int(data["prefix_cache"]["hits"])
        if snapshot:
            self.snapshots += 1
        else:
            self.diffs += 1

    def mismatch(self, reason: str) -> None:
        if self.health != "mismatch":
            logger.error("replica %s leaves the rotation: %s", self.url, reason)
        self.health = "mismatch"
        self._down.clear()

    def summary(self) -> dict[str, Any]:
        s = self.state
        return {"url": self.url, "role": self.role, "health": self.health, "in_flight": self.in_flight,
                "queued_prefill_tokens": s.queued_prefill_tokens, "running_requests": s.running_requests,
                "waiting_requests": s.waiting_requests, "kv_usage": s.kv_usage, "cached_blocks": len(s.blocks),
                "epoch": self.epoch, "seq": self.seq, "snapshots": self.snapshots, "diffs": self.diffs,
                "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                "model_key": self.model_key, "block_size": self.block_size}
