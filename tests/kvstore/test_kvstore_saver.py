from __future__ import annotations

import threading
import time
from typing import Sequence

import pytest
from .kvstore_helpers import FakeClock, chain, key, payload

from deepinfer.kvstore import AsyncSaver, Entry, KVStoreConfig, KVStoreStats, MemoryStore
from deepinfer.kvstore.base import KVStore


class GatedStore(KVStore):
    """Every put waits for the gate: a store that is slower than the engine."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__(KVStoreConfig())
        self.gate = threading.Event()
        self.saved: list[bytes] = []

    def contains(self, keys: Sequence[bytes]) -> int:
        return 0

    def get_entry(self, key: bytes) -> Entry | None:
        return None

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        self.gate.wait()
        if payload == b"boom":
            raise RuntimeError("a buggy store")
        self.saved.append(key)

    def stats(self) -> KVStoreStats:
        return KVStoreStats(())


def test_saves_land_in_the_store(clock: FakeClock) -> None:
    store = MemoryStore(KVStoreConfig(), clock)
    saver = AsyncSaver(store)
    keys = chain(20)
    for i, k in enumerate(keys):
        assert saver.save(k, payload(i), ttl_class="agent")
    assert saver.flush(timeout=5)
    assert store.contains(keys) == 20
    clock.advance(3 * 86400 + 1)  # the ttl class travelled with the save
    assert store.contains(keys) == 0
    assert saver.stats().saved == 20
    saver.close()


def test_full_queue_drops_and_never_blocks() -> None:
    store = GatedStore()
    saver = AsyncSaver(store, queue_size=2)
    keys = chain(50)
    started = time.monotonic()
    accepted = [saver.save(k, b"kv") for k in keys]
    assert time.monotonic() - started < 0.5
    assert not saver.flush(timeout=0.05)  # the store is stuck
    # At most one in flight plus two queued were accepted; the rest were dropped.
    assert 2 <= sum(accepted) <= 3
    stats = saver.stats()
    assert stats.dropped == 50 - sum(accepted) and stats.pending == sum(accepted)
    store.gate.set()
    assert saver.flush(timeout=5)
    assert store.saved == [k for k, ok in zip(keys, accepted) if ok]
    saver.close()


def test_a_raising_store_does_not_kill_the_thread() -> None:
    store = GatedStore()
    store.gate.set()
    saver = AsyncSaver(store)
    saver.save(key(0), b"boom")
    saver.save(key(1), b"fine")
    assert saver.flush(timeout=5)
    assert (saver.stats().failed, saver.stats().saved) == (1, 1)
    assert store.saved == [key(1)]
    saver.close()


def test_close_finishes_queued_saves_then_refuses() -> None:
    store = MemoryStore(KVStoreConfig())
    saver = AsyncSaver(store)
    for i, k in enumerate(chain(10)):
        saver.save(k, payload(i))
    saver.close()
    assert store.contains(chain(10)) == 10
    assert not saver.save(key(99), b"late")
    assert saver.stats().dropped == 1


def test_unknown_ttl_class_raises_in_the_caller() -> None:
    saver = AsyncSaver(MemoryStore(KVStoreConfig()))
    with pytest.raises(ValueError, match="unknown ttl class"):
        saver.save(key(0), b"x", ttl_class="forever")
    saver.close()
