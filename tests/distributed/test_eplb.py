import numpy as np
import pytest

from deepinfer.distributed.eplb import (
    ExpertLoadTracker,
    Placement,
    TrackerConfig,
    balanced_placement,
    hierarchical_placement,
    moe_lb,
    rank_loads,
    replicate,
    round_robin_placement,
    route,
)

EXPERTS, RANKS, SLOTS = 384, 64, 448  # DeepInfer's EP64: one redundant slot per rank


def zipf_loads(layers: int, experts: int = EXPERTS, skew: float = 0.8, seed: int = 0) -> np.ndarray:
    """Expected tokens per expert: Zipf over a random permutation per layer."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, experts + 1, dtype=np.float64) ** -skew
    return np.stack([weights[rng.permutation(experts)] for _ in range(layers)]) * 1e4


def sampled_counts(loads: np.ndarray, tokens: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.multinomial(tokens, row / row.sum()) for row in loads])


@pytest.mark.parametrize("policy", ["balanced", "hierarchical"])
@pytest.mark.parametrize("loads", ["zipf", "zero"])
def test_every_expert_keeps_a_replica_and_ranks_hold_equal_slots(policy, loads):
    layers = 4
    values = zipf_loads(layers) if loads == "zipf" else np.zeros((layers, EXPERTS))
    if policy == "balanced":
        placement, ranks_in_reach = balanced_placement(values, SLOTS, RANKS), RANKS
    else:
        placement, ranks_in_reach = hierarchical_placement(values, SLOTS, RANKS, num_nodes=8, num_groups=32), 8
    assert placement.slot_to_expert.shape == (layers, SLOTS)
    assert placement.slots_per_rank == SLOTS // RANKS == 7
    assert (placement.replica_counts >= 1).all()
    assert (placement.replica_counts.sum(axis=1) == SLOTS).all()
    # two replicas of one expert share a rank only when the expert has more replicas than ranks it may use
    for layer, table in enumerate(placement.slot_to_expert.reshape(layers, RANKS, -1)):
        for rank in table:
            copies = np.bincount(rank, minlength=EXPERTS)
            allowed = -(-placement.replica_counts[layer] // ranks_in_reach)
            assert (copies <= allowed).all()


def test_replicate_gives_extra_replicas_to_the_largest_load_per_replica():
    assert replicate(np.array([10.0, 1.0, 1.0]), 5).tolist() == [3, 1, 1]
    assert replicate(np.array([6.0, 4.0, 1.0]), 5).tolist() == [2, 2, 1]
    assert replicate(np.zeros(4), 6).tolist() == [2, 2, 1, 1]  # ties: fewer replicas, then lower index


def test_balanced_beats_round_robin_on_skewed_loads():
    loads = zipf_loads(8)
    balanced = balanced_placement(loads, SLOTS, RANKS)
    round_robin = round_robin_placement(8, EXPERTS, RANKS)
    assert moe_lb(rank_loads(loads, round_robin)).mean > 2.0  # Zipf(0.8): the hottest expert outweighs a rank's share
    assert moe_lb(rank_loads(loads, balanced)).worst < 1.01
    counts = sampled_counts(loads, tokens=16384 * 8)  # one step: 256 tokens per rank, top-8
    assert moe_lb(rank_loads(counts, balanced)).mean < 1.1 < moe_lb(rank_loads(counts, round_robin)).mean


def test_deterministic_for_equal_inputs():
    loads = zipf_loads(3)
    ties = np.ones((3, EXPERTS))  # every choice a tie: broken by index
    for values in (loads, ties):
        first = balanced_placement(values, SLOTS, RANKS).slot_to_expert
        assert np.array_equal(first, balanced_placement(values.copy(), SLOTS, RANKS).slot_to_expert)
        first = hierarchical_placement(values, SLOTS, RANKS, 8, 32).slot_to_expert
        assert np.array_equal(first, hierarchical_placement(values.copy(), SLOTS, RANKS, 8, 32).slot_to_expert)


@pytest.mark.parametrize("groups", [8, 32])
def test_hierarchical_keeps_each_group_on_one_node(groups):
    nodes, layers = 8, 4
    loads = zipf_loads(layers)
    placement = hierarchical_placement(loads, SLOTS, RANKS, num_nodes=nodes, num_groups=groups)
    group_of_slot = placement.slot_to_expert // (EXPERTS // groups)
    node_of_slot = np.arange(SLOTS) // (SLOTS // nodes)
    for layer in range(layers):
        nodes_of_group = {}
        for group, node in zip(group_of_slot[layer].tolist(), node_of_slot.tolist()):
            nodes_of_group.setdefault(group, set()).add(node)
        # no replica lands on a node that holds no slot of its group: every group lives on exactly one node
        assert all(len(held) == 1 for held in nodes_of_group.values()) and len(nodes_of_group) == groups
        groups_per_node = np.bincount([next(iter(held)) for held in nodes_of_group.values()], minlength=nodes)
        assert (groups_per_node == groups // nodes).all()


def test_hierarchical_balances_node_load():
    loads = zipf_loads(4, skew=0.5)
    placement = hierarchical_placement(loads, SLOTS, RANKS, num_nodes=8, num_groups=32)
    node_loads = rank_loads(loads, placement).reshape(4, 8, -1).sum(axis=2)
    group_loads = loads.reshape(4, 32, -1).sum(axis=2)
    # the heaviest node carries at most its fair share plus one group
    assert (node_loads.max(axis=1) <= node_loads.mean(axis=1) + group_loads.max(axis=1)).all()
    assert moe_lb(node_loads).mean < moe_lb(group_loads).mean


def test_moe_lb_of_uniform_load_is_one():
    lb = moe_lb(np.full((3, RANKS), 2048))
    assert lb.mean == lb.worst == 1.0 and lb.per_layer == (1.0, 1.0, 1.0)
    assert moe_lb(rank_loads(np.full((2, EXPERTS), 5), round_robin_placement(2, EXPERTS, RANKS))).mean == 1.0
    assert moe_lb(rank_loads(np.ones((2, EXPERTS)), balanced_placement(np.ones((2, EXPERTS)), SLOTS, RANKS))).worst \
        == pytest.approx(1.0, abs=1e-3)
    assert moe_lb(np.zeros((1, 4))).mean == 1.0  # no tokens: nothing to wait for
    assert moe_lb(np.array([[3.0, 1.0]])).mean == 1.5


def test_route_splits_tokens_evenly_and_rank_loads_agrees():
    loads = zipf_loads(2, experts=16, skew=1.0)
    placement = balanced_placement(loads, num_slots=24, num_ranks=4)
    rng = np.random.default_rng(0)
    expert_ids = np.stack([rng.choice(16, size=3, replace=False, p=loads[0] / loads[0].sum()) for _ in range(500)])
    slots = route(expert_ids, placement, layer=0)
    assert (placement.slot_to_expert[0][slots] == expert_ids).all()
    per_slot = np.bincount(slots.ravel(), minlength=24)
    for expert in range(16):
        received = per_slot[placement.slot_to_expert[0] == expert]
        assert received.max() - received.min() <= 1
    counts = np.stack([np.bincount(expert_ids.ravel(), minlength=16), np.zeros(16, dtype=np.int64)])
    assert np.array_equal(rank_loads(counts, placement)[0], per_slot.reshape(4, -1).sum(axis=1))
    assert np.array_equal(slots, route(expert_ids, placement, layer=0))


def test_tracker_keeps_an_exponential_moving_average():
    tracker = ExpertLoadTracker(TrackerConfig(num_layers=1, num_experts=2, decay=0.75))
    tracker.record([[4, 0]])
    assert tracker.loads.tolist() == [[4.0, 0.0]]  # the first record seeds the average
    tracker.record([[0, 8]])
    assert tracker.loads.tolist() == [[3.0, 2.0]]
    with pytest.raises(ValueError, match=r"\(1, 3\)"):
        tracker.record([[1, 2, 3]])
    with pytest.raises(ValueError, match="1.5"):
        TrackerConfig(num_layers=1, num_experts=2, decay=1.5)


def test_bad_inputs_raise_naming_the_value():
    loads = zipf_loads(1)
    with pytest.raises(ValueError, match="450"):
        balanced_placement(loads, 450, RANKS)  # not divisible by 64 ranks
    with pytest.raises(ValueError, match="320"):
        balanced_placement(loads, 320, RANKS)  # fewer slots than 384 experts
    with pytest.raises(ValueError, match="12"):
        hierarchical_placement(loads, SLOTS, RANKS, num_nodes=8, num_groups=12)  # groups not divisible by nodes
    with pytest.raises(ValueError, match="non-negative"):
        balanced_placement(-loads, SLOTS, RANKS)
    with pytest.raises(ValueError, match="expert 3"):
        Placement(np.array([[0, 1, 2, 0]]), num_experts=4, num_ranks=2)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        route(np.array([[4]]), round_robin_placement(1, 4, 2), layer=0)
