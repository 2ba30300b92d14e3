"""The router's replica choice (deepinfer/router/policy.py) on synthetic replica states, and the trace simulator
(benchmarks/router_sim.py) on a tiny trace."""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.router.policy import (BlockKeySet, CostModel, Decision, DigestGap, NoHealthyReplica, ReplicaReport,
                                     ReplicaState, RoutingConfig, pick, request_block_keys)
from deepinfer.sampling_params import SamplingParams

BS = 16
COST = CostModel(step_s=0.01, prefill_token_s=1e-4, attention_pair_s=1e-8, decode_request_s=1e-3,
                 decode_context_s=1e-7)
CONFIG = RoutingConfig(cache_weight=2.0, recent_weight=0.0, balance_abs_s=2.0, balance_rel=1.5, block_size=BS)


def keys(first_token: int, blocks: int) -> list[bytes]:
    return request_block_keys(list(range(first_token, first_token + blocks * BS)), "model", None, BS)


def replicas(n: int, **fields) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", **fields) for i in range(n)]


def test_key_chain_is_the_engines():
    tokens = list(range(1000, 1000 + 5 * BS + 3))
    request = Request("a", tokens, SamplingParams(cache_salt="tenant"), 0, 0.0)
    KVCacheManager(8, BS, True, "model").update_keys(request)
    assert request_block_keys(tokens, "model", "tenant", BS) == request.block_hashes
    assert len(request.block_hashes) == 5  # full blocks only
    assert request_block_keys(tokens, "model", None, BS) != request.block_hashes  # the salt isolates tenants


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it():
    a, b = keys(0, 6), keys(10_000, 6)
    states = replicas(4)
    states[2] = replace(states[2], blocks=BlockKeySet.of(a[:4]))
    states[3] = replace(states[3], blocks=BlockKeySet.of(b[:5]))
    for chain, holder, matched in ((a, 2, 4), (b, 3, 5)):
        d = pick(chain, 6 * BS + 5, states, COST, "cache_aware", config=CONFIG)
        assert (d.index, d.reason, d.matched_blocks) == (holder, "cache_hit", matched)


def test_unrelated_requests_spread_over_the_replicas():
    states = replicas(4)
    chosen = []
    for i in range(8):
        chain = keys(100_000 * (i + 1), 8)
        d = pick(chain, 8 * BS, states, COST, "cache_aware", config=CONFIG)
        assert d.reason == "load_balance" and d.matched_blocks == 0
        states[d.index] = states[d.index].with_routed(chain, 8 * BS, d, BS)
        chosen.append(d.index)
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_holder_within_the_balance_window_keeps_its_prefix_and_an_overloaded_one_loses_it():
    chain = keys(0, 3200)  # 51,200 tokens: about 18 s to recompute on another replica
    busy = replicas(3)
    busy[1] = replace(busy[1], blocks=BlockKeySet.of(chain), queued_prefill_tokens=150_000)  # about 16 s queued
    d = pick(chain, 3200 * BS, busy, COST, "cache_aware", config=CONFIG)
    assert (d.index, d.reason, d.matched_blocks) == (1, "cache_hit", 3200)

    # about 32 s queued: the cache-weighted score still prefers the holder (recomputing counts twice), but the
    # wait is past the window (2 s more than recomputing elsewhere takes), so balance comes first
    busy[1] = replace(busy[1], queued_prefill_tokens=300_000)
    d = pick(chain, 3200 * BS, busy, COST, "cache_aware", config=CONFIG)
    assert (d.index, d.reason, d.matched_blocks) == (0, "load_balance", 0)
    assert pick(chain, 3200 * BS, busy, COST, "cache_aware", config=replace(CONFIG, balance_abs_s=1e6)).index == 1


