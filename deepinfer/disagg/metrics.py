"""Prometheus families for the KV hand-offs of a prefill or a decode engine (server/metrics.py adds them)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from deepinfer.disagg.stats import HandoffStats, Histogram


def handoff_metrics(stats: HandoffStats | None, model: str) -> list[Metric]:
    if stats is None:
        return []
    labels = ["model_name", "role"]
    values = [model, stats.role]
    outcomes = CounterMetricFamily("deepinfer:kv_handoffs", "Prefill: hand-offs answered, by how they ended (offered, "
                                   "pulled, released by a decode engine that needed none, expired unpulled); decode: "
                                   "requests that arrived with one (remote), their KV arrived whole (received) or the "
                                   "prompt was computed here (fallback).", labels=[*labels, "outcome"])
    for outcome, value in (("offered", stats.offered), ("pulled", stats.pulled), ("released", stats.released),
                           ("expired", stats.expired), ("remote", stats.remote_requests),
                           ("received", stats.received), ("fallback", stats.fallbacks)):
        outcomes.add_metric([*values, outcome], value)
    fallbacks = CounterMetricFamily("deepinfer:kv_handoff_fallbacks", "Decode: requests whose prompt KV did not "
                                    "arrive whole in time (or was for other tokens), computed here instead.",
                                    labels=labels)
    fallbacks.add_metric(values, stats.fallbacks)
    held = GaugeMetricFamily("deepinfer:kv_handoff_held_blocks", "Prefill: KV blocks held for decode engines now.",
                             labels=labels)
    held.add_metric(values, stats.held_blocks)
    offer = CounterMetricFamily("deepinfer:kv_handoff_offer_seconds", "Prefill: seconds spent making hand-offs ready "
                                "after their prefill (the store path waits for the store to take the blocks).",
                                labels=labels)
    offer.add_metric(values, stats.offer_seconds)
    received = CounterMetricFamily("deepinfer:kv_handoff_received_bytes", "Decode: KV bytes pulled from prefill "
                                   "engines.", labels=labels)
    received.add_metric(values, stats.received_bytes)
    seconds = CounterMetricFamily("deepinfer:kv_handoff_transfer_seconds", "Decode: seconds pulls were in flight, "
                                  "summed; the KV transfer throughput is received_bytes / transfer_seconds.",
                                  labels=labels)
    seconds.add_metric(values, stats.transfer_seconds)
    throughput = GaugeMetricFamily("deepinfer:kv_handoff_throughput_bytes_per_second", "Decode: KV bytes pulled per "
                                   "second of pulling, since start-up.", labels=labels)
    throughput.add_metric(values, stats.received_bytes / stats.transfer_seconds if stats.transfer_seconds else 0.0)
    return [outcomes, fallbacks, held, offer, received, seconds, throughput,
            _histogram("deepinfer:kv_handoff_latency_seconds", "Decode: a request's arrival to its prompt KV in this "
                       "engine's cache (or given up).", stats.latency, labels, values),
            _histogram("deepinfer:kv_handoff_bytes", "Prefill: KV bytes per hand-off (served directly, or saved to the "
                       "store).", stats.sent_bytes, labels, values)]


def _histogram(name: str, doc: str, h: Histogram | None, labels: list[str], values: list[str]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    if h is not None:
        buckets = [(_bound(b), c) for b, c in zip(h.bounds, h.counts)] + [("+Inf", h.count)]
        family.add_metric(values, buckets, h.total)
    return family


def _bound(value: float) -> str:
    return str(float(value))
