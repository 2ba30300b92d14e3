"""The KV store contract: config, counters and the abstract store every tier implements."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Mapping, Self, Sequence

KINDS = ("memory", "disk", "redis")

Clock = Callable[[], float]  # seconds since the epoch; expiry times are on this clock


@dataclass(frozen=True)
class KVStoreConfig:
    """Which external tiers hold KV blocks beyond the device cache, fastest first.

    `ttl_classes` pairs a class name with a lifetime in seconds; a block saved
    under a class expires that long after its (last) save.
    """

    kinds: tuple[str, ...] = ()  # subset and order of KINDS; () = no store
    memory_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_bytes: int = 16 << 30  # capacity; least recently used blocks are evicted over it
    redis_url: str | None = None
    ttl_classes: tuple[tuple[str, float], ...] = (("agent", 3 * 86400.0), ("chatbot", 7 * 86400.0))
    default_ttl_class: str = "chatbot"
    save_queue_size: int = 256

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"kvstore kinds must be among {KINDS}, got {unknown}")
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kvstore kinds must not repeat, got {self.kinds}")
        if "disk" in self.kinds and not self.disk_path:
            raise ValueError("kvstore kind 'disk' needs disk_path")
        if "redis" in self.kinds and not self.redis_url:
            raise ValueError("kvstore kind 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0, got {self.memory_bytes}")
        if self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be > 0, got {self.disk_bytes}")
        names = [name for name, _ in self.ttl_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"ttl class names must not repeat, got {names}")
        bad = [(name, ttl) for name, ttl in self.ttl_classes if not ttl > 0]
        if bad:
            raise ValueError(f"ttl seconds must be > 0, got {bad}")
        if self.default_ttl_class not in names:
            raise ValueError(f"default_ttl_class {self.default_ttl_class!r} is not among the ttl classes {names}")
        if self.save_queue_size < 1:
            raise ValueError(f"save_queue_size must be >= 1, got {self.save_queue_size}")

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    @property
    def ttl_seconds(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self.ttl_classes))

    def ttl_for(self, ttl_class: str | None) -> float:
        """Lifetime in seconds of a block saved under `ttl_class` (None: the default class)."""
        name = self.default_ttl_class if ttl_class is None else ttl_class
        for candidate, ttl in self.ttl_classes:
            if candidate == name:
                return ttl
        raise ValueError(f"unknown ttl class {name!r}; expected one of {[n for n, _ in self.ttl_classes]}")


@dataclass(frozen=True)
class TierStats:
    """Cumulative counters of one tier since it was opened. Byte counts are payload bytes."""

    name: str
    hits: int = 0
    misses: int = 0  # includes expired, corrupt and unreadable lookups
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    expired: int = 0
    rejected: int = 0  # puts skipped because one block exceeds the tier's whole capacity
    corrupt: int = 0
    io_errors: int = 0
    connection_errors: int = 0

    @property
    def errors(self) -> int:
        return self.corrupt + self.io_errors + self.connection_errors


@dataclass(frozen=True)
class KVStoreStats:
    tiers: tuple[TierStats, ...]

    def __getitem__(self, name: str) -> TierStats:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")


class Counters:
    """Thread-safe mutable counters behind a TierStats snapshot (the saver thread and the engine share a store)."""

    _NAMES = tuple(f.name for f in fields(TierStats) if f.name != "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._NAMES, 0)

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._values[counter] += n

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(name=self.name, **self._values)


@dataclass(frozen=True)
class Entry:
    payload: bytes
    expires_at: float  # on the store's clock


class KVStore(ABC):
    """A map from block key (the prefix cache's chained hash) to an opaque KV payload.

    Every method is thread-safe. Store faults (missing, expired or corrupt
    blocks, I/O errors, a lost connection) never raise: a lookup reports a miss,
    a save is dropped, and the reason is counted in `stats()`. Programming errors
    (an unknown ttl class) do raise ValueError. A block that `contains` reports
    may still miss on `get` (evicted or deleted in between, possibly by another
    engine sharing the store): callers must recompute on a miss.
    """

    name: str = "store"

    def __init__(self, config: KVStoreConfig, clock: Clock = time.time) -> None:
        self.config = config
        self.clock = clock

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of `keys` that are all present and unexpired. Does not touch recency."""

    @abstractmethod
    def get_entry(self, key: bytes) -> Entry | None:
        """The block and its expiry time, or None (miss, expired, corrupt, unreadable)."""

    @abstractmethod
    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        """Stores the block until `expires_at` (on this store's clock), replacing any earlier copy."""

    @abstractmethod
    def stats(self) -> KVStoreStats: ...

    def close(self) -> None:
        """Releases connections and files; the store must not be used afterwards."""

    def get(self, key: bytes) -> bytes | None:
        entry = self.get_entry(key)
        return None if entry is None else entry.payload

    def put(self, key: bytes, payload: bytes, ttl_class: str | None = None) -> None:
        self.put_entry(key, payload, self.clock() + self.config.ttl_for(ttl_class))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
