"""Which replica serves a request: a pure function of the request's block-key chain and each replica's reported
load and cached block keys. No I/O; the router owns the states and the round-robin counter.

Policies:
- round_robin: the healthy replicas in turn.
- least_load: the lowest estimated time to first token (TTFT), caches ignored.
- cache_aware: the lowest score = estimated TTFT given the longest prefix of the request's keys the replica holds
  + (cache_weight - 1) x the prefill seconds the request adds there (a miss also costs the cluster)
  + recent_weight x how much more prefill work the router sent there lately than to the least loaded replica.
  The TTFT and recent-work terms make a hot prefix spill over to other replicas instead of queueing on its
  holder (the known failure of affinity-first routing). Before scoring, a balance window drops replicas whose
  wait exceeds the least loaded one's by more than balance_abs_s plus what their cached prefix saves, and which
  are more than balance_rel times as loaded. Prior art: SGLang's cache-aware router (prefix match unless loads
  diverge past absolute and relative thresholds) and Mooncake's Conductor (the instance with the lowest TTFT
  estimate given its prefix hit and its queue).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from deepinfer.core.prefix_cache import extend_block_keys, root_key

POLICIES = ("cache_aware", "least_load", "round_robin")
REASONS = ("cache_hit", "load_balance", "round_robin", "least_load")
_SHARD_BITS = 12


class NoHealthyReplica(RuntimeError):
    """No replica is healthy (or there are none): the router answers 503."""


class DigestGap(ValueError):
    """A replica report skipped a sequence number: the router's key set may be stale; ask for a snapshot."""


def request_block_keys(token_ids: Sequence[int], model_key: str, cache_salt: str | None,
                       block_size: int) -> list[bytes]:
    """The request's prefix-cache keys, one per full block: the chain the engines compute (core/prefix_cache)."""
    keys: list[bytes] = []
    extend_block_keys(keys, root_key(model_key, cache_salt), list(token_ids), block_size)
    return keys


def attention_pairs(start: int, end: int) -> int:
    """(query, key) pairs of causal attention for computing positions start..end-1 after `start` cached tokens."""
    return (end * (end + 1) - start * (start + 1)) // 2


def _shard(key: bytes) -> int:
    # block keys are uniform blake2b digests, so their first 12 bits spread them evenly over the shards
    return (key[0] << 4) | (key[1] >> 4)


