from __future__ import annotations

import pytest

from deepinfer.kvstore import KVStoreConfig, MemoryStore, TieredStore, make_store
from deepinfer.kvstore.disk import DiskStore


def test_defaults_mean_no_store() -> None:
    config = KVStoreConfig()
    assert not config.enabled
    assert make_store(config) is None


def test_ttl_classes() -> None:
    config = KVStoreConfig()
    assert dict(config.ttl_seconds) == {"agent": 3 * 86400.0, "chatbot": 7 * 86400.0}
    assert config.ttl_for(None) == 7 * 86400.0
    assert config.ttl_for("agent") == 3 * 86400.0
    with pytest.raises(ValueError, match="unknown ttl class 'batch'"):
        config.ttl_for("batch")
    with pytest.raises(TypeError):
        config.ttl_seconds["agent"] = 1.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kinds": ("ssd",)}, "kinds must be among"),
        ({"kinds": ("memory", "memory")}, "must not repeat"),
        ({"kinds": ("disk",)}, "needs disk_path"),
        ({"kinds": ("redis",)}, "needs redis_url"),
        ({"memory_bytes": 0}, "memory_bytes must be > 0"),
        ({"disk_bytes": -1}, "disk_bytes must be > 0"),
        ({"ttl_classes": (("a", 1.0), ("a", 2.0)), "default_ttl_class": "a"}, "must not repeat"),
        ({"ttl_classes": (("a", 0.0),), "default_ttl_class": "a"}, "must be > 0"),
        ({"default_ttl_class": "batch"}, "'batch' is not among"),
        ({"save_queue_size": 0}, "save_queue_size must be >= 1"),
    ],
)
def test_rejects_bad_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVStoreConfig(**kwargs)


def test_make_store_builds_tiers_in_order(tmp_path) -> None:
    single = make_store(KVStoreConfig(kinds=("disk",), disk_path=str(tmp_path)))
    assert isinstance(single, DiskStore)
    stack = make_store(KVStoreConfig(kinds=("memory", "disk"), disk_path=str(tmp_path)))
    assert isinstance(stack, TieredStore)
    assert [type(t) for t in stack.tiers] == [MemoryStore, DiskStore]
    assert [t.name for t in stack.stats().tiers] == ["memory", "disk"]
    stack.close()
