"""A stack of tiers, fastest first: reads fall through and promote, writes go through to every tier."""
from __future__ import annotations

from typing import Sequence

from deepinfer.kvstore.base import Entry, KVStore, KVStoreStats


class TieredStore(KVStore):
    """Per-tier counters stay separate in `stats()`: a memory miss then disk hit counts in both tiers."""

    name = "tiered"

    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        super().__init__(tiers[0].config, tiers[0].clock)
        self.tiers = tuple(tiers)

    def contains(self, keys: Sequence[bytes]) -> int:
        # Key i counts if any tier holds it. Each round, the tier reaching furthest from the
        # current position vouches for that whole run; stop when no tier holds the next key.
        done = 0
        while done < len(keys):
            rest = keys[done:]
            step = max(tier.contains(rest) for tier in self.tiers)
            if step == 0:
                break
            done += step
        return done

    def get_entry(self, key: bytes) -> Entry | None:
        for level, tier in enumerate(self.tiers):
            entry = tier.get_entry(key)
            if entry is not None:
                for faster in self.tiers[:level]:
                    faster.put_entry(key, entry.payload, entry.expires_at)
                return entry
        return None

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        for tier in self.tiers:
            tier.put_entry(key, payload, expires_at)

    def stats(self) -> KVStoreStats:
        return KVStoreStats(tuple(t for tier in self.tiers for t in tier.stats().tiers))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
