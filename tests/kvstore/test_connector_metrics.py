"""KV store counters reach Engine.stats()' consumers: the server's /metrics text, per tier."""
from __future__ import annotations

from deepinfer.engine.engine import EngineStats
from deepinfer.kvstore import SaverStats, TierStats
from deepinfer.kvstore.connector import KVStoreConnectorStats
from deepinfer.server.metrics import ServerMetrics


def engine_stats(kv_store: KVStoreConnectorStats | None) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, num_blocks=10, num_preemptions=0, prompt_tokens=100,
                       generation_tokens=5, prefix_cache_queries=100, prefix_cache_hits=32, kv_store=kv_store)


def test_metrics_show_each_tier() -> None:
    kv = KVStoreConnectorStats(
        block_size=16, lookup_tokens=100, promised_tokens=64, failed_blocks=1,
        saves=SaverStats(queued=7, saved=6, dropped=1, failed=0, pending=0),
        tiers=(TierStats("memory", hits=1, misses=3, bytes_read=10, bytes_written=20, evictions=2),
               TierStats("disk", hits=2, misses=1, bytes_read=30, expired=4, corrupt=1, io_errors=2)),
    )
    assert kv.loaded_tokens == 48 and kv.hit_rate("disk") == 0.32
    text = ServerMetrics(lambda: engine_stats(kv), "m").render().decode()
    for line in (
        'deepinfer:kv_store_hit_tokens_total{model_name="m",tier="disk"} 32.0',
        'deepinfer:kv_store_hit_rate{model_name="m",tier="memory"} 0.16',
        'deepinfer:kv_store_read_bytes_total{model_name="m",tier="disk"} 30.0',
        'deepinfer:kv_store_written_bytes_total{model_name="m",tier="memory"} 20.0',
        'deepinfer:kv_store_evictions_total{model_name="m",tier="memory"} 2.0',
        'deepinfer:kv_store_expired_total{model_name="m",tier="disk"} 4.0',
        'deepinfer:kv_store_errors_total{kind="io_errors",model_name="m",tier="disk"} 2.0',
        'deepinfer:kv_store_loaded_tokens_total{model_name="m"} 48.0',
        'deepinfer:kv_store_failed_loads_total{model_name="m"} 1.0',
        'deepinfer:kv_store_saves_dropped_total{model_name="m"} 1.0',
    ):
        assert line in text, line


def test_no_store_no_store_metrics() -> None:
    assert "kv_store" not in ServerMetrics(lambda: engine_stats(None), "m").render().decode()
