"""Fixed-size KV blocks with reference counts, an LRU free queue and the prefix-cache index."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class BlockPoolStats:
    num_blocks: int
    num_free: int
    num_cached: int
    evictions: int


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
        return True

    def uncache(self, block_id: int, block_hash: bytes) -> None:
        """Drops a block from the cache index if it still holds `block_hash`; its references are untouched."""
        if self._hash[block_id] == block_hash:
            self._hash[block_id] = None
            del self._cached[block_hash]

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether the block is still indexed under `block_hash` (not evicted and handed out again)."""
        return self._hash[block_id] == block_hash

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def reset_cache(self) -> None:
        for block_id in list(self._cached.values()):
            self._hash[block_id] = None
        self._cached.clear()

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached), self._evictions)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash[block_id] = None
            self._evictions += 1
