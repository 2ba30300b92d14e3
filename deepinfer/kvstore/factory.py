"""Builds the configured store; optional backends are imported only when configured."""
from __future__ import annotations

import time

from deepinfer.kvstore.base import Clock, KVStore, KVStoreConfig


def make_store(config: KVStoreConfig, clock: Clock = time.time) -> KVStore | None:
    """The tiers named by `config.kinds`, in that order; None when no kind is configured."""
    tiers: list[KVStore] = []
    for kind in config.kinds:
        if kind == "memory":
            from deepinfer.kvstore.memory import MemoryStore

            tiers.append(MemoryStore(config, clock))
        elif kind == "disk":
            from deepinfer.kvstore.disk import DiskStore

            tiers.append(DiskStore(config, clock))
        elif kind == "redis":
            from deepinfer.kvstore.redis_store import RedisStore

            tiers.append(RedisStore(config, clock))
        else:  # KVStoreConfig already rejects these; kept so a new kind cannot be silently ignored
            raise ValueError(f"unknown kvstore kind {kind!r}")
    if not tiers:
        return None
    if len(tiers) == 1:
        return tiers[0]
    from deepinfer.kvstore.tiered import TieredStore

    return TieredStore(tiers)
