from __future__ import annotations

from pathlib import Path

from .kvstore_helpers import FakeClock, chain, key, payload

from deepinfer.kvstore import DiskStore, KVStoreConfig, MemoryStore, TieredStore

BLOCK = 100


def stack(tmp_path: Path, clock: FakeClock, memory_blocks: int = 8) -> tuple[TieredStore, MemoryStore, DiskStore]:
    config = KVStoreConfig(kinds=("memory", "disk"), memory_bytes=memory_blocks * (16 + BLOCK), disk_path=str(tmp_path))
    memory, disk = MemoryStore(config, clock), DiskStore(config, clock)
    return TieredStore([memory, disk]), memory, disk


def test_put_writes_through_every_tier(tmp_path: Path, clock: FakeClock) -> None:
    store, memory, disk = stack(tmp_path, clock)
    store.put(key(0), payload(0, BLOCK))
    assert memory.contains([key(0)]) == disk.contains([key(0)]) == 1


def test_get_falls_through_and_promotes(tmp_path: Path, clock: FakeClock) -> None:
    store, memory, _ = stack(tmp_path, clock, memory_blocks=2)
    keys = chain(3)
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    assert memory.contains(keys[:1]) == 0  # evicted from memory, still on disk
    assert store.get(keys[0]) == payload(0, BLOCK)
    assert memory.contains(keys[:1]) == 1  # promoted
    assert store.get(keys[0]) == payload(0, BLOCK)
    stats = store.stats()
    assert (stats["memory"].hits, stats["memory"].misses) == (1, 1)
    assert (stats["disk"].hits, stats["disk"].misses) == (1, 0)


def test_promotion_keeps_the_original_expiry(tmp_path: Path, clock: FakeClock) -> None:
    store, memory, disk = stack(tmp_path, clock)
    disk.put(key(0), b"agent", ttl_class="agent")
    clock.advance(86400)
    assert store.get(key(0)) == b"agent"
    clock.advance(2 * 86400 + 1)  # three days after the save, not after the promotion
    assert memory.contains([key(0)]) == 0
    assert store.get(key(0)) is None


def test_contains_combines_tiers_key_by_key(tmp_path: Path, clock: FakeClock) -> None:
    store, memory, disk = stack(tmp_path, clock)
    keys = chain(6)
    memory.put(keys[0], b"0")
    disk.put(keys[1], b"1")
    memory.put(keys[2], b"2")
    disk.put(keys[2], b"2")
    disk.put(keys[3], b"3")
    memory.put(keys[5], b"5")
    assert memory.contains(keys) == 1 and disk.contains(keys) == 0
    assert store.contains(keys) == 4
    assert store.contains(keys[1:]) == 3
    assert store.contains(keys[4:]) == 0


def test_a_dead_lower_tier_does_not_hide_the_others(tmp_path: Path, clock: FakeClock, redis_server) -> None:
    from deepinfer.kvstore.redis_store import RedisStore

    config = KVStoreConfig(kinds=("disk", "redis"), disk_path=str(tmp_path), redis_url=redis_server.url)
    store = TieredStore([DiskStore(config, clock), RedisStore(config, clock, retry_after=0.2)])
    store.put(key(0), b"block")
    redis_server.stop()
    store.put(key(1), b"disk only")
    assert store.contains([key(0), key(1)]) == 2
    assert store.get(key(1)) == b"disk only"
    assert store.stats()["redis"].connection_errors >= 1
    store.close()
