"""Hand-off counters, as EngineStats.handoff carries them (cumulative since start-up)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
BYTES_BOUNDS = tuple(m * 10**e for e in range(3, 11) for m in (1, 2, 5))  # 1 kB to 50 GB


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bound, observations <= it (cumulative), as Prometheus buckets
    count: int = 0
    total: float = 0.0


class Buckets:
    """A thread-safe histogram under construction; snapshot() freezes it."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * len(bounds)
        self._count, self._total = 0, 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._count += 1
            self._total += value
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1

    def snapshot(self) -> Histogram:
        with self._lock:
            return Histogram(self.bounds, tuple(self._counts), self._count, self._total)


@dataclass(frozen=True)
class HandoffStats:
    role: str  # "prefill" or "decode"
    path: str  # prefill: how it hands KV over ("direct" or "store")
    # prefill side: hand-offs answered, and how each ended
    offered: int = 0
    pulled: int = 0  # read by a decode engine (direct)
    released: int = 0  # let go by a decode engine that needed none of it (its first token ended the request)
    expired: int = 0  # released by the timeout, never pulled
    held_blocks: int = 0  # held now
    sent_bytes: Histogram | None = None  # per hand-off: bytes served (direct) or saved to the store (store)
    offer_seconds: float = 0.0  # making hand-offs ready after their prefill, summed (the store path waits for saves)
    # decode side
    remote_requests: int = 0  # requests that arrived with a hand-off
    received: int = 0  # ... whose prompt KV arrived whole
    fallbacks: int = 0  # ... that computed (part of) the prompt themselves: KV missing, late, corrupt, other tokens
    received_bytes: int = 0  # pulled (direct)
    transfer_seconds: float = 0.0  # pulls in flight, summed: received_bytes / transfer_seconds is the throughput
    latency: Histogram | None = None  # arrival at this engine -> prompt KV in its cache (or given up)
