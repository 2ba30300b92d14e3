"""The KV store connector end to end without a model: scheduler half, worker half, one shared store."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import pytest
import torch

from deepinfer.kvstore import DiskStore, Entry, KVStoreConfig, KVStoreStats, MemoryStore
from deepinfer.kvstore.base import KVStore

from .connector_helpers import BS, TinyEngine
from .kvstore_helpers import FakeClock

PROMPT = list(range(100, 123))  # 23 tokens: 5 full blocks, the last token is in block 5


class FlakyStore(KVStore):
    """A memory store whose `get` misses the keys in `lose` (deleted or corrupt after `contains` said yes)."""

    name = "flaky"

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.inner = MemoryStore(KVStoreConfig(), clock or FakeClock())
        super().__init__(self.inner.config, self.inner.clock)
        self.lose: set[bytes] = set()
        self.replace: dict[bytes, bytes] = {}

    def contains(self, keys: Sequence[bytes]) -> int:
        return self.inner.contains(keys)

    def get_entry(self, key: bytes) -> Entry | None:
        entry = None if key in self.lose else self.inner.get_entry(key)
        if entry is not None and key in self.replace:
            entry = Entry(self.replace[key], entry.expires_at)
        return entry

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        self.inner.put_entry(key, payload, expires_at)

    def stats(self) -> KVStoreStats:
        return self.inner.stats()


def warm(store: KVStore, prompt: list[int] = PROMPT, **params) -> list[int]:
    """Runs the prompt on a cold engine and waits until its blocks are in the store."""
    engine = TinyEngine(store)
    out = engine.generate("warm", prompt, **params)
    assert engine.connector.flush(timeout=5)
    engine.close()
    return out


def test_fresh_engine_loads_store_blocks_and_computes_only_the_rest() -> None:
    store = MemoryStore(KVStoreConfig())
    expected = warm(store)
    engine = TinyEngine(store)
    engine.add("b", PROMPT)
    engine.step()
    plan = engine.plans[0]
    assert [ref.block_id for ref in plan.kv_loads["b"]] == plan.new_requests[0].block_ids[0][:5]
    assert plan.new_requests[0].num_computed_tokens == 5 * BS and plan.num_tokens["b"] == len(PROMPT) - 5 * BS
    engine.run()  # the worker checked every loaded position's KV before computing the rest
    request_out = engine.results[0].sampled["b"]
    assert request_out == expected[:1]
    stats = engine.connector.stats()
    assert stats.promised_tokens == stats.loaded_tokens == 5 * BS and stats.failed_blocks == 0
    assert stats.lookup_tokens == len(PROMPT) and stats.hit_rate("memory") == 5 * BS / len(PROMPT)


def test_whole_block_prompt_still_computes_its_last_token() -> None:
    store = MemoryStore(KVStoreConfig())
    prompt = PROMPT[:12]  # exactly 3 blocks, all saved by the first run
    warm(store, prompt)
    engine = TinyEngine(store)
    engine.add("b", prompt)
    engine.step()
    assert len(engine.plans[0].kv_loads["b"]) == 2 and engine.plans[0].num_tokens["b"] == BS


def test_device_hits_come_first_and_only_the_tail_is_loaded() -> None:
    store = MemoryStore(KVStoreConfig())
    warm(store)
    engine = TinyEngine(store)
    engine.generate("short", PROMPT[:9], max_tokens=1)  # computes (and caches on device) blocks 0 and 1
    engine.add("b", PROMPT)
    engine.step()
    plan = engine.plans[-1]
    assert plan.new_requests[0].num_computed_tokens == 5 * BS
    assert len(plan.kv_loads["b"]) == 3  # blocks 2..4; 0 and 1 were device hits
    engine.run()


@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_failed_load_rolls_back_to_the_first_bad_block_and_output_is_exact(fault: str) -> None:
    store = FlakyStore()
    expected = warm(store)
    engine = TinyEngine(store)
    engine.add("b", PROMPT)
    request = engine.scheduler.requests["b"]
    engine.kv.update_keys(request)
    bad = request.block_hashes[2]
    if fault == "missing":
        store.lose.add(bad)
    else:
        store.replace[bad] = b"not a block payload"
    engine.step()
    assert engine.results[0].kv_load_failures == {"b": 2}
    assert request.num_computed_tokens == 2 * BS and request.output_token_ids == []
    engine.step()  # recomputes from block 2 on; the worker checks blocks 0 and 1 it did load
    assert engine.plans[1].num_tokens["b"] == len(PROMPT) - 2 * BS
    engine.run()
    assert request.output_token_ids == expected
    stats = engine.connector.stats()
    assert stats.failed_blocks == 3 and stats.loaded_tokens == 2 * BS
    assert request.num_cached_tokens == 2 * BS


def test_loads_are_not_saved_again_and_new_blocks_are() -> None:
    store = MemoryStore(KVStoreConfig())
    warm(store, PROMPT[:13])  # blocks 0..2 in the store
    engine = TinyEngine(store)
    engine.generate("b", PROMPT, max_tokens=1)  # loads 0..2, computes 3 and 4 (the output token is not computed)
    assert engine.connector.flush(timeout=5)
    assert engine.connector.saver.stats().queued == 2


def test_decode_fills_blocks_that_are_saved_too() -> None:
    store = MemoryStore(KVStoreConfig())
    prompt = PROMPT[:6]
    out = warm(store, prompt, max_tokens=7)  # 6 + 7 tokens, 12 computed: 3 full blocks
    engine = TinyEngine(store)
    engine.add("next-turn", prompt + out + [5, 6, 7])
    engine.step()
    assert len(engine.plans[0].kv_loads["next-turn"]) == 3


def test_memory_pressure_with_preemption_and_store_loads_stays_exact() -> None:
    store = MemoryStore(KVStoreConfig())
    prompts = [PROMPT[:9 + i] for i in range(4)] + [[i] + PROMPT[1:15] for i in range(4)]
    alone = [TinyEngine(store).generate(str(i), p, max_tokens=6) for i, p in enumerate(prompts)]
    engine = TinyEngine(store, num_blocks=10)  # 8 requests of up to 5 blocks each: preemption
    for i, p in enumerate(prompts):
        engine.add(str(i), p, max_tokens=6)
    requests = dict(engine.scheduler.requests)
    engine.run()
    assert [requests[str(i)].output_token_ids for i in range(len(prompts))] == alone
    assert engine.scheduler.num_preemptions > 0 and engine.connector.stats().loaded_tokens > 0
    assert engine.kv.pool.num_free_blocks == 10


def test_cache_salt_isolates_tenants() -> None:
    store = MemoryStore(KVStoreConfig())
    warm(store, cache_salt="tenant-a")
    engine = TinyEngine(store)
    engine.add("b", PROMPT, cache_salt="tenant-b")
    engine.add("c", PROMPT)  # no salt is a tenant of its own
    engine.step()
    assert engine.plans[0].kv_loads == {}
    engine.run()
    engine.add("a", PROMPT, cache_salt="tenant-a")
    engine.step()
    assert len(engine.plans[-1].kv_loads["a"]) == 5


def test_prompt_logprobs_requests_compute_everything() -> None:
    store = MemoryStore(KVStoreConfig())
    warm(store)
    engine = TinyEngine(store)
    engine.add("b", PROMPT, prompt_logprobs=1)
    engine.step()
    assert engine.plans[0].kv_loads == {} and engine.plans[0].num_tokens["b"] == len(PROMPT)


def test_store_works_with_device_prefix_caching_off() -> None:
    store = MemoryStore(KVStoreConfig())
    expected = warm(store)
    engine = TinyEngine(store, caching=False)
    assert engine.generate("b", PROMPT) == expected
    assert len(engine.plans[0].kv_loads["b"]) == 5


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_ttl_class_of_the_request_decides_expiry(tier: str, tmp_path: Path) -> None:
    clock = FakeClock()
    config = KVStoreConfig(kinds=(tier,), disk_path=str(tmp_path))
    store = MemoryStore(config, clock) if tier == "memory" else DiskStore(config, clock)
    agent, chatbot = PROMPT[:9], [7] + PROMPT[1:9]
    warm(store, agent, kv_ttl_class="agent")
    warm(store, chatbot)  # no class: the default, chatbot

    def loadable(prompt: list[int]) -> int:
        engine = TinyEngine(store)
        engine.add("x", prompt)
        engine.step()
        engine.close()
        return len(engine.plans[0].kv_loads.get("x", []))

    assert loadable(agent) == loadable(chatbot) == 2
    clock.advance(3 * 86400 + 1)
    assert loadable(agent) == 0 and loadable(chatbot) == 2
    clock.advance(4 * 86400)
    assert loadable(chatbot) == 0
    if tier == "disk":
        assert store.stats().tiers[0].expired > 0  # and the files were reclaimed


class StuckStore(MemoryStore):
    """Reads work; every write hangs until released: a store that is down for writing."""

    def __init__(self) -> None:
        super().__init__(KVStoreConfig())
        self.gate = threading.Event()

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        self.gate.wait(10)


def test_a_stuck_store_only_loses_saves() -> None:
    store = StuckStore()
    engine = TinyEngine(store, saver_queue=2)
    first = engine.generate("a", PROMPT, max_tokens=8)
    second = engine.generate("b", [3] + PROMPT[1:], max_tokens=8)
    assert len(first) == len(second) == 8
    assert engine.connector.saver.stats().dropped > 0
    store.gate.set()
    engine.close()


def test_bfloat16_blocks_round_trip_exactly() -> None:
    store = MemoryStore(KVStoreConfig())
    first = TinyEngine(store, dtype=torch.bfloat16)
    out = first.generate("a", PROMPT)
    assert first.connector.flush(timeout=5)
    second = TinyEngine(store, dtype=torch.bfloat16)
    assert second.generate("b", PROMPT) == out  # the worker checked the loaded bfloat16 values
    assert len(second.plans[0].kv_loads["b"]) == 5


def test_blocks_of_another_layout_are_refused() -> None:
    store = MemoryStore(KVStoreConfig())
    warm(store)
    engine = TinyEngine(store, dtype=torch.float64)  # same keys, different bytes per block
    engine.add("b", PROMPT)
    engine.step()
    assert engine.results[0].kv_load_failures == {"b": 0}
    engine.run()
