"""A pool: the replicas of one role, serving one model, and the policy that picks among them."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from deepinfer.router.config import PoolConfig
from deepinfer.router.policy import Decision, RoutingConfig, pick
from deepinfer.router.prompt import Prompt
from deepinfer.router.replica import Replica


class Pool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.role = config.role
        self.replicas = [Replica(url, config.role) for url in config.urls]
        self.routed = 0  # decisions so far: round_robin's counter
        # what the pool serves: set by its first replica to report; a replica reporting another is not routed to
        self.model_key: str | None = None
        self.block_size: int | None = None

    @property
    def routing(self) -> RoutingConfig:
        return replace(self.config.routing, block_size=self.block_size or self.config.routing.block_size)

    def admit_report(self, replica: Replica) -> None:
        """Checks a replica's reported model and block size against the pool's after a report."""
        if self.model_key is None:
            self.model_key, self.block_size = replica.model_key, replica.block_size
        elif (replica.model_key, replica.block_size) != (self.model_key, self.block_size):
            replica.mismatch(f"it serves {replica.model_key!r} with blocks of {replica.block_size} tokens; the "
                             f"{self.role!r} pool serves {self.model_key!r} with {self.block_size}")

    def block_keys(self, prompt: Prompt | None) -> list[bytes]:
        """The prompt's key chain for this pool's model; none before a replica reported it, or without a prompt."""
        return prompt.block_keys(self.model_key, self.block_size) if prompt and self.model_key else []

    def choose(self, keys: Sequence[bytes], num_tokens: int,
               exclude: Collection[Replica] = ()) -> tuple[Replica, Decision]:
        """Picks a routable replica not in `exclude` for a request (its key chain and prompt tokens, see
        prompt.Prompt) and books it there (policy.ReplicaState.with_routed); raises policy.NoHealthyReplica when there
        is none. Without keys (no tokenizer yet, an unreadable body) the request is routed by load alone."""
        tokens = max(1, num_tokens)
        states = [r.routing_view(r not in exclude) for r in self.replicas]
        routing = self.routing
        decision = pick(keys, tokens, states, self.config.cost, self.config.policy, counter=self.routed,
                        config=routing)
        self.routed += 1
        decay = routing.decay()
        for r in self.replicas:
            r.state = r.state.decayed(decay)
        chosen = self.replicas[decision.index]
        chosen.state = chosen.state.with_routed(keys, tokens, decision, routing.block_size)
        return chosen, decision
