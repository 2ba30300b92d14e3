"""The scheduler half of the KV store: which blocks beyond the device cache the store can fill, and counters.

The worker half (worker/kv_transfer.py) moves the bytes. Both halves share one store and one AsyncSaver;
the keys are the prefix cache's chained block keys, whose root holds `model_identity` and the
request's cache_salt, so a block computed by any engine serving the same model is found by every
other one, and never by another model, dtype or tenant.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from deepinfer.kvstore.base import Clock, KVStore, KVStoreConfig, TierStats
from deepinfer.kvstore.factory import make_store
from deepinfer.kvstore.identity import model_identity  # noqa: F401 - the engine builds its block-key root with it
from deepinfer.kvstore.saver import AsyncSaver, SaverStats

logger = logging.getLogger("deepinfer.kvstore")


@dataclass(frozen=True)
class KVStoreConnectorStats:
    """Cumulative. Token counts are whole blocks times the block size; `tiers` are the store's own counters."""

    block_size: int
    lookup_tokens: int  # prompt tokens of admitted requests: the denominator of every hit rate
    promised_tokens: int  # tokens the store held beyond the device cache at admission
    failed_blocks: int  # promised blocks that were missing or bad when loaded, and recomputed
    saves: SaverStats
    tiers: tuple[TierStats, ...]

    @property
    def loaded_tokens(self) -> int:
        return self.promised_tokens - self.failed_blocks * self.block_size

    def hit_tokens(self, tier: str) -> int:
        return next(t.hits for t in self.tiers if t.name == tier) * self.block_size

    def hit_rate(self, tier: str) -> float:
        """Share of looked-up prompt tokens loaded from `tier` (a block missed by a faster tier counts where it hit)."""
        return self.hit_tokens(tier) / self.lookup_tokens if self.lookup_tokens else 0.0


class KVStoreConnector:
    """Owns the store and its saver; the scheduler asks it how far a request's block chain continues."""

    def __init__(self, store: KVStore, saver: AsyncSaver, block_size: int) -> None:
        self.store = store
        self.saver = saver
        self.block_size = block_size
        self._lock = threading.Lock()  # stats() may be read from a server thread
        self._lookup_tokens = 0
        self._promised_blocks = 0
        self._failed_blocks = 0

    @classmethod
    def open(cls, config: KVStoreConfig, block_size: int, clock: Clock = time.time) -> KVStoreConnector | None:
        """The configured tiers with a saver; None when no tier is configured."""
        store = make_store(config, clock)
        return None if store is None else cls(store, AsyncSaver(store), block_size)

    def num_loadable(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds now (a later load may still miss)."""
        return self.store.contains(keys)

    def count_admitted(self, num_tokens: int, num_promised_blocks: int) -> None:
        with self._lock:
            self._lookup_tokens += num_tokens
            self._promised_blocks += num_promised_blocks

    def count_failed(self, num_blocks: int) -> None:
        logger.warning("KV store: %d promised block(s) missing or corrupt at load time; recomputing them", num_blocks)
        with self._lock:
            self._failed_blocks += num_blocks

    def stats(self) -> KVStoreConnectorStats:
        with self._lock:
            lookup, promised, failed = self._lookup_tokens, self._promised_blocks, self._failed_blocks
        return KVStoreConnectorStats(
            block_size=self.block_size,
            lookup_tokens=lookup,
            promised_tokens=promised * self.block_size,
            failed_blocks=failed,
            saves=self.saver.stats(),
            tiers=self.store.stats().tiers,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Waits for queued saves; False if `timeout` seconds passed first."""
        return self.saver.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finishes queued saves (up to `timeout` seconds), then closes the store."""
        self.saver.close(timeout)
        self.store.close()
