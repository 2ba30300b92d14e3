"""The router's Prometheus metrics, one registry per app: decisions by reason, retries and failures as they happen;
each replica's health, load and prefix-cache hit rate read from the router's view at scrape time."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.router.policy import Decision

if TYPE_CHECKING:
    from deepinfer.router.replica import Replica
    from deepinfer.router.router import Router

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RETRY_CAUSES = ("unavailable", "lost")  # answered 502/503/504; unreachable or lost before the answer began
FAILURES = ("no_replica", "attempts_exhausted", "lost_while_streaming")
# disaggregation: prefilled on a prefill replica and handed off; sent whole to a decode replica because the hand-off
# does not cover it (n > 1, several prompts, echo, a grammar) or because no prefill replica answered
HANDOFFS = ("handed_off", "whole_unsupported", "whole_no_prefill")


class _ReplicaCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterable[Metric]:
        names = ["pool", "replica"]
        gauges = {
            "routable": ("1 while the replica is in the rotation (healthy, reporting, serving the pool's model).",
                         lambda r: float(r.routable)),
            "queued_prefill_tokens": ("Prompt tokens waiting or admitted but not computed (replica report plus "
                                      "what was routed since).", lambda r: r.state.queued_prefill_tokens),
            "running_requests": ("Sequences past their prefill.", lambda r: r.state.running_requests),
            "waiting_requests": ("Sequences waiting to be scheduled.", lambda r: r.state.waiting_requests),
            "kv_usage": ("Fraction of KV blocks held by requests.", lambda r: r.state.kv_usage),
            "cached_blocks": ("Block keys the router believes the replica holds.", lambda r: len(r.state.blocks)),
            "in_flight": ("Requests the router is forwarding to the replica now.", lambda r: r.in_flight),
            "prefix_cache_hit_rate": ("The replica's own prefix-cache hit rate (hit / looked-up prompt tokens).",
                                      lambda r: r.prefix_hits / r.prefix_queries if r.prefix_queries else 0.0),
        }
        out: list[Metric] = []
        replicas = self._router.replicas
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"deepinfer:router_replica_{name}", doc, labels=names)
            for r in replicas:
                family.add_metric([r.role, r.url], value(r))
            out.append(family)
        health = GaugeMetricFamily("deepinfer:router_replica_health", "1 for the replica's current health state.",
                                   labels=[*names, "state"])
        for r in replicas:
            health.add_metric([r.role, r.url, r.health], 1.0)
        out.append(health)
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens the replica looked up in its prefix cache.",
                 lambda r: r.prefix_queries),
                ("prefix_cache_hits", "Prompt tokens the replica found in its prefix cache.", lambda r: r.prefix_hits)):
            family = CounterMetricFamily(f"deepinfer:router_replica_{name}", doc, labels=names)
            for r in replicas:
                family.add_metric([r.role, r.url], value(r))
            out.append(family)
        return out


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(router))
        r = self.registry
        self._decisions = Counter("deepinfer:router_decisions", "Requests routed, by replica and the policy's reason.",
                                  ["pool", "replica", "reason"], registry=r)
        self._prompt = Counter("deepinfer:router_prompt_tokens", "Prompt tokens (first prompt) routed to the replica.",
                               ["pool", "replica"], registry=r)
        self._matched = Counter("deepinfer:router_matched_tokens", "Of those, tokens in blocks the router expected "
                                "the replica to hold (its predicted hit).", ["pool", "replica"], registry=r)
        self._retries = Counter("deepinfer:router_retries", "Requests sent to another replica, by the replica that "
                                "failed and why (none had started streaming).", ["pool", "replica", "cause"],
                                registry=r)
        self._handoffs = Counter("deepinfer:router_handoffs", "Disaggregated requests by path: prefilled and handed "
                                 "off, or sent whole to a decode replica (unsupported by the hand-off, or no prefill "
                                 "replica answered).", ["outcome"], registry=r)
        self._failures = Counter("deepinfer:router_failures", "Requests that ended in an error the router made: no "
                                 "replica, every attempt failed, or the replica was lost while streaming.",
                                 ["pool", "kind"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def decision(self, replica: Replica, decision: Decision, prompt_tokens: int, block_size: int) -> None:
        self._decisions.labels(replica.role, replica.url, decision.reason).inc()
        self._prompt.labels(replica.role, replica.url).inc(prompt_tokens)
        # the engine always computes the last prompt token
        matched = min(decision.matched_blocks * block_size, max(0, prompt_tokens - 1))
        self._matched.labels(replica.role, replica.url).inc(matched)

    def retry(self, replica: Replica, cause: str) -> None:
        self._retries.labels(replica.role, replica.url, cause).inc()

    def handoff(self, outcome: str) -> None:
        self._handoffs.labels(outcome).inc()

    def failure(self, pool: str, kind: str) -> None:
        self._failures.labels(pool, kind).inc()
