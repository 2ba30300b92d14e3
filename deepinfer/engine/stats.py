"""What an engine reports about itself: counters for /metrics and the offline stats, and a router's load view."""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.block_pool import KeyEvents
from deepinfer.core.kv_manager import ReplayStats
from deepinfer.core.spec import SpecDecodeStats
from deepinfer.engine.handoff import HandoffStats
from deepinfer.kvstore.connector import KVStoreConnectorStats
from deepinfer.worker.ep_executor import MoELoadStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_store: KVStoreConnectorStats | None = None  # None: no KV store configured
    prefix_replay: ReplayStats | None = None  # sliding-window hybrids: hits shortened by dropped window KV
    peak_kv_blocks: int = 0  # most blocks held by requests at once since start-up
    moe_load: MoELoadStats | None = None  # expert parallelism only: moe_lb over the last moe_lb_window steps
    spec_decode: SpecDecodeStats | None = None  # speculative decoding only: drafted and accepted tokens
    handoff: HandoffStats | None = None  # prefill and decode roles only: KV hand-offs


@dataclass(frozen=True)
class ReplicaStatus:
    """What a router needs of this engine (router/policy.py: ReplicaReport): its load now and its cached keys."""

    queued_prefill_tokens: int  # prompt tokens waiting or admitted but not yet computed
    queued_prefill_pairs: int  # their causal attention (query, key) pairs
    running_requests: int  # sequences past their prefill
    running_context_tokens: int  # tokens those attend over
    waiting_requests: int
    kv_usage: float
    stats: EngineStats
    keys: KeyEvents  # the first layer group's block keys, a diff or a snapshot
    model_key: str  # the root of every key chain (core/prefix_cache.root_key), with block_size
    block_size: int
