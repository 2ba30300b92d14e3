"""Prometheus metrics under vLLM's names (dashboards expect the `vllm:` prefix), one registry per app.

Engine-wide numbers (queue lengths, KV usage, token and preemption counts) are read from the
engine's latest stats snapshot at scrape time; per-request latencies are observed as outputs arrive.
VLLM_DASHBOARD_METRICS lists what vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana) reads.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.outputs import RequestOutput
from deepinfer.disagg.metrics import handoff_metrics
from deepinfer.sampling_params import SamplingParams

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
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 series, to 5 million tokens
N_BUCKETS = (1, 2, 5, 10, 20)

VLLM_DASHBOARD_METRICS = (
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_success_total", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str,
                 step_failures: Callable[[], int]) -> None:
        self._stats = stats
        self._model = model_name
        self._step_failures = step_failures

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
            counter("deepinfer:engine_step_failures", "Engine steps that raised; each aborted every request in flight.",
                    self._step_failures()),
            *_kv_store_metrics(s.kv_store, self._model),
            *_spec_and_moe_metrics(s, self._model),
            *handoff_metrics(getattr(s, "handoff", None), self._model),
        ]


def _spec_and_moe_metrics(s: EngineStats, model: str) -> list[Metric]:
    """Speculative decoding with vLLM's vllm:spec_decode_* names (drafts, draft tokens, accepted tokens, accepted
    per draft position), and expert parallelism's balance (deepinfer:moe_lb and the EPLB counters)."""
    out: list[Metric] = []
    spec = getattr(s, "spec_decode", None)
    if spec is not None:
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Verified steps that carried drafts.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            out.append(family)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position.", labels=["model_name", "position"])
        for i, accepted in enumerate(spec.accepted_per_position):
            per_pos.add_metric([model, str(i)], accepted)
        out.append(per_pos)
    moe = getattr(s, "moe_load", None)
    if moe is not None:
        for name, doc, value, kind in (
                ("deepinfer:moe_lb", "Busiest rank's expert rows over the mean, mean over MoE layers (1 = balanced).",
                 moe.moe_lb, GaugeMetricFamily),
                ("deepinfer:moe_lb_worst_layer", "moe_lb of the worst MoE layer.", moe.moe_lb_worst, GaugeMetricFamily),
                ("deepinfer:ep_exchange_bytes_per_step", "Bytes one rank receives per step for the expert combine.",
                 moe.exchange_bytes_per_step, GaugeMetricFamily),
                ("deepinfer:eplb_longest_move_seconds", "Longest pause of an expert-weight move.", moe.longest_move_s,
                 GaugeMetricFamily),
                ("deepinfer:eplb_rebalances", "Expert placements applied.", moe.rebalances, CounterMetricFamily),
                ("deepinfer:eplb_experts_moved", "Expert slots whose weights moved.", moe.experts_moved,
                 CounterMetricFamily)):
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            out.append(family)
    return out


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

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str,
                 step_failures: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name, step_failures))
        self._model = model_name
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                              ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                              ["model_name"], buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._tpot = Histogram("vllm:time_per_output_token_seconds", "Alias of vllm:inter_token_latency_seconds "
                               "(the name older vLLM dashboards read).", ["model_name"], buckets=ITL_BUCKETS,
                               registry=self.registry).labels(model_name)

        def per_request(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self._queue = per_request("vllm:request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self._prefill = per_request("vllm:request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS)
        self._decode = per_request("vllm:request_decode_time_seconds", "First token to last token.", E2E_BUCKETS)
        self._inference = per_request("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                      E2E_BUCKETS)
        self._prompt_len = per_request("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                                       TOKEN_BUCKETS)
        self._generation_len = per_request("vllm:request_generation_tokens",
                                           "Tokens generated by each finished request (all its n sequences).",
                                           TOKEN_BUCKETS)
        self._max_generation = per_request("vllm:request_max_num_generation_tokens",
                                           "Longest of a finished request's n sequences, in tokens.", TOKEN_BUCKETS)
        self._param_n = per_request("vllm:request_params_n", "The n of each finished request.", N_BUCKETS)
        self._param_max_tokens = per_request("vllm:request_params_max_tokens",
                                             "The max_tokens of each finished request that set one.", TOKEN_BUCKETS)
        self._success = Counter("vllm:request_success", "Requests that ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._http = Counter("deepinfer:http_errors", "Requests answered with an error, by status code.",
                             ["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self, status: int) -> None:
        self._http.labels(str(status)).inc()

    def tracker(self, params: SamplingParams | None = None) -> RequestTracker:
        return RequestTracker(self, params)


class RequestTracker:
    """Feeds the latency histograms from one request's outputs: cumulative, or deltas (params.output_kind)."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self._m = metrics
        self._params = params
        self._delta = params is not None and params.output_kind == "delta"
        self._lengths: dict[int, int] = {}  # per sequence: its tokens so far
        self._tokens = 0
        self._last_time: float | None = None
        self._ended = False

    def update(self, out: RequestOutput) -> None:
        m = out.metrics
        for choice in out.outputs:
            seen = self._lengths.get(choice.index, 0) if self._delta else 0
            self._lengths[choice.index] = seen + len(choice.token_ids)
        tokens = self._lengths.get(out.outputs[0].index, 0) if out.outputs else 0
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
                gap = max(0.0, (stamp - self._last_time) / max(new, 1))
                self._m._itl.observe(gap)
                self._m._tpot.observe(gap)
            self._last_time, self._tokens = stamp, tokens
        if out.finished and not self._ended:
            self._ended = True
            end = m.finished_time or time.time()
            self._m._e2e.observe(max(0.0, end - m.arrival_time))
            for choice in out.outputs:
                self._m._success.labels(self._m._model, choice.finish_reason or "abort").inc()
            self._finished(out, end)

    def _finished(self, out: RequestOutput, end: float) -> None:
        m, metrics = out.metrics, self._m
        lengths = [self._lengths.get(choice.index, 0) for choice in out.outputs] or [0]
        metrics._prompt_len.observe(len(out.prompt_token_ids))
        metrics._generation_len.observe(sum(lengths))
        metrics._max_generation.observe(max(lengths))
        if self._params is not None:
            metrics._param_n.observe(self._params.n)
            if self._params.max_tokens is not None:
                metrics._param_max_tokens.observe(self._params.max_tokens)
        if m.first_scheduled_time is not None:
            metrics._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            last = m.last_token_time or end
            metrics._inference.observe(max(0.0, last - m.first_scheduled_time))
            if m.first_token_time is not None:
                metrics._prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                metrics._decode.observe(max(0.0, last - m.first_token_time))

    def abandon(self) -> None:
        """The request ended without a finished output (client gone, drain timeout, error)."""
        if not self._ended:
            self._ended = True
            self._m._success.labels(self._m._model, "abort").inc()
