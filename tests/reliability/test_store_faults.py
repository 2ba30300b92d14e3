"""Faults under the KV store's tiers, with requests running: Redis killed (kill -9) and restarted, a disk that fills
up, a read-only disk directory, a slow and then a hung Redis; and two models that differ in one weight sharing one
store. Each case asserts that no request is lost (all finish) and none is answered wrong: the greedy tokens equal
those of an engine without any store."""
from __future__ import annotations

import gc
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deepinfer import SamplingParams
from deepinfer.llm import LLM
from tests.reliability.conftest import require_root_mounts
from tests.reliability.proxy import SlowProxy
from tests.reliability.tiny import make_tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = [(i * 7919) % 40000 + 100 for i in range(48)]  # three full blocks every prompt shares
PROMPTS = [SHARED + [(i * 31 + j * 17) % 40000 + 100 for j in range(20 + 3 * i)] for i in range(6)]
ENGINE = dict(kv_cache_memory=8 << 20, num_threads=1)


def tokens(outs) -> list[list[int]]:
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def tier(llm: LLM, name: str):
    return next(t for t in llm.engine.stats().kv_store.tiers if t.name == name)


def cold(llm: LLM) -> LLM:
    """Drops the device prefix cache, so the next requests look in the store."""
    llm.engine.kv.pool.reset_cache()
    return llm


def close(llm: LLM) -> None:
    llm.engine.close()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    llm = LLM(tiny_model, enable_prefix_caching=False, **ENGINE)
    out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(llm)
    return out


def run_with(llm: LLM, between_steps) -> list[list[int]]:
    """Every prompt, added two at a time while the engine steps; between_steps(step) runs before each step."""
    engine, pending, outputs, step = llm.engine, list(enumerate(PROMPTS)), {}, 0
    while pending or engine.has_unfinished_requests():
        for i, prompt in pending[:2]:
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, GREEDY)
        pending = pending[2:]
        between_steps(step)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id[1:].split("-")[0]))
    return tokens(ordered)


def test_one_weight_apart_models_never_share_blocks_in_a_shared_store(tiny_model, reference, tmp_path):
    store = dict(kv_store="disk", kv_store_path=str(tmp_path / "shared"), **ENGINE)
    a = LLM(tiny_model, **store)
    assert tokens(a.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert a.engine.kv_store.flush(timeout=30) and tier(a, "disk").bytes_written > 0
    close(a)
    tuned = make_tiny_model(str(tmp_path / "tuned"), changed_weight="model.layers.0.self_attn.v_proj.weight")
    own = LLM(tuned, enable_prefix_caching=False, **ENGINE)
    tuned_reference = tokens(own.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(own)
    assert tuned_reference != reference  # one weight is enough to change the answers: sharing would serve wrong KV
    b = LLM(tuned, **store)
    assert tokens(b.generate(PROMPTS, GREEDY, use_tqdm=False)) == tuned_reference
    stats = b.engine.stats().kv_store
    assert tier(b, "disk").hits == 0 and stats.loaded_tokens == 0 and stats.lookup_tokens > 0
    close(b)
    copy = shutil.copytree(tiny_model, tmp_path / "copy-of-a")  # the same bytes elsewhere: the same identity
    c = LLM(str(copy), **store)
    assert tokens(c.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference and tier(c, "disk").hits > 0
    close(c)


def test_redis_killed_and_restarted_under_load(tiny_model, reference, redis_server):
    llm = LLM(tiny_model, kv_store="redis", kv_store_url=redis_server.url, **ENGINE)
    # reconnect within the test's few seconds: the quiet window doubles per failure in a row up to max_retry_after
    # (a CI run counted 35 connection errors while the server was down and was still quiet after the restart)
    llm.engine.kv_store.store.retry_after = llm.engine.kv_store.store.max_retry_after = 0.2
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
        assert llm.engine.kv_store.flush(timeout=30)

        def kill_at_step_2(step: int) -> None:
            if step == 2:
                redis_server._proc.kill()  # kill -9: no goodbye to clients
                redis_server._proc.wait()
                redis_server._proc = None

        assert run_with(cold(llm), kill_at_step_2) == reference
        down = tier(llm, "redis")
        assert down.connection_errors > 0
        redis_server.start()  # empty: it ran without persistence
        time.sleep(0.3)
        assert run_with(cold(llm), lambda step: None) == reference  # recomputed, and saved again
        assert llm.engine.kv_store.flush(timeout=30) and tier(llm, "redis").bytes_written > down.bytes_written
        assert run_with(cold(llm), lambda step: None) == reference
        assert tier(llm, "redis").hits > down.hits  # the store serves again
    finally:
        close(llm)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    require_root_mounts()
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_then_read_only(tiny_model, reference, tmp_path):
    with tmpfs(tmp_path / "small-disk", "96k") as disk:  # ~10 blocks of this model: the prompts need more
        llm = LLM(tiny_model, kv_store="disk", kv_store_path=str(disk), kv_store_disk_capacity=1 << 30, **ENGINE)
        try:
            assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
            assert llm.engine.kv_store.flush(timeout=30)
            full = tier(llm, "disk")
            assert full.io_errors > 0 and full.bytes_written > 0  # some blocks fit, the rest found the disk full
            assert run_with(cold(llm), lambda step: None) == reference  # what fits is loaded, the rest recomputed
            assert tier(llm, "disk").hits > 0 and tier(llm, "disk").corrupt == 0
        finally:
            close(llm)
        assert not list(disk.rglob("*.tmp"))  # a failed write leaves no temp file behind
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        ro = LLM(tiny_model, kv_store="disk", kv_store_path=str(disk), **ENGINE)  # scans a read-only directory
        try:
            assert run_with(ro, lambda step: None) == reference
            assert ro.engine.kv_store.flush(timeout=30)
            stats = tier(ro, "disk")
            assert stats.hits > 0 and stats.io_errors > 0 and stats.corrupt == 0  # reads served, writes refused
        finally:
            close(ro)


def test_a_slow_then_hung_redis_costs_time_not_answers(tiny_model, reference, redis_server):
    proxy = SlowProxy(redis_server.port, delay=0.02)
    llm = LLM(tiny_model, kv_store="redis", kv_store_url=proxy.url, **ENGINE)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference  # slow: every round trip +20 ms
        assert llm.engine.kv_store.flush(timeout=60)
        assert run_with(cold(llm), lambda step: None) == reference and tier(llm, "redis").hits > 0
        proxy.stalled = True  # hung: connections stay open and nothing answers
        started = time.monotonic()
        assert run_with(cold(llm), lambda step: None) == reference
        hung_seconds = time.monotonic() - started
        assert tier(llm, "redis").connection_errors > 0
        # a hung store costs at most a few socket timeouts, then it is skipped until it answers again
        print(f"\nhung Redis: {len(PROMPTS)} requests in {hung_seconds:.1f} s, {tier(llm, 'redis').connection_errors} "
              f"connection errors")
        assert hung_seconds < 15, hung_seconds
    finally:
        proxy.stalled = False
        close(llm)
        proxy.close()
