import pytest

from deepinfer.core.block_pool import BlockPool
from deepinfer.core.prefix_cache import block_key, extend_block_keys, root_key


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert sorted(ids) == [0, 1, 2] and pool.num_free_blocks == 1
    pool.free(ids)
    assert pool.num_free_blocks == 4 and pool.usage() == 0


def test_over_allocation_and_double_free_raise():
    pool = BlockPool(2)
    assert not pool.can_allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_cached_block_survives_free_until_memory_is_needed():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"A" * 16)
    pool.free([a, b])
    assert pool.lookup(b"A" * 16) == a
    pool.touch([a])  # reused by a prefix hit: no longer free
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    pool.free([a])
    # LRU: b was freed before a, so b goes first; then a is evicted
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"A" * 16) == a
    assert pool.allocate(1) == [a]
    assert pool.lookup(b"A" * 16) is None and pool.stats().evictions == 1


def test_shared_block_ref_counts():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, b"k" * 16)
    pool.touch([a])
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2
    pool.free([a])
    assert pool.num_free_blocks == 3


def test_keys_chain_and_salt_isolation():
    r1, r2 = root_key("m", None), root_key("m", "tenant-b")
    assert r1 != r2
    k1, k2 = [], []
    extend_block_keys(k1, r1, list(range(40)), 16)
    extend_block_keys(k2, r2, list(range(40)), 16)
    assert len(k1) == 2 and all(a != b for a, b in zip(k1, k2))
    assert k1[1] == block_key(k1[0], list(range(16, 32)))
    # same block content after a different prefix gives a different key
    k3 = []
    extend_block_keys(k3, r1, [99] + list(range(1, 40)), 16)
    assert k3[1] != k1[1]
    assert len(k1[0]) == 16  # 128-bit
