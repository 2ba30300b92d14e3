"""Prometheus metrics under vLLM's names (dashboards expect the `vllm:` prefix), one registry per app.

Engine-wide numbers (queue lengths, KV usage, token and preemption counts) are read from the
engine's latest stats snapshot at scrape time; per-request latencies are observed as outputs arrive.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.outputs import RequestOutput

if TYPE_CHECKING:
    from deepinfer.engine.engine import EngineStats
    from deepinfer.kvstore.base import TierStats
    from deepinfer.kvstore.connector import KVStoreConnectorStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for it read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        if s is None:
            return []
        labels = (["model_name"], [self._model])

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=labels[0])
            family.add_metric(labels[1], value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels[0])
            family.add_metric(labels[1], value)
            return family

        return [
            gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running),
            gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage),
            gauge("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc for older dashboards.", s.kv_usage),
            gauge("vllm:num_kv_blocks", "KV-cache blocks allocated at start-up.", s.num_blocks),
            counter("vllm:num_preemptions", "Preemptions (a running sequence evicted and recomputed later).",
                    s.num_preemptions),
            counter("vllm:prompt_tokens", "Prompt tokens accepted (times n).", s.prompt_tokens),
            counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens),
            counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            *_kv_store_metrics(s.kv_store, self._model),
        ]


def _kv_store_metrics(kv: KVStoreConnectorStats | None, model: str) -> list[Metric]:
    """The external KV store, per tier (memory, disk, redis): hit tokens and rate, bytes, evictions, errors."""
    if kv is None:
        return []
    tier_names = ["model_name", "tier"]

    def per_tier(kind: type, name: str, doc: str, value: Callable[[TierStats], float]) -> Metric:
        family = kind(name, doc, labels=tier_names)
        for tier in kv.tiers:
            family.add_metric([model, tier.name], value(tier))
        return family

    errors = CounterMetricFamily("deepinfer:kv_store_errors", "KV store faults, each treated as a miss or a lost save.",
                                 labels=[*tier_names, "kind"])
    for tier in kv.tiers:
        for kind in ("corrupt", "io_errors", "connection_errors"):
            errors.add_metric([model, tier.name, kind], getattr(tier, kind))
    totals = [
        ("deepinfer:kv_store_lookup_tokens", "Prompt tokens of admitted requests (the hit rates' denominator).",
         kv.lookup_tokens),
        ("deepinfer:kv_store_loaded_tokens", "Prompt tokens loaded from the KV store instead of computed.",
         kv.loaded_tokens),
        ("deepinfer:kv_store_failed_loads", "Blocks the store listed but could not deliver intact (recomputed).",
         kv.failed_blocks),
        ("deepinfer:kv_store_saves", "Blocks handed to the store's background saver.", kv.saves.queued),
        ("deepinfer:kv_store_saves_dropped", "Blocks not saved because the save queue was full.", kv.saves.dropped),
    ]
    out: list[Metric] = []
    for name, doc, value in totals:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        out.append(family)
    return out + [
        per_tier(CounterMetricFamily, "deepinfer:kv_store_hit_tokens", "Prompt tokens loaded from this tier.",
                 lambda t: t.hits * kv.block_size),
        per_tier(GaugeMetricFamily, "deepinfer:kv_store_hit_rate", "Share of looked-up prompt tokens loaded from this tier.",
                 lambda t: kv.hit_rate(t.name)),
        per_tier(CounterMetricFamily, "deepinfer:kv_store_read_bytes", "Payload bytes read.", lambda t: t.bytes_read),
        per_tier(CounterMetricFamily, "deepinfer:kv_store_written_bytes", "Payload bytes written.",
                 lambda t: t.bytes_written),
        per_tier(CounterMetricFamily, "deepinfer:kv_store_evictions", "Blocks evicted for capacity.", lambda t: t.evictions),
        per_tier(CounterMetricFamily, "deepinfer:kv_store_expired", "Blocks found past their TTL and reclaimed.",
                 lambda t: t.expired),
        errors,
    ]


class ServerMetrics:
    """One app's registry; tracker() times one request from its outputs."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name))
        self._model = model_name
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                              ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                              ["model_name"], buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests that ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._http = Counter("deepinfer:http_errors", "Requests answered with an error, by status code.",
                             ["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self, status: int) -> None:
        self._http.labels(str(status)).inc()

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Feeds the latency histograms from one request's cumulative outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._tokens = 0
        self._last_time: float | None = None
        self._ended = False

    def update(self, out: RequestOutput) -> None:
        m = out.metrics
        tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        if tokens > self._tokens:
            stamp = m.last_token_time or time.time()
            if self._last_time is None:
                if m.first_token_time is not None:
                    self._m._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                # first_token_time marks the first token; the rest of this batch arrived with it
                self._last_time = m.first_token_time or stamp
                new = tokens - 1
            else:
                new = tokens - self._tokens
            for _ in range(new):
                self._m._itl.observe(max(0.0, (stamp - self._last_time) / max(new, 1)))
            self._last_time, self._tokens = stamp, tokens
        if out.finished and not self._ended:
            self._ended = True
            end = m.finished_time or time.time()
            self._m._e2e.observe(max(0.0, end - m.arrival_time))
            for choice in out.outputs:
                self._m._success.labels(self._m._model, choice.finish_reason or "abort").inc()

    def abandon(self) -> None:
        """The request ended without a finished output (client gone, drain timeout, error)."""
        if not self._ended:
            self._ended = True
            self._m._success.labels(self._m._model, "abort").inc()