@dataclass(frozen=True, eq=False)
class BlockKeySet:
    """An immutable set of block keys in 4096 shards by their first 12 bits. An update of k keys copies only the
    shards it touches (size/4096 keys each) and one tuple of pointers, so the set of a replica holding 100k blocks
    follows its incremental reports without copying 100k keys each time."""

    shards: tuple[frozenset[bytes], ...] = (frozenset(),) * (1 << _SHARD_BITS)
    size: int = 0

    @classmethod
    def of(cls, keys: Iterable[bytes]) -> BlockKeySet:
        return cls().updated(added=keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self.shards[_shard(key)]

    def __len__(self) -> int:
        return self.size

    def updated(self, added: Iterable[bytes] = (), evicted: Iterable[bytes] = ()) -> BlockKeySet:
        """A new set: `evicted` removed, then `added` inserted (a key in both stays)."""
        changes: dict[int, tuple[set[bytes], set[bytes]]] = {}
        for key in evicted:
            changes.setdefault(_shard(key), (set(), set()))[1].add(key)
        for key in added:
            changes.setdefault(_shard(key), (set(), set()))[0].add(key)
        if not changes:
            return self
        shards, size = list(self.shards), self.size
        for i, (add, drop) in changes.items():
            new = (shards[i] - drop) | add
            size += len(new) - len(shards[i])
            shards[i] = new
        return BlockKeySet(tuple(shards), size)

    def matched_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain the set holds; blocks after the first miss cannot be reused."""
        shards = self.shards
        for n, key in enumerate(keys):
            if key not in shards[(key[0] << 4) | (key[1] >> 4)]:  # _shard inlined: the router's hot loop
                return n
        return len(keys)


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica sends the router periodically: its load now and how its cached block keys changed since its
    previous report (a diff: a replica holding 100k blocks sends what it added and evicted, not the set).
    `seq` counts reports from 1; `snapshot` replaces the whole set with `added` (the first report, or the answer
    to a DigestGap)."""

    seq: int
    queued_prefill_tokens: int = 0
    queued_prefill_pairs: int = 0
    running_requests: int = 0
    running_context_tokens: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    added: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    snapshot: bool = False


@dataclass(frozen=True)
class ReplicaState:
    """The router's view of one replica, as of its last report plus what was routed to it since."""

    replica_id: str
    url: str = ""
    queued_prefill_tokens: int = 0  # prompt tokens waiting or admitted but not yet computed
    queued_prefill_pairs: int = 0  # their attention (query, key) pairs: long contexts cost more per token
    running_requests: int = 0  # requests past their prefill: each adds decode work to every step
    running_context_tokens: int = 0  # tokens their decode steps attend over
    waiting_requests: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests (cached-but-free blocks do not count)
    healthy: bool = True
    # prefill seconds the router sent here lately: each decision adds its work and every replica's value decays
    # by RoutingConfig.decay(), so it spans about recent_decisions decisions (the router's own bookkeeping)
    recent_work_s: float = 0.0
    blocks: BlockKeySet = BlockKeySet()
    seq: int = 0  # the last report applied

    def __post_init__(self) -> None:
        for name in ("queued_prefill_tokens", "queued_prefill_pairs", "running_requests", "running_context_tokens",
                     "waiting_requests", "seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"replica {self.replica_id!r}: {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"replica {self.replica_id!r}: kv_usage must be in [0, 1], got {self.kv_usage}")

    def apply(self, report: ReplicaReport) -> ReplicaState:
        """The state after a report; raises DigestGap if a diff report does not follow the last one applied."""
        if not report.snapshot and report.seq != self.seq + 1:
            raise DigestGap(f"replica {self.replica_id!r} sent report {report.seq} after {self.seq}; "
                            f"ask it for a snapshot")
        blocks = BlockKeySet.of(report.added) if report.snapshot else self.blocks.updated(report.added, report.evicted)
        return replace(self, queued_prefill_tokens=report.queued_prefill_tokens,
                       queued_prefill_pairs=report.queued_prefill_pairs, running_requests=report.running_requests,
                       running_context_tokens=report.running_context_tokens, waiting_requests=report.waiting_requests,
                       kv_usage=report.kv_usage, blocks=blocks, seq=report.seq)

    def with_routed(self, keys: Sequence[bytes], num_prompt_tokens: int, decision: Decision,
                    block_size: int) -> ReplicaState:
        """The optimistic view right after routing a request here, until the next report: its uncached tokens are
        queued and its keys count as held, so a burst sharing a prefix follows the first request. A key that
        never gets computed (an aborted request) stays until the replica's next snapshot."""
        cached = _cached_tokens(decision.matched_blocks, num_prompt_tokens, block_size)
        return replace(self, queued_prefill_tokens=self.queued_prefill_tokens + num_prompt_tokens - cached,
                       queued_prefill_pairs=self.queued_prefill_pairs + attention_pairs(cached, num_prompt_tokens),
                       waiting_requests=self.waiting_requests + 1, recent_work_s=self.recent_work_s + decision.work_s,
                       blocks=self.blocks.updated(keys[decision.matched_blocks:]))

    def decayed(self, factor: float) -> ReplicaState:
        return replace(self, recent_work_s=self.recent_work_s * factor)


@dataclass(frozen=True)
class CostModel:
    """Seconds one engine step takes, linear in what it computes (fitted by benchmarks/calibrate_cost.py):

        step = step_s + prefill_token_s * prefill tokens + attention_pair_s * their (query, key) pairs
               + decode_request_s * decoding requests + decode_context_s * tokens those requests attend over

    max_batch_tokens is the replica's token budget per step (max_num_batched_tokens)."""

    step_s: float
    prefill_token_s: float
    attention_pair_s: float
    decode_request_s: float
    decode_context_s: float
    max_batch_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("step_s", "prefill_token_s", "attention_pair_s", "decode_request_s", "decode_context_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model {name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        names = ("step_s", "prefill_token_s", "attention_pair_s", "decode_request_s", "decode_context_s",
                 "max_batch_tokens")
        missing = [n for n in names[:-1] if n not in data]
        if missing:
            raise ValueError(f"cost model is missing {missing}; expected the fields {names}")
        return cls(**{n: data[n] for n in names if n in data})

    def step_seconds(self, prefill_tokens: int, prefill_pairs: int, decode_requests: int, decode_context: int) -> float:
        return (self.step_s + self.prefill_token_s * prefill_tokens + self.attention_pair_s * prefill_pairs
                + self.decode_request_s * decode_requests + self.decode_context_s * decode_context)

    def prefill_work(self, tokens: int, pairs: int) -> float:
        """Seconds of compute for prompt tokens alone, without step overheads or decoding neighbours."""
        return self.prefill_token_s * tokens + self.attention_pair_s * pairs


@dataclass(frozen=True)
class RoutingConfig:
    """cache_aware's knobs, tuned with benchmarks/router_sim.py:

    - cache_weight: a miss is charged this many times its prefill seconds (1: this request's TTFT only; more: the
      cluster's time as well, which the prefix would have saved);
    - recent_weight: score seconds per second of recent_work_s above the replica with the least, so a
      conversation moves once its replica has had clearly more work lately than the others;
    - recent_decisions: about how many decisions recent_work_s spans (see decay);
    - balance_abs_s, balance_rel: the balance window (module docstring), seconds of the deployment's cost model;
    - max_kv_usage: replicas whose KV is fuller are skipped while others are not;
    - block_size: tokens per key of the request's chain (the engine's block size).
    """

    cache_weight: float = 32.0
    recent_weight: float = 0.3
    recent_decisions: int = 2048
    # a TTFT guard, not a throughput tool: in the simulator every window that triggers moves long conversations
    # off the replica holding their prefix and costs more work than it balances, so keep it wide
    balance_abs_s: float = 60.0
    balance_rel: float = 1.5
    max_kv_usage: float = 0.95
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.cache_weight < 0 or self.recent_weight < 0 or self.balance_abs_s < 0 or self.balance_rel < 1:
            raise ValueError(f"need cache_weight, recent_weight, balance_abs_s >= 0 and balance_rel >= 1, got {self}")
        if not 0 < self.max_kv_usage <= 1 or self.block_size < 1 or self.recent_decisions < 1:
            raise ValueError(f"need 0 < max_kv_usage <= 1, block_size >= 1 and recent_decisions >= 1, got {self}")

    def decay(self) -> float:
        """The factor the router applies to every replica's recent_work_s after each decision."""
        return 1.0 - 1.0 / self.recent_decisions


@dataclass(frozen=True)
class Decision:
    index: int  # into the replicas passed to pick
    reason: str  # one of REASONS
    matched_blocks: int  # leading request keys the chosen replica holds
    work_s: float  # the prefill seconds this request adds there (its uncached part)
    estimated_ttft_s: float | None = None  # None for round_robin


def _cached_tokens(matched_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    # the engine always computes the last prompt token (its logits start the output)
    return max(0, min(matched_blocks * block_size, num_prompt_tokens - 1))


def load_seconds(replica: ReplicaState, cost: CostModel) -> float:
    """Estimated seconds before a new request's prefill can start: the queued prefill, in steps that also decode
    the running requests (at least one step)."""
    per_step = cost.step_seconds(0, 0, replica.running_requests, replica.running_context_tokens)
    steps = max(1.0, replica.queued_prefill_tokens / cost.max_batch_tokens)
    return cost.prefill_work(replica.queued_prefill_tokens, replica.queued_prefill_pairs) + steps * per_step


def estimate_ttft(replica: ReplicaState, num_prompt_tokens: int, cached_tokens: int, cost: CostModel) -> float:
    """Queue wait plus this request's own uncached prefill, all in steps shared with the running decodes."""
    queued = replica.queued_prefill_tokens + num_prompt_tokens - cached_tokens
    per_step = cost.step_seconds(0, 0, replica.running_requests, replica.running_context_tokens)
    work = cost.prefill_work(queued, replica.queued_prefill_pairs + attention_pairs(cached_tokens, num_prompt_tokens))
    return work + max(1.0, queued / cost.max_batch_tokens) * per_step


def pick(request_keys: Sequence[bytes], num_prompt_tokens: int, replicas: Sequence[ReplicaState], cost: CostModel,
         policy: str = "cache_aware", *, counter: int = 0, config: RoutingConfig = RoutingConfig()) -> Decision:
    """Chooses a healthy replica for a request (its key chain and prompt length); ties go to the lowest index.
    `counter` drives round_robin: the caller passes how many requests it has routed so far."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_prompt_tokens < 1:
        raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
    healthy = [i for i, r in enumerate(replicas) if r.healthy]
    if not healthy:
        raise NoHealthyReplica(f"none of the {len(replicas)} replicas is healthy")

    def work(matched: int) -> float:
        cached = _cached_tokens(matched, num_prompt_tokens, config.block_size)
        return cost.prefill_work(num_prompt_tokens - cached, attention_pairs(cached, num_prompt_tokens))

    matched = {i: replicas[i].blocks.matched_prefix(request_keys) for i in healthy}
    if policy == "round_robin":
        i = healthy[counter % len(healthy)]
        return Decision(i, "round_robin", matched[i], work(matched[i]))

    if policy == "least_load":
        ttft = {i: estimate_ttft(replicas[i], num_prompt_tokens, 0, cost) for i in healthy}
        i = min(healthy, key=lambda i: (ttft[i], i))
        return Decision(i, "least_load", matched[i], work(matched[i]), ttft[i])

    cold = work(0)
    least_recent = min(replicas[i].recent_work_s for i in healthy)
    ttft, added, score = {}, {}, {}
    for i in healthy:
        ttft[i] = estimate_ttft(replicas[i], num_prompt_tokens, _cached_tokens(matched[i], num_prompt_tokens,
                                                                               config.block_size), cost)
        added[i] = work(matched[i])
        score[i] = (ttft[i] + (config.cache_weight - 1.0) * added[i]
                    + config.recent_weight * (replicas[i].recent_work_s - least_recent))
    load = {i: load_seconds(replicas[i], cost) for i in healthy}
    floor = min(load.values())
    # the balance window: a replica whose wait exceeds the least loaded one's by more than balance_abs_s plus what
    # its cached prefix saves this request (waiting there takes longer than recomputing elsewhere), and which is
    # more than balance_rel times as loaded, is no candidate
    balanced = [i for i in healthy if load[i] - floor <= config.balance_abs_s + cold - added[i]
                or load[i] <= config.balance_rel * floor]
    # every balanced replica past the KV limit: the balance window alone (the least loaded is always in it)
    candidates = [i for i in balanced if replicas[i].kv_usage < config.max_kv_usage] or balanced
    # exact ties (idle replicas, no prefix anywhere): the replica holding fewer blocks, like SGLang's smallest tree
    best = min(candidates, key=lambda i: (score[i], len(replicas[i].blocks), i))
    preferred = min(healthy, key=lambda i: (score[i], len(replicas[i].blocks), i))
    reason = "cache_hit" if matched[best] and best == preferred else "load_balance"
    return Decision(best, reason, matched[best], added[best], ttft[best])
