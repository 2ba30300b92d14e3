"""Expert-parallel load balancing (EPLB): which physical slot holds which expert, as a pure policy on token counts.

With expert parallelism a MoE layer's experts live on different ranks, and every step waits for the rank that
received the most tokens. As DeepSeek-V3 does, we add redundant copies (replicas) of the heaviest experts and pack
the copies so that every rank receives about the same number of tokens. The engine reports per-layer, per-expert token
counts on the step result; `ExpertLoadTracker` keeps their moving average; a policy turns that into a `Placement`;
moving the weights is the worker's business, not this file's.

Terms: a layer has `num_experts` logical experts and `num_slots` (= num_experts + redundant) physical slots,
`num_slots / num_ranks` per rank; rank r owns slots [r*S, (r+1)*S). A placement is the same for every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


def _check_slots(num_slots: int, num_experts: int, num_ranks: int) -> None:
    if num_experts < 1 or num_ranks < 1:
        raise ValueError(f"need num_experts >= 1 and num_ranks >= 1, got {num_experts} and {num_ranks}")
    if num_slots < num_experts:
        raise ValueError(f"num_slots ({num_slots}) is fewer than num_experts ({num_experts}): "
                         "every expert needs a slot")
    if num_slots % num_ranks:
        raise ValueError(f"num_slots ({num_slots}) is not divisible by num_ranks ({num_ranks}): "
                         "every rank holds the same number of slots")


def _as_loads(loads: np.ndarray | list[list[float]]) -> np.ndarray:
    array = np.asarray(loads, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f"loads must be [layers, experts], got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("loads must be finite and non-negative")
    return array


@dataclass(frozen=True, eq=False)
class Placement:
    """Physical slot -> logical expert for every MoE layer (int64 [num_layers, num_slots], read-only).
    Rank r owns slots [r*S, (r+1)*S), S = slots_per_rank; every expert has at least one slot in every layer."""

    slot_to_expert: np.ndarray
    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        table = np.array(self.slot_to_expert, dtype=np.int64)  # a copy: the caller keeps theirs
        if table.ndim != 2:
            raise ValueError(f"slot_to_expert must be [layers, slots], got shape {table.shape}")
        _check_slots(table.shape[1], self.num_experts, self.num_ranks)
        if table.size and (table.min() < 0 or table.max() >= self.num_experts):
            raise ValueError(f"slot_to_expert holds experts outside [0, {self.num_experts})")
        held = np.zeros((table.shape[0], self.num_experts), dtype=bool)
        held[np.arange(table.shape[0])[:, None], table] = True
        if not held.all():
            layer, expert = np.argwhere(~held)[0]
            raise ValueError(f"expert {expert} has no slot in layer {layer}")
        table.flags.writeable = False
        object.__setattr__(self, "slot_to_expert", table)

    @property
    def num_layers(self) -> int:
        return self.slot_to_expert.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_to_expert.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @cached_property
    def replica_counts(self) -> np.ndarray:
        """[layers, experts]: how many slots hold each expert."""
        return np.stack([np.bincount(row, minlength=self.num_experts) for row in self.slot_to_expert])

    @cached_property
    def replica_index(self) -> np.ndarray:
        """[layers, slots]: which of its expert's replicas each slot is, counting slots in ascending order."""
        keys = (np.arange(self.num_layers)[:, None] * self.num_experts + self.slot_to_expert).ravel()
        order = np.argsort(keys, kind="stable")
        run_start = np.cumsum(self.replica_counts.ravel()) - self.replica_counts.ravel()
        index = np.empty(keys.size, dtype=np.int64)
        index[order] = np.arange(keys.size) - run_start[keys[order]]
        return index.reshape(self.slot_to_expert.shape)


@dataclass(frozen=True)
class MoeLB:
    mean: float  # over layers
    worst: float  # the worst layer
    per_layer: tuple[float, ...]


