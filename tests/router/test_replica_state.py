"""What a replica reports to the router, without a model: the block pool's key event log (diffs, snapshots after a
gap or a restart), the wire format, and the router's view that follows it; the launcher's core plan."""
from __future__ import annotations

import pytest

from deepinfer.core.block_pool import BlockPool, KeyEventLog
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.router.launch import plan_cores
from deepinfer.router.policy import request_block_keys
from deepinfer.router.replica import Replica
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.replica_api import decode_keys, encode_keys


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_the_log_gives_diffs_where_a_key_s_last_event_decides():
    pool = BlockPool(4)
    epoch = pool.key_log.epoch
    start = pool.key_events(None, None)
    assert start.snapshot and start.added == () and start.seq == 0
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        assert pool.cache(b, key(i))
    pool.uncache(blocks[0], key(0))
    events = pool.key_events(0, epoch)
    assert not events.snapshot and set(events.added) == {key(1), key(2)} and events.evicted == (key(0),)
    assert pool.cache(blocks[0], key(0))  # evicted, then cached again: added
    later = pool.key_events(events.seq, epoch)
    assert later.added == (key(0),) and later.evicted == () and later.seq == events.seq + 1
    assert pool.key_events(later.seq, epoch).added == ()  # nothing new

    pool.free(blocks)
    pool.allocate(4)  # hands out the three cached blocks again: evicts them
    gone = pool.key_events(later.seq, epoch)
    assert set(gone.evicted) == {key(0), key(1), key(2)} and pool.key_events(None, None).added == ()


def test_a_gap_another_epoch_or_a_future_seq_gets_a_snapshot():
    log = KeyEventLog(capacity=3)
    held = {key(i) for i in range(5)}
    for i in range(5):
        log.record(key(i), True)
    assert log.since(2, log.epoch, lambda: held).snapshot is False  # events 3..5 are kept
    for seq, epoch in ((1, log.epoch), (0, log.epoch), (6, log.epoch), (4, "another")):
        answer = log.since(seq, epoch, lambda: held)
        assert answer.snapshot and set(answer.added) == held and answer.epoch == log.epoch
    with pytest.raises(ValueError, match="capacity"):
        KeyEventLog(0)


def test_the_kv_manager_reports_the_request_key_chain():
    kv = KVCacheManager(16, 4, True, "model")
    request = Request("a", list(range(1, 12)), SamplingParams(cache_salt="s"), 0, 0.0)
    kv.allocate(request, 11)
    request.num_computed_tokens = 11
    kv.cache_computed(request)
    events = kv.key_events(None)
    assert events.snapshot and list(events.added) == request_block_keys(request.prompt_token_ids, "model", "s", 4)


def test_the_router_follows_a_replica_s_reports():
    def report(seq, added=(), evicted=(), snapshot=False, epoch="e1", queued=0):
        load = {"queued_prefill_tokens": queued, "queued_prefill_pairs": 0, "running_requests": 1,
                "running_context_tokens": 40, "waiting_requests": 0, "kv_usage": 0.25}
        return {"epoch": epoch, "seq": seq, "snapshot": snapshot, "added": encode_keys(added),
                "evicted": encode_keys(evicted), "load": load, "prefix_cache": {"queries": 10, "hits": 4},
                "model_key": "m", "block_size": 16, "model_path": "/m"}

    replica = Replica("http://127.0.0.1:1", "both")
    replica.apply(report(2, added=(key(1), key(2)), snapshot=True, queued=64))
    assert (len(replica.state.blocks), replica.state.queued_prefill_tokens, replica.seq) == (2, 64, 2)
    replica.apply(report(5, added=(key(3),), evicted=(key(1),)))
    assert key(1) not in replica.state.blocks and key(3) in replica.state.blocks and replica.seq == 5
    with pytest.raises(ValueError, match="diff for log e2"):
        replica.apply(report(6, added=(key(4),), epoch="e2"))  # a restarted replica never sends a diff: refused
    replica.apply(report(1, added=(key(9),), snapshot=True, epoch="e2"))
    assert set(replica.state.blocks.shards[0]) == {key(9)} and (replica.snapshots, replica.diffs) == (2, 1)
    assert decode_keys(encode_keys((key(1), key(2)))) == (key(1), key(2))
    with pytest.raises(ValueError, match="multiple of the key size"):
        decode_keys(encode_keys((b"short",)))


@pytest.mark.parametrize("cores,n,plan", [([0, 1], 2, [[0], [1]]), ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3]]),
                                         ([0, 1], 3, None), ([5], 1, [[5]])])
def test_replicas_get_disjoint_cores_when_there_are_enough(cores, n, plan):
    assert plan_cores(cores, n) == plan
