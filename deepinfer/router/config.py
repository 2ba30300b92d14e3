"""The router's configuration, resolved once: its pools of replicas (one per role), how it probes them and retries.

A pool is the unit the router routes within: every replica in it serves the same model with the same block size,
and a request goes to pools by their roles. Either one `both` pool (replicas that prefill and decode), or a `prefill`
and a `decode` pool (disaggregated serving, router/handoff.py): a request is prefilled on one replica of the first and
decoded on one of the second, each pool with its own policy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from deepinfer.router.policy import POLICIES, CostModel, RoutingConfig

ROLES = ("both", "prefill", "decode")
DEPLOYMENTS = ({"both"}, {"prefill", "decode"})  # the sets of pools a router serves

# Measured by `python benchmarks/calibrate_cost.py` (bundled SmolLM2-135M, float32, 2 threads) on a shared 2-core VM
# with load average 6.3 at the start and 8.1 at the end (other jobs running): steps vary up to 5x between tries and
# the fit is good to about +-30%. Another model or machine: calibrate and pass --cost-model.
DEFAULT_COST = CostModel(step_s=0.1238, prefill_token_s=0.003826, attention_pair_s=2.014e-06,
                         decode_request_s=0.01459, decode_context_s=1.78e-06, max_batch_tokens=2048)


def normalize_url(url: str) -> str:
    """http(s)://host:port without a trailing slash; raises ValueError naming the bad address."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"replica address {url!r} must look like http://HOST:PORT (no path)")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"replica address {url!r} has a bad port") from None
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class PoolConfig:
    role: str
    urls: tuple[str, ...]
    policy: str = "cache_aware"
    routing: RoutingConfig = RoutingConfig()  # block_size is replaced by what the replicas report
    cost: CostModel = DEFAULT_COST

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pool role must be one of {ROLES}, got {self.role!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.urls:
            raise ValueError(f"the {self.role!r} pool has no replicas; give at least one --replica URL")
        urls = tuple(normalize_url(u) for u in self.urls)
        if len(set(urls)) != len(urls):
            raise ValueError(f"the {self.role!r} pool lists a replica twice: {list(urls)}")
        object.__setattr__(self, "urls", urls)


@dataclass(frozen=True)
class RouterConfig:
    pools: tuple[PoolConfig, ...]
    model: str | None = None  # the tokenizer's model; None: the path the replicas report (same machine or mount)
    poll_interval_s: float = 0.5  # health probes and state reports, per replica
    probe_timeout_s: float = 2.0  # a /health answer slower than this counts as a failed probe
    failed_probes: int = 3  # consecutive failed (timed-out) probes before a replica leaves the rotation
    state_timeout_s: float = 30.0  # a state report waits for the engine's current step
    max_attempts: int = 3  # replicas tried for one request that has not started streaming
    # a request lost on its replica (not refused) waits this long for another to be (back) in the rotation, so a
    # survivor briefly out of it (slow probes on loaded cores, a restart) does not turn the loss into an error
    retry_wait_s: float = 10.0
    connect_timeout_s: float = 5.0
    replica_api_key: str | None = field(default=None, repr=False)  # sent to replicas that require a key
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # (tenant, key): the router checks them

    def __post_init__(self) -> None:
        roles = [p.role for p in self.pools]
        if not self.pools or len(set(roles)) != len(roles):
            raise ValueError(f"need one pool per role, at least one; got roles {roles}")
        if set(roles) not in DEPLOYMENTS:
            raise ValueError(f"a router serves either 'both' replicas or disaggregated 'prefill' and 'decode' replicas "
                             f"(--prefill URL... --decode URL...); got pools {sorted(roles)}")
        urls = [u for p in self.pools for u in p.urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is in two pools: {urls}")
        for name in ("poll_interval_s", "probe_timeout_s", "state_timeout_s", "connect_timeout_s", "retry_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.failed_probes < 1 or self.max_attempts < 1:
            raise ValueError(f"failed_probes and max_attempts must be >= 1, got {self.failed_probes}, "
                             f"{self.max_attempts}")

    def pool(self, role: str) -> PoolConfig:
        return next(p for p in self.pools if p.role == role)


def parse_replica(spec: str) -> tuple[str, str]:
    """'[ROLE=]URL' -> (role, url); a plain URL is a `both` replica."""
    role, sep, url = spec.partition("=")
    if not sep or "://" in role:
        return "both", spec
    return role.strip(), url


def load_cost_model(path: str | None) -> CostModel:
    """A CostModel from calibrate_cost.py's JSON (its "cost_model" object, or the object itself); None: the default."""
    if path is None:
        return DEFAULT_COST
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the cost model {path!r}: {e}") from None
    return CostModel.from_dict(data.get("cost_model", data))
