"""The KVStore contract, checked on every tier and on a tiered stack."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest
from .kvstore_helpers import chain, key, payload

from deepinfer.kvstore import KVStore, KVStoreConfig, make_store


@pytest.fixture(params=["memory", "disk", "redis", "memory+disk+redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    kinds = tuple(request.param.split("+"))
    redis_url = request.getfixturevalue("redis_server").url if "redis" in kinds else None
    config = KVStoreConfig(kinds=kinds, disk_path=str(tmp_path / "kv"), redis_url=redis_url)
    built = make_store(config)
    assert built is not None
    yield built
    built.close()


def test_put_get_roundtrip(store: KVStore) -> None:
    assert store.get(key(0)) is None
    store.put(key(0), payload(0, 1000))
    store.put(key(1), b"")
    assert store.get(key(0)) == payload(0, 1000)
    assert store.get(key(1)) == b""
    store.put(key(0), payload(7, 10))  # a later save replaces the block
    assert store.get(key(0)) == payload(7, 10)


def test_contains_is_the_longest_present_prefix(store: KVStore) -> None:
    keys = chain(6)
    assert store.contains([]) == 0
    assert store.contains(keys) == 0
    for i in (0, 1, 2, 4, 5):  # a gap at 3
        store.put(keys[i], payload(i))
    assert store.contains(keys) == 3
    assert store.contains(keys[4:]) == 2
    store.put(keys[3], payload(3))
    assert store.contains(keys) == 6


def test_stats_count_hits_misses_and_bytes(store: KVStore) -> None:
    store.put(key(0), payload(0, 300))
    store.get(key(0))
    store.get(key(1))
    last = store.stats().tiers[-1]
    assert last.bytes_written == 300
    first = store.stats().tiers[0]
    assert (first.hits, first.bytes_read) == (1, 300)
    assert sum(t.misses for t in store.stats().tiers) >= 1
    assert all(t.errors == 0 for t in store.stats().tiers)


def test_unknown_ttl_class_is_a_caller_error(store: KVStore) -> None:
    with pytest.raises(ValueError, match="unknown ttl class"):
        store.put(key(0), b"x", ttl_class="forever")


def test_concurrent_readers_and_writers(store: KVStore) -> None:
    keys = chain(40)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(40):
                k = keys[(i + offset) % 40]
                store.put(k, payload(i, 200))
                store.get(k)
                store.contains(keys)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n * 10,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.contains(keys) == 40
    assert all(t.errors == 0 for t in store.stats().tiers)