def test_recent_work_moves_a_conversation_off_a_replica_that_has_had_much_more():
    chain = keys(0, 8)
    states = replicas(2)
    states[0] = replace(states[0], blocks=BlockKeySet.of(chain), recent_work_s=100.0)
    assert pick(chain, 8 * BS, states, COST, "cache_aware", config=CONFIG).index == 0  # weight 0: ignored
    heavy = replace(CONFIG, recent_weight=0.5)
    d = pick(chain, 8 * BS, states, COST, "cache_aware", config=heavy)
    assert (d.index, d.reason) == (1, "load_balance")
    assert d.work_s == pytest.approx(COST.prefill_work(8 * BS, 8 * BS * (8 * BS + 1) // 2))


def test_a_replica_whose_kv_is_full_is_avoided():
    chain = keys(0, 4)
    states = replicas(2)
    states[0] = replace(states[0], blocks=BlockKeySet.of(chain), kv_usage=0.99)
    assert pick(chain, 4 * BS, states, COST, "cache_aware", config=CONFIG).index == 1
    states[1] = replace(states[1], kv_usage=0.99)  # all full: the cache decides again
    assert pick(chain, 4 * BS, states, COST, "cache_aware", config=CONFIG).index == 0


@pytest.mark.parametrize("policy", ["cache_aware", "least_load", "round_robin"])
def test_unhealthy_replicas_are_never_picked(policy):
    chain = keys(0, 4)
    states = replicas(3)
    states[0] = replace(states[0], healthy=False, blocks=BlockKeySet.of(chain))
    states[2] = replace(states[2], healthy=False)
    for counter in range(4):
        assert pick(chain, 4 * BS, states, COST, policy, counter=counter, config=CONFIG).index == 1


@pytest.mark.parametrize("policy", ["cache_aware", "least_load", "round_robin"])
def test_no_healthy_replica_raises(policy):
    with pytest.raises(NoHealthyReplica, match="none of the 2 replicas"):
        pick(keys(0, 1), BS, replicas(2, healthy=False), COST, policy)
    with pytest.raises(NoHealthyReplica):
        pick(keys(0, 1), BS, [], COST, policy)


def test_round_robin_cycles_through_the_healthy_replicas():
    chain = keys(0, 2)
    states = replicas(3)
    states[0] = replace(states[0], blocks=BlockKeySet.of(chain))  # round robin ignores caches
    decisions = [pick(chain, 2 * BS, states, COST, "round_robin", counter=c) for c in range(6)]
    assert [d.index for d in decisions] == [0, 1, 2, 0, 1, 2]
    assert {d.reason for d in decisions} == {"round_robin"}
    assert [d.matched_blocks for d in decisions[:3]] == [2, 0, 0]


def test_least_load_picks_the_shortest_queue_and_ties_go_to_the_lowest_index():
    chain = keys(0, 4)
    states = replicas(4)
    assert pick(chain, 4 * BS, states, COST, "least_load").index == 0
    states = [replace(s, queued_prefill_tokens=q) for s, q in zip(states, (900, 300, 300, 800))]
    d = pick(chain, 4 * BS, states, COST, "least_load")
    assert (d.index, d.reason) == (1, "least_load")


def test_decisions_are_deterministic_and_ties_go_to_the_lowest_index():
    chain = keys(0, 8)
    states = replicas(5, blocks=BlockKeySet.of(chain[:3]), queued_prefill_tokens=100)
    first = pick(chain, 8 * BS, states, COST, "cache_aware", config=CONFIG)
    assert first.index == 0 and first.reason == "cache_hit"
    assert all(pick(chain, 8 * BS, states, COST, "cache_aware", config=CONFIG) == first for _ in range(3))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="policy must be one of"):
        pick(keys(0, 1), BS, replicas(1), COST, "random")
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        pick([], 0, replicas(1), COST)
    with pytest.raises(ValueError, match="kv_usage"):
        ReplicaState("r0", kv_usage=1.5)
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_dict({"step_s": 0.1})


def test_reports_update_the_key_set_incrementally():
    chain = keys(0, 6)
    state = ReplicaState("r0").apply(ReplicaReport(seq=1, added=tuple(chain[:2]), snapshot=True))
    state = state.apply(ReplicaReport(seq=2, queued_prefill_tokens=64, added=tuple(chain[2:5]), evicted=(chain[0],)))
    assert (len(state.blocks), state.queued_prefill_tokens, state.seq) == (4, 64, 2)
    assert chain[0] not in state.blocks and all(k in state.blocks for k in chain[1:5])
    assert state.blocks.matched_prefix(chain) == 0  # the chain's first block is gone: nothing after it is usable
    with pytest.raises(DigestGap, match="report 4 after 2"):
        state.apply(ReplicaReport(seq=4))
    assert len(state.apply(ReplicaReport(seq=9, added=tuple(chain), snapshot=True)).blocks) == 6

    routed = state.with_routed(chain, 6 * BS, Decision(0, "load_balance", 0, 0.5), BS)
    assert routed.blocks.matched_prefix(chain) == 6 and routed.waiting_requests == 1 and routed.recent_work_s == 0.5
    assert routed.queued_prefill_tokens == 64 + 6 * BS - 0
    assert len(state.blocks) == 4  # the old state is unchanged


def test_a_large_key_set_updates_without_copying_every_shard():
    many = BlockKeySet.of(keys(0, 20_000))
    small = many.updated(added=keys(1_000_000, 3), evicted=keys(0, 2))
    assert (len(many), len(small)) == (20_000, 20_001)
    assert sum(a is not b for a, b in zip(many.shards, small.shards)) <= 5


def _router_sim():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "router_sim.py"
    spec = importlib.util.spec_from_file_location("router_sim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_simulated_cache_aware_hits_at_least_as_often_as_round_robin(tmp_path):
    sim = _router_sim()
    trace = tmp_path / "trace.jsonl"
    with trace.open("w") as f:  # 6 conversations of 5 turns; each turn extends the previous one by 2 blocks
        for turn in range(5):
            for conv in range(6):
                ids = [conv * 100 + i for i in range(2 + 2 * turn)]
                f.write(json.dumps({"timestamp": (turn * 6 + conv) * 50, "input_length": len(ids) * 512 - 100,
                                    "output_length": 4 + conv, "hash_ids": ids}) + "\n")
    requests = sim.load_trace(str(trace))
    ideal = sim.oracle(requests, COST)
    args = sim.parse_args(["--capacity", "64", "--report-interval", "0"])
    routing = RoutingConfig(block_size=sim.BLOCK)
    results = {p: sim.simulate(requests, 3, p, COST, routing, args, 1.0, ideal, False)
               for p in ("round_robin", "least_load", "cache_aware")}
    assert ideal.hit_rate == pytest.approx(120 / 180)  # 180 blocks, of which each turn's last 2 are new
    for r in results.values():
        assert r.completed == len(requests) == 30
        assert 0 <= r.hit_rate <= ideal.hit_rate + 1e-9 and r.ttft_p50_s > 0
    assert results["cache_aware"].hit_rate >= results["round_robin"].hit_rate
    assert results["cache_aware"].hit_rate_vs_oracle > 0.9
