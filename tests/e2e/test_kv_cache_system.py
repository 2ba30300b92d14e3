"""The KV store with the real model: greedy tokens are identical with the cache off, cold, warm on the device,
warm in host memory, warm on disk after a restart and warm in Redis, and stay identical under store faults."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from deepinfer import SamplingParams
from deepinfer.core.prefix_cache import extend_block_keys, root_key
from deepinfer.llm import LLM

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = ("<|im_start|>system\nYou are a careful assistant for a small bakery. Answer in one short sentence, "
          "mention prices in euros, and never invent products that are not on the menu.<|im_end|>\n")
QUESTIONS = [
    "Which of your breads keeps best for three or four days, and how should I store it at home?",
    "Do you have anything without gluten, and is it baked in the same oven as the wheat bread?",
    "Can I order two dozen croissants for Saturday morning, and when would I need to pick them up?",
]
PROMPTS = [SYSTEM + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
KV = dict(kv_cache_memory=256 << 20)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def generate(llm: LLM) -> list:
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def tier(llm: LLM, name: str):
    return llm.engine.stats().kv_store.tiers[[t.name for t in llm.engine.stats().kv_store.tiers].index(name)]


def block_keys(llm: LLM, prompt: str) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, root_key(llm.engine.kv.model_key, None), llm.engine.tokenize(prompt),
                      llm.engine.config.cache.block_size)
    return keys


def close(llm: LLM) -> None:
    llm.engine.close()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(enable_prefix_caching=False, **KV)
    out = tokens(generate(llm))
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def first_engine_runs(disk_dir: Path) -> dict:
    """Memory in front of disk: a cold run, a device-warm run, then a run with the device cache dropped."""
    llm = LLM(kv_store="memory,disk", kv_store_path=str(disk_dir), **KV)
    runs = {"cold": generate(llm)}
    assert llm.engine.kv_store.flush(timeout=30)
    runs["device"] = generate(llm)
    runs["memory_hits_before"] = tier(llm, "memory").hits
    llm.engine.kv.pool.reset_cache()
    runs["memory"] = generate(llm)
    runs["memory_hits"], runs["disk_hits"] = tier(llm, "memory").hits, tier(llm, "disk").hits
    close(llm)
    return runs


@pytest.fixture(scope="module")
def restarted(first_engine_runs: dict, disk_dir: Path) -> LLM:
    """A new engine on the same disk directory: a cold device cache and a freshly scanned disk tier."""
    llm = LLM(kv_store="disk", kv_store_path=str(disk_dir), **KV)
    yield llm
    close(llm)


def test_cold_device_warm_and_memory_warm_match_cache_off(reference, first_engine_runs):
    runs = first_engine_runs
    assert tokens(runs["cold"]) == reference
    assert all(o.num_cached_tokens == 0 for o in runs["cold"])
    assert tokens(runs["device"]) == reference
    assert all(o.num_cached_tokens > 0 for o in runs["device"]) and runs["memory_hits_before"] == 0
    assert tokens(runs["memory"]) == reference
    assert all(o.num_cached_tokens > 0 for o in runs["memory"])
    assert runs["memory_hits"] > 0 and runs["disk_hits"] == 0  # memory sits in front of disk


def test_disk_after_restart_matches_cache_off(reference, restarted):
    outs = generate(restarted)
    assert tokens(outs) == reference
    assert all(o.num_cached_tokens >= 48 for o in outs)
    stats = restarted.engine.stats().kv_store
    assert stats.loaded_tokens > 0 and tier(restarted, "disk").hits > 0 and stats.failed_blocks == 0


def test_disk_faults_are_recomputed_and_counted(reference, restarted, monkeypatch):
    store = restarted.engine.kv_store.store
    keys = [block_keys(restarted, p) for p in PROMPTS]
    shared = sum(1 for a, b in zip(keys[0], keys[1]) if a == b)
    bad_keys = [k[shared] for k in keys]  # each prompt's first block of its own
    flipped, truncated, deleted = (store.path_of(k) for k in bad_keys)
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF  # in the payload: only the checksum can tell
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    start_loads = restarted.engine.executor.runner.kv_transfer.start_loads

    def delete_then_load(plan):  # deleted after the scheduler saw it, before the worker reads it
        if plan.kv_loads and deleted.exists():
            deleted.unlink()
        return start_loads(plan)

    monkeypatch.setattr(restarted.engine.executor.runner.kv_transfer, "start_loads", delete_then_load)
    before = restarted.engine.stats().kv_store
    restarted.engine.kv.pool.reset_cache()
    outs = generate(restarted)
    assert tokens(outs) == reference
    after = restarted.engine.stats().kv_store
    assert after.failed_blocks > before.failed_blocks  # the flipped block and the deleted one
    assert tier(restarted, "disk").corrupt >= 2  # the flipped block and the truncated one
    assert restarted.engine.kv_store.flush(timeout=30)
    assert all(store.get(k) is not None for k in bad_keys)  # the bad files were replaced by recomputed blocks


def unwritable_dir(tmp_path: Path) -> str:
    """A read-only directory; as root, where permissions do not bind, a path below a regular file."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o500)
        return str(path)
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    return str(blocker / "kv")


def test_redis_tier_behind_an_unwritable_disk_and_redis_stopping_mid_run(reference, redis_server, tmp_path, monkeypatch):
    llm = LLM(kv_store="disk,redis", kv_store_path=unwritable_dir(tmp_path), kv_store_url=redis_server.url, **KV)
    try:
        assert tokens(generate(llm)) == reference
        assert llm.engine.kv_store.flush(timeout=30)
        assert tier(llm, "disk").io_errors > 0 and tier(llm, "redis").bytes_written > 0
        llm.engine.kv.pool.reset_cache()
        warm = generate(llm)
        assert tokens(warm) == reference and all(o.num_cached_tokens > 0 for o in warm)
        assert tier(llm, "redis").hits > 0
        start_loads = llm.engine.executor.runner.kv_transfer.start_loads

        def stop_redis_then_load(plan):  # the lookups saw the blocks; the background loads find redis gone
            if plan.kv_loads:
                redis_server.stop()
            return start_loads(plan)

        monkeypatch.setattr(llm.engine.executor.runner.kv_transfer, "start_loads", stop_redis_then_load)
        llm.engine.kv.pool.reset_cache()
        assert tokens(generate(llm)) == reference
        assert llm.engine.stats().kv_store.failed_blocks > 0 and tier(llm, "redis").connection_errors > 0
    finally:
        close(llm)