def moe_lb(rank_loads: np.ndarray) -> MoeLB:
    """Load imbalance from rank_loads (tokens each rank's slots receive): [layers, ranks] for one step, or
    [steps, layers, ranks] for a window of steps.

    Per MoE layer: the busiest rank's tokens over the mean per rank, each summed over the steps. 1.0 is perfect
    balance; since every step of a layer waits for its busiest rank, it is also the slowdown against perfect balance
    (if a rank's time is proportional to its tokens). A layer that received no tokens counts as 1.0."""
    loads = np.asarray(rank_loads, dtype=np.float64)
    if loads.ndim == 2:
        loads = loads[None]
    if loads.ndim != 3 or loads.shape[2] == 0:
        raise ValueError(f"rank_loads must be [layers, ranks] or [steps, layers, ranks], got shape {loads.shape}")
    if (loads < 0).any():
        raise ValueError("rank_loads must be non-negative")
    busiest, mean = loads.max(axis=2).sum(axis=0), loads.mean(axis=2).sum(axis=0)
    per_layer = np.divide(busiest, mean, out=np.ones_like(mean), where=mean > 0)
    return MoeLB(float(per_layer.mean()), float(per_layer.max()), tuple(per_layer.tolist()))


@dataclass(frozen=True)
class TrackerConfig:
    num_layers: int
    num_experts: int
    decay: float = 0.99  # the history's weight at each record; half-life = log(0.5) / log(decay) records

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_experts < 1:
            raise ValueError(f"need num_layers, num_experts >= 1, got {self.num_layers}, {self.num_experts}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")


class ExpertLoadTracker:
    """Exponential moving average of per-layer, per-expert token counts, one `record` per step (or per window).
    The first record seeds the average, so early estimates are not biased toward zero."""

    def __init__(self, config: TrackerConfig) -> None:
        self.config = config
        self.num_records = 0
        self._loads = np.zeros((config.num_layers, config.num_experts))

    def record(self, counts: list[list[int]] | np.ndarray) -> None:
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self._loads.shape:
            raise ValueError(f"counts must be [layers, experts] = {self._loads.shape}, got shape {counts.shape}")
        if (counts < 0).any():
            raise ValueError("counts must be non-negative")
        if self.num_records == 0:
            self._loads = counts.copy()
        else:
            self._loads *= self.config.decay
            self._loads += (1.0 - self.config.decay) * counts
        self.num_records += 1

    @property
    def loads(self) -> np.ndarray:
        return self._loads.copy()


