"""Per-request block tables (one per layer group) on top of the shared block pool, with prefix-cache lookups.

Full-attention groups hold a block for every token. Sliding-window groups (window W) release a block once no
later query can see it, so a running sequence holds at most ceil(W / block_size) + 1 of them per group. A cached
prefix of h tokens is usable when every full group has [0, h) and every sliding group has [h - W, h); the hit is
the largest such h, and the tokens between it and the longest full-attention match are recomputed ("replayed").
In `compact` mode a sequence's sliding-window blocks leave the cache index unless they lie in the last
`keep_tokens` positions of its prompt or of everything it computed, so the cache holds two bounded tails per
sequence: one for a repeated prompt, one for a conversation that continues; in `full` mode they stay cached until
evicted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from deepinfer.core.block_pool import BlockPool, KeyEvents
from deepinfer.core.kv_layout import NULL_BLOCK, SWA_MODES, KVGroup, KVLayout, default_keep_tokens
from deepinfer.core.prefix_cache import DIGEST_SIZE, extend_block_keys, root_key
from deepinfer.core.request import Request


LOAD = -2  # a hit entry the KV store holds: a new block is allocated for it and filled before the forward


@dataclass(frozen=True)
class PrefixHit:
    """Per group, the first num_tokens // block_size table entries: a device block id, NULL_BLOCK, or LOAD."""

    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int  # device-cached and store-loaded tokens together
    replayed_tokens: int = 0  # full-attention match beyond the hit, recomputed because sliding KV was dropped
    num_loaded_blocks: int = 0  # LOAD entries in group 0 (the store's share of num_tokens)

    @property
    def num_new_blocks(self) -> int:
        return sum(b == LOAD for blocks in self.blocks for b in blocks)


