"""Fixed-size KV blocks with reference counts, an LRU free queue and the prefix-cache index."""
from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable


@dataclass
class BlockPoolStats:
    num_blocks: int
    num_free: int
    num_cached: int
    evictions: int


@dataclass(frozen=True)
class KeyEvents:
    """How the cache index changed since event `since` of log `epoch`: the keys added and the keys evicted (a key's
    last event decides), or every key held now (`snapshot`: no `since` was given, the log no longer holds the events
    after it, or `epoch` names another log, e.g. before the engine restarted). `seq`: ask for events since it next."""

    epoch: str
    seq: int
    added: tuple[bytes, ...]
    evicted: tuple[bytes, ...] = ()
    snapshot: bool = False

    def only(self, keep: Callable[[bytes], bool]) -> KeyEvents:
        return KeyEvents(self.epoch, self.seq, tuple(filter(keep, self.added)), tuple(filter(keep, self.evicted)),
                         self.snapshot)


class KeyEventLog:
    """The last `capacity` changes of a cache index, numbered from 1, so a router can follow the index by diffs."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"key event log capacity must be >= 1, got {capacity}")
        self.epoch = secrets.token_hex(8)  # a fresh log (a restarted engine) is never mistaken for the old one
        self.seq = 0
        self._events: deque[tuple[bytes, bool]] = deque(maxlen=capacity)

    def record(self, key: bytes, added: bool) -> None:
        self.seq += 1
        self._events.append((key, added))

    def since(self, seq: int | None, epoch: str | None, held: Callable[[], Iterable[bytes]]) -> KeyEvents:
        first = self.seq - len(self._events)  # the log holds events first+1 .. self.seq
        if seq is None or epoch != self.epoch or not first <= seq <= self.seq:
            return KeyEvents(self.epoch, self.seq, tuple(held()), snapshot=True)
        last: dict[bytes, bool] = {}
        for key, added in islice(self._events, seq - first, None):
            last[key] = added
        return KeyEvents(self.epoch, self.seq, tuple(k for k, a in last.items() if a),
                         tuple(k for k, a in last.items() if not a))


class BlockPool:
    """Owns block ids 0..num_blocks-1.

    A block with ref_count 0 sits in the free queue, oldest first. If it holds a
    cached full block (it has a hash) it stays findable through `lookup` until it
    is handed out again, which evicts it: unreferenced cached blocks are evicted
    only when memory is needed, least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._evictions = 0
        self.peak_in_use = 0  # most blocks referenced at once
        # twice the blocks: a router polling every ~0.5 s never falls behind unless the whole cache turns over twice
        self.key_log = KeyEventLog(max(4096, 2 * num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref[block_id] = 1
            ids.append(block_id)
        self.peak_in_use = max(self.peak_in_use, self.num_blocks - len(self._free))
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Takes a reference on cached blocks found by `lookup`."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1
        self.peak_in_use = max(self.peak_in_use, self.num_blocks - len(self._free))

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference each; pass a request's blocks tail first so its tail is evicted first."""
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Marks a full, computed block as holding the tokens behind `block_hash`; False if it was not registered
        (caching off, the block already holds a key, or another block holds the same content)."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return False
        if block_hash in self._cached:  # same content computed twice: keep the first copy
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        self.key_log.record(block_hash, True)
        return True

    def uncache(self, block_id: int, block_hash: bytes) -> None:
        """Drops a block from the cache index if it still holds `block_hash`; its references are untouched."""
        if self._hash[block_id] == block_hash:
            self._hash[block_id] = None
            del self._cached[block_hash]
            self.key_log.record(block_hash, False)

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether the block is still indexed under `block_hash` (not evicted and handed out again)."""
        return self._hash[block_id] == block_hash

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def reset_cache(self) -> None:
        for block_hash, block_id in self._cached.items():
            self._hash[block_id] = None
            self.key_log.record(block_hash, False)
        self._cached.clear()

    def key_events(self, since: int | None, epoch: str | None) -> KeyEvents:
        """The cache index's changes since event `since` of log `epoch`, or a snapshot of it (KeyEvents)."""
        return self.key_log.since(since, epoch, self._cached.keys)

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached), self._evictions)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash[block_id] = None
            self._evictions += 1
            self.key_log.record(block_hash, False)
