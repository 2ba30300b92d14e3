"""Layer groups for sliding-window hybrids, through the scheduler without a model: bounded sliding-window blocks,
the hybrid hit rule (full KV for [0, h), window KV for [h - W, h)), compact versus full caching, replay counters."""
import math

import pytest

from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_layout import KVGroup, KVLayout, default_keep_tokens, layout_from_specs
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepResult
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.sampling_params import SamplingParams

BS, W = 4, 8
LAYOUT = KVLayout((KVGroup(None, (2,)), KVGroup(W, (0,)), KVGroup(W, (1,))))


def make(mode="compact", keep=None, num_blocks=256, budget=16, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching, "m", LAYOUT, mode, keep)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, 10_000)


def run(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, outputs: list[int] | None = None):
    """Runs one request to the end; its outputs are `outputs` (default 7, 8, 9, ...). Returns the admission plan."""
    s.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, 0.0))
    first, n = None, 0
    while rid in s.requests:
        plan = s.schedule()
        first = first or plan
        req = s.requests[rid]
        done = req.num_computed_tokens + plan.num_tokens[rid] == req.num_tokens
        token = (outputs or list(range(7, 7 + max_tokens)))[n] if done else None
        s.update(plan, StepResult(sampled={rid: [token]} if done else {}))
        n += done
        if rid in s.requests:
            for g, window in enumerate(s.kv.windows):
                if window is not None:
                    assert s.kv.held_blocks(rid, g) <= math.ceil(W / BS) + 1 + math.ceil(16 / BS)
    return first


def test_layout_groups_gemma_pattern_into_equal_groups_full_first():
    specs = [KVCacheSpec(1, 8, 8, None if (i + 1) % 6 == 0 else 512) for i in range(18)]
    layout = layout_from_specs(specs)
    assert [g.sliding_window for g in layout.groups] == [None, 512, 512, 512, 512, 512]
    assert layout.groups[0].layers == (5, 11, 17) and layout.groups[1].layers == (0, 1, 2)
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(18))
    assert layout_from_specs([KVCacheSpec(2, 4, 4)] * 3).groups == (KVGroup(None, (0, 1, 2)),)


def test_running_sequence_of_4w_holds_at_most_window_plus_one_block_per_sliding_group():
    s = make()
    s.add(Request("a", list(range(100, 104)), SamplingParams(max_tokens=4 * W, ignore_eos=True), 0, 0.0))
    peak = 0
    while "a" in s.requests:
        plan = s.schedule()
        s.update(plan, StepResult(sampled={"a": [5]} if s.requests["a"].num_computed_tokens + plan.num_tokens["a"]
                                  == s.requests["a"].num_tokens else {}))
        if "a" in s.requests:
            peak = max(peak, *(s.kv.held_blocks("a", g) for g in (1, 2)))
            assert s.kv.held_blocks("a", 0) == len(s.kv.block_ids("a", 0))  # full attention keeps everything
    assert peak <= math.ceil(W / BS) + 1


def test_window_blocks_released_during_decode_are_reused():
    s = make(num_blocks=40)
    run(s, "a", list(range(200, 204)), max_tokens=60)  # 64 tokens: 16 full blocks + 3 + 3 sliding at the end
    assert s.kv.pool.num_free_blocks == 40


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_continuing_conversation_hits_at_its_full_match_without_replay(mode):
    s = make(mode)
    turn1 = list(range(300, 330))
    run(s, "t1", turn1, max_tokens=10, outputs=list(range(400, 410)))
    turn2 = turn1 + list(range(400, 410)) + list(range(500, 520))
    plan = run(s, "t2", turn2, max_tokens=2)
    new = plan.new_requests[0]
    assert new.num_computed_tokens == 36  # 39 computed tokens of turn 1 -> 9 full blocks
    assert s.kv.replay_stats().replayed_tokens == 0


def test_compact_drops_old_window_blocks_and_a_mid_conversation_branch_replays():
    compact, full = make("compact"), make("full")
    prompt = list(range(600, 664))
    for s in (compact, full):
        run(s, "long", prompt, max_tokens=2)
    branch = prompt[:40] + [1, 2, 3, 4, 5]  # shares 10 blocks, far before the kept tail
    hit_full = run(full, "b", branch, max_tokens=1).new_requests[0].num_computed_tokens
    hit_compact = run(compact, "b", branch, max_tokens=1).new_requests[0].num_computed_tokens
    assert hit_full == 40 and full.kv.replay_stats().hits == 0
    assert hit_compact == 0  # the window before token 40 left the cache: everything is recomputed
    stats = compact.kv.replay_stats()
    assert stats.hits == 1 and stats.replayed_tokens == 40 and stats.max_replayed_tokens == 40


def test_compact_keeps_the_last_keep_tokens_and_replays_at_most_keep_tokens():
    keep = default_keep_tokens(W, BS)
    s = make("compact", keep=keep)
    prompt = list(range(700, 764))
    run(s, "long", prompt, max_tokens=2)  # 65 computed
    sliding = [g for g, w in enumerate(s.kv.windows) if w is not None]
    for cut in range(4, 64, 4):  # every branch point: the hit needs [cut - W, cut) of the sliding groups
        before = s.kv.replay_stats().replayed_tokens
        plan = run(s, f"b{cut}", prompt[:cut] + [9, 9, 9], max_tokens=1)
        hit = plan.new_requests[0].num_computed_tokens
        replayed = s.kv.replay_stats().replayed_tokens - before
        assert hit + replayed == cut
        assert replayed <= keep, (cut, replayed, keep)
        if cut >= 65 - keep + W - 1:
            assert replayed == 0, cut
        for g in sliding:  # the hit's table: nothing before its window, cached blocks inside it
            table = plan.new_requests[0].block_ids[g][: hit // BS]
            assert all(b == 0 for b in table[: max(0, hit - W) // BS])
    stats = s.kv.replay_stats()
    assert stats.hits > 0 and 0 < stats.max_replayed_tokens <= keep  # some branch replayed, none more than promised


def test_null_entries_are_never_freed_twice_and_everything_returns():
    s = make(num_blocks=64)
    prompt = list(range(800, 860))
    run(s, "a", prompt, max_tokens=3)
    run(s, "b", prompt + [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=3)
    assert all(s.kv.pool.ref_count(b) == 0 for b in range(64))
    assert s.kv.pool.num_free_blocks == 64


def test_keep_tokens_shorter_than_the_window_is_rejected():
    with pytest.raises(ValueError, match="shorter than the sliding window"):
        KVCacheManager(16, BS, True, "m", LAYOUT, "compact", keep_tokens=W - 1)
    with pytest.raises(ValueError, match="compact"):
        KVCacheManager(16, BS, True, "m", LAYOUT, "lazy")


def test_default_keep_tokens_formula():
    assert default_keep_tokens(128, 1, 6) == 134
    assert default_keep_tokens(512, 16) == 527
