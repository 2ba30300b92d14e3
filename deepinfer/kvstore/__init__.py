"""External KV block store: host memory, disk and redis tiers behind one interface, keyed by the prefix-cache hash chain.

The redis tier is imported lazily (by `make_store` or `deepinfer.kvstore.redis_store`) so the
`redis` package is needed only when configured.
"""
from deepinfer.kvstore.base import KINDS, Entry, KVStore, KVStoreConfig, KVStoreStats, TierStats
from deepinfer.kvstore.disk import DiskStore
from deepinfer.kvstore.factory import make_store
from deepinfer.kvstore.memory import MemoryStore
from deepinfer.kvstore.saver import AsyncSaver, SaverStats
from deepinfer.kvstore.tiered import TieredStore

__all__ = [
    "KINDS",
    "AsyncSaver",
    "DiskStore",
    "Entry",
    "KVStore",
    "KVStoreConfig",
    "KVStoreStats",
    "MemoryStore",
    "SaverStats",
    "TierStats",
    "TieredStore",
    "make_store",
]
