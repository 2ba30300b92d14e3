"""Host-RAM tier: an LRU map under a byte budget."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Sequence

from deepinfer.kvstore.base import Clock, Counters, Entry, KVStore, KVStoreConfig, KVStoreStats


class MemoryStore(KVStore):
    """Blocks live in this process only; the budget counts key and payload bytes."""

    name = "memory"

    def __init__(self, config: KVStoreConfig, clock: Clock = time.time) -> None:
        super().__init__(config, clock)
        self.capacity = config.memory_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._used = 0
        self._counters = Counters(self.name)

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, keys: Sequence[bytes]) -> int:
        now = self.clock()
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or entry.expires_at <= now:
                    return i
        return len(keys)

    def get_entry(self, key: bytes) -> Entry | None:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at <= now:
                self._remove(key)
                self._counters.add("expired")
                entry = None
            if entry is None:
                self._counters.add("misses")
                return None
            self._entries.move_to_end(key)
        self._counters.add("hits")
        self._counters.add("bytes_read", len(entry.payload))
        return entry

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        size = len(key) + len(payload)
        if size > self.capacity:
            self._counters.add("rejected")
            return
        with self._lock:
            self._remove(key)
            self._entries[key] = Entry(bytes(payload), expires_at)
            self._used += size
            while self._used > self.capacity:
                self._remove(next(iter(self._entries)))
                self._counters.add("evictions")
        self._counters.add("bytes_written", len(payload))

    def stats(self) -> KVStoreStats:
        return KVStoreStats((self._counters.snapshot(),))

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= len(key) + len(entry.payload)