@dataclass(frozen=True)
class ReplayStats:
    hits: int  # admitted requests whose hit was shortened by missing sliding-window KV
    replayed_tokens: int
    max_replayed_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, model_key: str,
                 layout: KVLayout | None = None, swa_mode: str = "compact", keep_tokens: int | None = None,
                 rollback_margin: int = 0) -> None:
        if swa_mode not in SWA_MODES:
            raise ValueError(f"sliding-window prefix mode must be one of {SWA_MODES}, got {swa_mode!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_key = model_key
        self.layout = layout or KVLayout((KVGroup(None, ()),))
        self.windows = [g.sliding_window for g in self.layout.groups]
        self.swa_mode = swa_mode
        windows = [w for w in self.windows if w is not None]
        self.keep_tokens = keep_tokens if keep_tokens is not None else (
            default_keep_tokens(max(windows), block_size, rollback_margin) if windows else None)
        if self.keep_tokens is not None and windows and self.keep_tokens < max(windows):
            raise ValueError(f"keep_tokens={self.keep_tokens} is shorter than the sliding window {max(windows)}")
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[list[int]]] = {}
        self._released: dict[str, list[int]] = {}  # per sliding group: leading table entries already released
        self._own_swa: dict[str, list[deque[tuple[int, int, bytes]]]] = {}  # (index, block, key) this request cached
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered in the cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found
        self._replay = [0, 0, 0]  # hits, tokens, max

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._tables.get(request_id)
        return tables[group] if tables else []

    def held_blocks(self, request_id: str, group: int) -> int:
        return sum(b != NULL_BLOCK for b in self.block_ids(request_id, group))

    def replay_stats(self) -> ReplayStats:
        return ReplayStats(*self._replay)

    def key_events(self, since: int | None, epoch: str | None = None) -> KeyEvents:
        """The first layer group's cached block keys, added and evicted since event `since` of log `epoch` (or a
        snapshot): the request's own key chain, which a router matches. Other groups' keys are left out; with sliding
        windows a key held there can still give a shorter hit (find_cached_prefix)."""
        return self.pool.key_events(since, epoch).only(lambda key: len(key) == DIGEST_SIZE)  # _key(h, 0) is h

    def update_keys(self, request: Request) -> None:
        """Extends request.block_hashes over its full blocks (the KV store needs them even with caching off)."""
        if len(request.block_hashes) >= request.num_tokens // self.block_size:
            return  # no block filled since: most decode steps (no root key, no copy of the tokens)
        root = root_key(self.model_key, request.params.cache_salt)
        extend_block_keys(request.block_hashes, root, request.all_token_ids, self.block_size)

    def store_keys(self, request: Request) -> list[bytes]:
        """Every layer group's store key for each reusable full block of the request (what a lookup may ask)."""
        self.update_keys(request)
        hashes = request.block_hashes[: self.max_reusable_blocks(request)]
        return [self._key(h, g) for g in range(len(self.windows)) for h in hashes]

    def _key(self, block_hash: bytes, group: int) -> bytes:
        return block_hash if group == 0 else block_hash + bytes([group])

    # ---- lookups -----------------------------------------------------------------------------------------------
    def no_hit(self) -> PrefixHit:
        return PrefixHit(tuple(() for _ in self.windows), 0)

    def find_cached_prefix(self, request: Request, store: Callable[[list[bytes]], int] | None = None) -> PrefixHit:
        """Longest usable cached prefix of a request's known tokens, leaving at least one token to compute.

        `store(keys)` says how many leading keys the KV store holds; blocks found only there become LOAD entries.
        """
        if not self.enable_caching and store is None:
            return self.no_hit()
        self.update_keys(request)
        hashes = request.block_hashes[: self.max_reusable_blocks(request)]
        found: list[list[int | None]] = [[self.pool.lookup(self._key(h, g)) for h in hashes]
                                         for g in range(len(self.windows))]
        match = len(hashes)
        for g, window in enumerate(self.windows):
            if window is not None:
                continue
            device = next((i for i, b in enumerate(found[g]) if b is None), len(hashes))
            stored = store([self._key(h, g) for h in hashes[device:]]) if store and device < len(hashes) else 0
            found[g][device : device + stored] = [LOAD] * stored
            match = min(match, device + stored)
        if store is not None:  # sliding blocks: the store is asked per block, only where a window needs one
            for g, window in enumerate(self.windows):
                if window is not None:
                    found[g] = _LazyStore(found[g], [self._key(h, g) for h in hashes], store)
        hit = self._swa_hit_point(found, match)
        blocks = []
        for g, window in enumerate(self.windows):
            first = 0 if window is None else max(0, hit * self.block_size - window) // self.block_size
            blocks.append((NULL_BLOCK,) * first + tuple(found[g][i] for i in range(first, hit)))
        bs = self.block_size
        return PrefixHit(tuple(blocks), hit * bs, (match - hit) * bs, sum(b == LOAD for b in blocks[0]))

    def _swa_hit_point(self, found, match: int) -> int:
        """Largest h <= match (in blocks) whose sliding window [h*bs - W, h*bs) is cached in every sliding group.
        Scans each window from its top; a missing block j rules out every h > j, so each block is asked once."""
        h = match
        while h > 0:
            missing = None
            for g, window in enumerate(self.windows):
                if window is None:
                    continue
                first = max(0, h * self.block_size - window) // self.block_size
                missing = next((j for j in range(h - 1, first - 1, -1) if found[g][j] is None), None)
                if missing is not None:
                    break
            if missing is None:
                return h
            h = missing
        return 0

    def max_reusable_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size  # the last token must be computed for its logits

    def count_lookup(self, num_tokens: int, hit: PrefixHit) -> None:
        """Counts one admitted request's prefix-cache lookup (a request that waits is counted once)."""
        if not self.enable_caching:
            return
        self.prefix_queries += num_tokens
        self.prefix_hits += hit.num_tokens - hit.num_loaded_blocks * self.block_size
        if hit.replayed_tokens:
            self._replay[0] += 1
            self._replay[1] += hit.replayed_tokens
            self._replay[2] = max(self._replay[2], hit.replayed_tokens)

    # ---- allocation ----------------------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        tables = self._tables.get(request.request_id)
        cached = hit.num_tokens if hit else 0
        want = -(-(request.num_computed_tokens + cached + num_new_tokens) // self.block_size)
        have = [len(t) for t in tables] if tables else [len(b) for b in hit.blocks] if hit else [0] * len(self.windows)
        return sum(max(0, want - n) for n in have) + (hit.num_new_blocks if hit and not tables else 0)

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        needed = self.blocks_needed(request, num_new_tokens, hit)
        if hit is None:
            return needed <= self.pool.num_free_blocks
        touched = {b for blocks in hit.blocks for b in blocks if b >= 0}
        # Cached blocks sitting in the free queue stop being free once touched.
        return needed <= self.pool.num_free_blocks - sum(1 for b in touched if self.pool.ref_count(b) == 0)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[list[int]]:
        """Takes the hit's blocks (first scheduling) and new blocks for num_new_tokens; returns the entries added to
        each group's table (NULL_BLOCK shown as block 0, whose finite contents attention masks out).

        Call before counting the hit's tokens into request.num_computed_tokens.
        """
        rid = request.request_id
        want = -(-(request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens) // self.block_size)
        if rid not in self._tables:
            self._tables[rid] = [[] for _ in self.windows]
            self._released[rid] = [0] * len(self.windows)
            self._own_swa[rid] = [deque() for _ in self.windows]
        tables = self._tables[rid]
        added: list[list[int]] = []
        for g, table in enumerate(tables):
            start = len(table)
            if hit is not None and hit.blocks[g]:
                cached = list(hit.blocks[g])
                self.pool.touch([b for b in cached if b >= 0])
                fresh = iter(self.pool.allocate(sum(b == LOAD for b in cached)))
                table.extend(next(fresh) if b == LOAD else b for b in cached)
                self._released[rid][g] = next((i for i, b in enumerate(cached) if b != NULL_BLOCK), len(cached))
            table.extend(self.pool.allocate(max(0, want - len(table))))
            added.append([max(b, 0) for b in table[start:]])
        if hit is not None:  # device hits are registered already; loaded blocks are registered once computed
            self._num_cached_blocks[rid] = min((blocks.index(LOAD) for blocks in hit.blocks if LOAD in blocks),
                                               default=hit.num_tokens // self.block_size)
        return added

    def load_targets(self, request: Request, hit: PrefixHit) -> list[tuple[bytes, int]]:
        """(store key, block id) of the hit's LOAD entries, group 0 in chain order first; call after allocate."""
        tables = self._tables[request.request_id]
        return [(self._key(request.block_hashes[i], g), tables[g][i])
                for g, blocks in enumerate(hit.blocks) for i, b in enumerate(blocks) if b == LOAD]

    def blocks_filled_by(self, request: Request, num_new_tokens: int) -> list[tuple[bytes, int]]:
        """(store key, block id) of each block that computing num_new_tokens more tokens makes full and the store
        should keep; call after allocate. In compact mode a sliding block is kept now only in the prompt's tail;
        the tail of everything computed is saved at the end (`tail_blocks`)."""
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        if end <= first:
            return []
        self.update_keys(request)
        out = []
        for g, table in enumerate(self._tables[request.request_id]):
            window = self.windows[g]
            for i in range(first, end):
                if table[i] == NULL_BLOCK:
                    continue
                if window is None or self.swa_mode == "full" or self._in_prompt_tail(request, i):
                    out.append((self._key(request.block_hashes[i], g), table[i]))
        return out

    def tail_blocks(self, request: Request) -> list[tuple[bytes, int]]:
        """Compact mode, at the end of a request: (store key, block id) of the sliding blocks in the last keep_tokens
        positions of what it computed that still hold their data and were not saved with the prompt's tail."""
        tables = self._tables.get(request.request_id)
        if tables is None or self.swa_mode != "compact" or not self.layout.is_hybrid:
            return []
        self.update_keys(request)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = max(0, request.num_computed_tokens - self.keep_tokens) // self.block_size
        out = []
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            released = {i: b for i, b, key in self._own_swa[request.request_id][g] if self.pool.holds(b, key)}
            for i in range(start, end):
                block = tables[g][i] if tables[g][i] != NULL_BLOCK else released.get(i)
                if block is not None and not self._in_prompt_tail(request, i):
                    out.append((self._key(request.block_hashes[i], g), block))
        return out

    def _in_prompt_tail(self, request: Request, index: int) -> bool:
        p = request.num_prompt_tokens
        return (index + 1) * self.block_size > p - self.keep_tokens and index * self.block_size < p

    # ---- after a step ----------------------------------------------------------------------------------------------
    def cache_computed(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache, then drops what sliding-window layers
        no longer need: blocks no later query sees are released; in compact mode, the request's own cached blocks
        outside the last keep_tokens positions of its prompt and of its computed tokens leave the cache index."""
        rid = request.request_id
        tables = self._tables.get(rid)
        if tables is None:
            return
        computed = request.num_computed_tokens
        if self.enable_caching:
            self.update_keys(request)
            done = self._num_cached_blocks.get(rid, 0)
            full = min(computed // self.block_size, len(request.block_hashes), len(tables[0]))
            for i in range(done, full):
                for g, table in enumerate(tables):
                    if table[i] == NULL_BLOCK:
                        continue
                    key = self._key(request.block_hashes[i], g)
                    if self.pool.cache(table[i], key) and self.windows[g] is not None:
                        self._own_swa[rid][g].append((i, table[i], key))
            self._num_cached_blocks[rid] = max(done, full)
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            if self.swa_mode == "compact" and self.enable_caching:
                own = self._own_swa[rid][g]
                while own and (own[0][0] + 1) * self.block_size <= computed - self.keep_tokens:
                    index, block_id, key = own.popleft()
                    if not self._in_prompt_tail(request, index):  # that tail stays, for a repeated prompt
                        self.pool.uncache(block_id, key)
            # the next query is at position `computed` and sees keys after computed - window
            unseen = max(0, computed - window + 1) // self.block_size
            table, released = tables[g], self._released[rid][g]
            if unseen > released:
                self.pool.free([b for b in reversed(table[released:unseen]) if b != NULL_BLOCK])
                table[released:unseen] = [NULL_BLOCK] * (unseen - released)
                self._released[rid][g] = unseen

    def free(self, request: Request) -> None:
        rid = request.request_id
        tables = self._tables.pop(rid, None)
        self._released.pop(rid, None)
        self._own_swa.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        for table in tables or ():
            self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])


class _LazyStore:
    """A sliding group's hit entries: the device block where cached, else LOAD if the store holds the key (asked
    once per block, on first use), else None."""

    def __init__(self, device: list[int | None], keys: list[bytes], store: Callable[[list[bytes]], int]) -> None:
        self._device, self._keys, self._store = device, keys, store
        self._asked: dict[int, int | None] = {}

    def __getitem__(self, i: int) -> int | None:
        if self._device[i] is not None:
            return self._device[i]
        if i not in self._asked:
            self._asked[i] = LOAD if self._store([self._keys[i]]) else None
        return self._asked[i]
