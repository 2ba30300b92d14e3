from __future__ import annotations

from .kvstore_helpers import FakeClock, chain, key, payload

from deepinfer.kvstore import KVStoreConfig, MemoryStore

BLOCK = 100
ENTRY = 16 + BLOCK  # the budget counts key and payload bytes


def test_lru_eviction_under_byte_budget() -> None:
    store = MemoryStore(KVStoreConfig(memory_bytes=3 * ENTRY))
    a, b, c, d = chain(4)
    for i, k in enumerate((a, b, c)):
        store.put(k, payload(i, BLOCK))
    assert store.used_bytes == 3 * ENTRY
    assert store.get(a) is not None  # a becomes most recently used; b is now the oldest
    store.put(d, payload(3, BLOCK))
    assert store.contains([b]) == 0
    assert store.contains([a]) == store.contains([c]) == store.contains([d]) == 1
    assert store.stats()["memory"].evictions == 1
    assert store.used_bytes == 3 * ENTRY


def test_contains_does_not_refresh_recency() -> None:
    store = MemoryStore(KVStoreConfig(memory_bytes=2 * ENTRY))
    a, b, c = chain(3)
    store.put(a, payload(0, BLOCK))
    store.put(b, payload(1, BLOCK))
    assert store.contains([a]) == 1
    store.put(c, payload(2, BLOCK))
    assert store.contains([a, b, c]) == 0
    assert store.contains([b, c]) == 2


def test_block_larger_than_budget_is_rejected() -> None:
    store = MemoryStore(KVStoreConfig(memory_bytes=ENTRY))
    store.put(key(0), payload(0, BLOCK))
    store.put(key(1), payload(1, BLOCK + 1))
    assert store.contains([key(0)]) == 1 and store.get(key(1)) is None
    assert store.stats()["memory"].rejected == 1


def test_ttl_with_injected_clock(clock: FakeClock) -> None:
    store = MemoryStore(KVStoreConfig(), clock=clock)
    store.put(key(0), b"agent", ttl_class="agent")  # 3 days
    store.put(key(1), b"chat")  # default class: 7 days
    clock.advance(3 * 86400 - 1)
    assert store.contains([key(0), key(1)]) == 2
    clock.advance(2)
    assert store.contains([key(0), key(1)]) == 0
    assert store.contains([key(1)]) == 1
    assert store.get(key(0)) is None
    assert store.get(key(1)) == b"chat"
    stats = store.stats()["memory"]
    assert (stats.expired, stats.misses, stats.hits) == (1, 1, 1)
    assert store.used_bytes == 16 + 4  # the expired block's bytes were released