def replicate(loads: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts [..., experts] summing to num_slots along the last axis: one replica each, then every extra one
    to the expert with the largest load per replica (ties: fewer replicas, then the lower index). This greedy rule
    (D'Hondt's apportionment) minimises the largest load per replica."""
    loads = np.asarray(loads, dtype=np.float64)
    num_experts = loads.shape[-1]
    if num_slots < num_experts:
        raise ValueError(f"num_slots ({num_slots}) is fewer than num_experts ({num_experts}): "
                         "every expert needs a slot")
    flat = loads.reshape(-1, num_experts)
    counts = np.ones(flat.shape, dtype=np.int64)
    rows = np.arange(flat.shape[0])
    for _ in range(num_slots - num_experts):
        per_replica = flat / counts
        tied = per_replica >= per_replica.max(axis=1, keepdims=True)
        counts[rows, np.argmin(np.where(tied, counts, np.iinfo(np.int64).max), axis=1)] += 1
    return counts.reshape(loads.shape)


def _pack(weights: np.ndarray, keys: np.ndarray, num_bins: int, per_bin: int, tolerance: float = 1e-3,
          partners: int = 8, max_rounds: int = 10_000) -> np.ndarray:
    """Batched balanced packing. Problem p puts its items (weights[p], num_bins * per_bin of them) into num_bins bins of
    exactly per_bin items, keeping the heaviest bin as light as it can; two items of one key share a bin only when
    unavoidable. Returns item indices [P, num_bins, per_bin], each bin's items ordered by key then index.

    First greedy: heaviest item first, into the lightest bin with room and without that key (lowest bin on ties).
    Then local search: swap an item of the heaviest bin with one of the `partners` lightest bins whenever that lowers
    the heavier of the two, taking the swap that lowers it most; stop when no swap helps, or once the heaviest bin is
    within `tolerance` of the mean (token counts move by several percent from step to step, far more than 0.1%). The
    largest bin never grows and the sorted vector of bin loads falls at every swap, so it terminates."""
    num_problems, num_items = weights.shape
    rows = np.arange(num_problems)
    num_keys = int(keys.max()) + 1
    load = np.zeros((num_problems, num_bins))
    fill = np.zeros((num_problems, num_bins), dtype=np.int64)
    key_count = np.zeros((num_problems, num_bins, num_keys), dtype=np.int32)
    bin_of = np.empty((num_problems, num_items), dtype=np.int64)
    for item in np.argsort(-weights, axis=1, kind="stable").T:
        key = keys[rows, item]
        room = fill < per_bin
        fresh = room & (key_count[rows, :, key] == 0)
        allowed = np.where(fresh.any(axis=1, keepdims=True), fresh, room)
        b = np.argmin(np.where(allowed, load, np.inf), axis=1)
        load[rows, b] += weights[rows, item]
        fill[rows, b] += 1
        key_count[rows, b, key] += 1
        bin_of[rows, item] = b

    at = np.argsort(bin_of, axis=1, kind="stable").reshape(num_problems, num_bins, per_bin)
    w_at = np.take_along_axis(weights, at.reshape(num_problems, -1), axis=1).reshape(at.shape)
    k_at = np.take_along_axis(keys, at.reshape(num_problems, -1), axis=1).reshape(at.shape)
    good_enough = load.mean(axis=1) * (1 + tolerance)
    num_partners = min(num_bins, partners)
    active = np.ones(num_problems, dtype=bool)
    for _ in range(max_rounds):
        p = np.flatnonzero(active)
        if p.size == 0:
            break
        ar = np.arange(p.size)
        a = np.argmax(load[p], axis=1)
        top = load[p, a]
        light = np.argsort(load[p], axis=1, kind="stable")[:, :num_partners]  # [p, Bl]
        w_a, k_a = w_at[p, a], k_at[p, a]  # [p, Si]
        w_b, k_b = w_at[p[:, None], light], k_at[p[:, None], light]  # [p, Bl, Sj]
        # d[p, b, j, i]: item i leaves the heaviest bin a for bin light[b], whose item j comes back
        d = w_a[:, None, None, :] - w_b[:, :, :, None]
        worse = np.maximum(top[:, None, None, None] - d, load[p[:, None], light][:, :, None, None] + d)
        same = k_b[:, :, :, None] == k_a[:, None, None, :]
        k_i_in_b = key_count[p[:, None, None], light[:, :, None], k_a[:, None, :]]  # [p, Bl, Si]
        k_j_in_a = key_count[p[:, None, None], a[:, None, None], k_b]  # [p, Bl, Sj]
        clash = (k_i_in_b[:, :, None, :] - same > 0) | (k_j_in_a[:, :, :, None] - same > 0)
        clash |= (light == a[:, None])[:, :, None, None]
        score = np.where(clash, np.inf, worse).reshape(p.size, -1)
        best = np.argmin(score, axis=1)
        improves = (score[ar, best] < top * (1 - 1e-12)) & (top > good_enough[p])
        active[p[~improves]] = False
        lb, j, i = np.unravel_index(best[improves], (num_partners, per_bin, per_bin))
        p, a = p[improves], a[improves]
        b = light[improves][np.arange(p.size), lb]
        delta = w_at[p, a, i] - w_at[p, b, j]
        load[p, a] -= delta
        load[p, b] += delta
        k_i, k_j = k_at[p, a, i], k_at[p, b, j]
        for bin_, out, back in ((a, k_i, k_j), (b, k_j, k_i)):
            key_count[p, bin_, out] -= 1  # each problem appears once in p, so plain fancy indexing is safe
            key_count[p, bin_, back] += 1
        for array in (at, w_at, k_at):
            array[p, a, i], array[p, b, j] = array[p, b, j].copy(), array[p, a, i].copy()
    order = np.lexsort((at, k_at), axis=2)
    return np.take_along_axis(at, order, axis=2)


def hierarchical_placement(loads: np.ndarray, num_slots: int, num_ranks: int, num_nodes: int,
                           num_groups: int) -> Placement:
    """DeepSeek's hierarchical policy, for group-limited routing (a token's experts come from a few groups):
    experts are in num_groups contiguous groups; pack whole groups onto nodes (num_groups / num_nodes each) balancing
    node load, then replicate each node's experts within its num_slots / num_nodes slots, then pack those replicas onto
    the node's ranks. Every replica of an expert lives on the one node that holds its group, so a token's experts
    span few nodes. loads: [layers, experts], e.g. `ExpertLoadTracker.loads`."""
    loads = _as_loads(loads)
    num_layers, num_experts = loads.shape
    _check_slots(num_slots, num_experts, num_ranks)
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) is not divisible by num_nodes ({num_nodes})")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) is not divisible by num_groups ({num_groups})")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) is not divisible by num_nodes ({num_nodes}); "
                         "use balanced_placement (the global policy)")
    group_size, node_experts = num_experts // num_groups, num_experts // num_nodes
    group_load = loads.reshape(num_layers, num_groups, group_size).sum(axis=2)
    group_ids = np.broadcast_to(np.arange(num_groups), group_load.shape)
    groups_on_node = _pack(group_load, group_ids, num_nodes, num_groups // num_nodes)  # [L, nodes, groups/node]
    experts = (groups_on_node[..., None] * group_size + np.arange(group_size)).reshape(-1, node_experts)
    node_loads = np.take_along_axis(loads, experts.reshape(num_layers, -1), axis=1).reshape(experts.shape)

    counts = replicate(node_loads, num_slots // num_nodes)  # [L * nodes, node_experts]
    local = np.repeat(np.tile(np.arange(node_experts), len(counts)), counts.ravel()).reshape(len(counts), -1)
    weights = np.take_along_axis(node_loads / counts, local, axis=1)
    at = _pack(weights, local, num_ranks // num_nodes, num_slots // num_ranks).reshape(len(counts), -1)
    table = np.take_along_axis(experts, np.take_along_axis(local, at, axis=1), axis=1)
    return Placement(table.reshape(num_layers, num_slots), num_experts, num_ranks)


def balanced_placement(loads: np.ndarray, num_slots: int, num_ranks: int) -> Placement:
    """The global policy: replicate over all slots, pack onto all ranks, ignoring nodes and groups (DeepSeek uses it
    when groups cannot be split evenly over nodes, and for decode's large EP)."""
    return hierarchical_placement(loads, num_slots, num_ranks, num_nodes=1, num_groups=1)


def round_robin_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """No balancing, no redundancy: expert e on rank e mod num_ranks."""
    _check_slots(num_experts, num_experts, num_ranks)
    row = np.arange(num_experts).reshape(-1, num_ranks).T.ravel()
    return Placement(np.tile(row, (num_layers, 1)), num_experts, num_ranks)


def route(expert_ids: np.ndarray, placement: Placement, layer: int) -> np.ndarray:
    """Physical slots for one layer's routed tokens: expert_ids [tokens, top_k] -> slots, same shape.

    Rule: number each expert's choices in order (token by token, a token's choices left to right); choice n of expert e
    goes to e's replica n mod r_e, replicas in ascending slot order. Deterministic, and it splits an expert's tokens as
    evenly as integers allow (the first c mod r replicas take one more), which `rank_loads` reproduces from counts."""
    ids = np.asarray(expert_ids, dtype=np.int64)
    flat = ids.ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= placement.num_experts):
        raise ValueError(f"expert_ids must be in [0, {placement.num_experts})")
    row = placement.slot_to_expert[layer]
    replicas = placement.replica_counts[layer]
    slots_by_expert = np.argsort(row, kind="stable")  # each expert's slots, ascending, one run per expert
    first_slot = np.cumsum(replicas) - replicas
    order = np.argsort(flat, kind="stable")
    seen = np.bincount(flat, minlength=placement.num_experts)
    nth = np.empty(flat.size, dtype=np.int64)
    nth[order] = np.arange(flat.size) - (np.cumsum(seen) - seen)[flat[order]]
    return slots_by_expert[first_slot[flat] + nth % replicas[flat]].reshape(ids.shape)


def rank_loads(counts: np.ndarray, placement: Placement) -> np.ndarray:
    """Tokens each rank receives: counts [layers, experts] (tokens routed to each logical expert) -> [layers, ranks].
    Integer counts split over replicas as `route` splits them; float counts (expected loads) split exactly evenly."""
    counts = np.asarray(counts)
    if counts.shape != (placement.num_layers, placement.num_experts):
        raise ValueError(f"counts must be [layers, experts] = {(placement.num_layers, placement.num_experts)}, "
                         f"got shape {counts.shape}")
    table = placement.slot_to_expert
    tokens = np.take_along_axis(counts, table, axis=1)
    replicas = np.take_along_axis(placement.replica_counts, table, axis=1)
    if np.issubdtype(counts.dtype, np.integer):
        per_slot = tokens // replicas + (placement.replica_index < tokens % replicas)
    else:
        per_slot = tokens / replicas
    return per_slot.reshape(placement.num_layers, placement.num_ranks, -1).sum(axis=2)
