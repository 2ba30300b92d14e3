"""Per-request block tables on top of the block pool, with prefix-cache lookups."""
from __future__ import annotations

from deepinfer.core.block_pool import BlockPool
from deepinfer.core.prefix_cache import extend_block_keys, root_key
from deepinfer.core.request import Request


class KVCacheManager:
    """Full-attention KV: a request holds ceil(tokens / block_size) blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, model_key: str) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_key = model_key
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered in the cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def update_keys(self, request: Request) -> None:
        """Extends request.block_hashes over its full blocks (the KV store needs them even with caching off)."""
        root = root_key(self.model_key, request.params.cache_salt)
        extend_block_keys(request.block_hashes, root, request.all_token_ids, self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached blocks for a request's known tokens, leaving at least one token to compute."""
        if not self.enable_caching:
            return [], 0
        self.update_keys(request)
        hits: list[int] = []
        for block_hash in request.block_hashes[: self.max_reusable_blocks(request)]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def max_reusable_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size  # the last token must be computed for its logits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's prefix-cache lookup (a request that waits is counted once)."""
        if not self.enable_caching:
            return
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        have = len(self._blocks.get(request.request_id, ())) + num_cached_blocks
        total = request.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        needed = self.blocks_needed(request, num_new_tokens, len(cached))
        # Cached blocks sitting in the free queue stop being free once touched.
        free_after_touch = self.pool.num_free_blocks - sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return needed <= free_after_touch

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> list[int]:
        """Takes the cached prefix blocks (first scheduling) and new blocks for num_new_tokens; returns all added ids.

        Call before counting the cached tokens into request.num_computed_tokens.
        """
        needed = self.blocks_needed(request, num_new_tokens, len(cached))
        blocks = self._blocks.setdefault(request.request_id, [])
        added: list[int] = []
        if cached:
            self.pool.touch(list(cached))
            blocks.extend(cached)
            added.extend(cached)
            self._num_cached_blocks[request.request_id] = len(cached)
        new = self.pool.allocate(needed)
        blocks.extend(new)
        return added + new

    def blocks_filled_by(self, request: Request, num_new_tokens: int) -> list[tuple[bytes, int]]:
        """(key, block id) of each block that computing num_new_tokens more tokens makes full; call after allocate."""
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        if end <= first:
            return []
        self.update_keys(request)
        blocks = self._blocks[request.request_id]
        return [(request.block_hashes[i], blocks[i]) for i in range(first, end)]

    def cache_computed(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        self.update_keys(request)
        blocks = self._blocks.get(request.request_id, [])
        done = self._num_cached_blocks.get(request.request_id, 0)
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(done, full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(done, full)

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
