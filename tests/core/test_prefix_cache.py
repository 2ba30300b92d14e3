"""Prefix-cache eviction and reference counting under memory pressure, through the scheduler, without a model."""
from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepResult
from deepinfer.core.prefix_cache import extend_block_keys, root_key
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

BS = 4
SHARED = list(range(500, 508))  # two full blocks every request below starts with


def make(num_blocks: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(num_blocks, BS, True, "m"), 1000)


def req(rid: str, tail: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, SHARED + tail, SamplingParams(max_tokens=max_tokens), 0, 0.0)


def step(s: Scheduler):
    plan = s.schedule()
    sampled = {rid: [1] for rid, n in plan.num_tokens.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    s.update(plan, StepResult(sampled=sampled))
    return plan


def keys(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_keys(out, root_key("m", None), tokens, BS)
    return out


def test_shared_blocks_count_every_holder_and_return_to_the_free_queue():
    s = make(num_blocks=16)
    s.add(req("a", [1, 2, 3], max_tokens=5))
    step(s)  # a computes and caches the two shared blocks
    for rid in "bcd":
        s.add(req(rid, [ord(rid)] * 3, max_tokens=5))
    plan = step(s)
    shared = s.kv.block_ids("a")[:2]
    assert all(s.kv.block_ids(rid)[:2] == shared for rid in "bcd")
    assert all(new.num_computed_tokens == 8 for new in plan.new_requests)
    assert [s.kv.pool.ref_count(b) for b in shared] == [4, 4]
    while s.has_unfinished():
        step(s)
    assert s.kv.pool.num_free_blocks == 16
    assert [s.kv.pool.lookup(k) for k in keys(SHARED)] == shared  # freed but still cached


def test_blocks_in_use_are_never_evicted_and_free_ones_go_least_recently_freed_first():
    s = make(num_blocks=8)
    s.add(req("old", [9, 9, 9, 9, 9], max_tokens=1))  # 13 tokens, 4 blocks, finishes at once
    step(s)
    old_keys = keys(SHARED + [9] * 5)
    assert all(s.kv.pool.lookup(k) is not None for k in old_keys[:3])
    s.add(req("live", [7, 7, 7], max_tokens=20))  # reuses the 2 shared blocks, takes 1 more
    step(s)
    live_blocks = set(s.kv.block_ids("live"))
    s.add(Request("hog", list(range(900, 918)), SamplingParams(max_tokens=1), 0, 0.0))  # 18 tokens: 5 blocks
    step(s)
    pool = s.kv.pool
    assert all(pool.lookup(k) is not None for k in keys(SHARED))  # in use by "live": kept
    assert pool.lookup(old_keys[2]) is None  # old's own blocks were evicted for the hog
    assert all(pool.ref_count(b) >= 1 for b in live_blocks)
    assert pool.stats().evictions >= 1


def test_tail_blocks_are_evicted_before_the_prefix():
    s = make(num_blocks=6)
    s.add(req("a", list(range(20, 32)), max_tokens=1))  # 20 tokens: 5 full blocks, all cached
    step(s)
    ks = keys(SHARED + list(range(20, 32)))
    s.add(Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 0, 0.0))  # needs 2 blocks
    step(s)
    found = [s.kv.pool.lookup(k) is not None for k in ks]
    assert found[:3] == [True, True, True] and found[4] is False  # the chain's end went first


def test_pressure_with_preemption_loses_nothing_and_frees_everything():
    s = make(num_blocks=7, budget=64)
    for i in range(5):
        s.add(req(str(i), [i] * 5, max_tokens=6))
    preempted = 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        preempted += len(step(s).preempted_ids)
    assert not s.has_unfinished() and preempted > 0
    assert s.kv.pool.num_free_blocks == 7
    assert s.kv.prefix_hits > 0


def test_same_block_tokens_under_another_prefix_never_match():
    s = make(num_blocks=16)
    s.add(Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1), 0, 0.0))
    step(s)
    s.add(Request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1), 0, 0.0))  # block 1 equal, block 0 not
    plan = step(s)
    assert plan.new_requests[0].num_computed_tokens == 0
