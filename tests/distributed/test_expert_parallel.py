"""Expert parallelism in one process: sharded experts against FusedExperts, routing against eplb.route, grouped
expert compute against the per-expert loop and against every split of a group (what replicas do)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepinfer.config import EngineConfig
from deepinfer.distributed.eplb import Placement, balanced_placement, route
from deepinfer.distributed.expert_parallel import ShardedExperts
from deepinfer.distributed.group import host_store, join_group
from deepinfer.layers.moe import FusedExperts, MoEStep, grouped_swiglu, moe_step

E, H, I = 8, 64, 32


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator().manual_seed(0)
    fused = FusedExperts(E, H, I)
    fused.gate_up_proj.data = torch.randn(E, 2 * I, H, generator=gen) * 0.1
    fused.down_proj.data = torch.randn(E, H, I, generator=gen) * 0.1
    return fused


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: collectives and point-to-point moves run, with every slot on this rank."""
    store = host_store("127.0.0.1", None, 30)
    yield join_group("127.0.0.1", store.port, 0, 1, "gloo", 30)


def routing(tokens: int, k: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    return x, ids, weights


def test_grouped_compute_matches_the_per_expert_loop(experts):
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.arange(32) % E, (torch.arange(32) * 3 + 1) % E], dim=1)  # 8 rows per expert: no padding
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    xs = x[order // 2]
    loop, start = torch.empty_like(xs), 0
    for e, n in enumerate(counts):
        gate, up = F.linear(xs[start : start + n], experts.gate_up_proj[e]).chunk(2, dim=-1)
        loop[start : start + n] = F.linear(F.silu(gate) * up, experts.down_proj[e])
        start += n
    assert counts == [8] * E
    assert torch.equal(grouped_swiglu(xs, experts.gate_up_proj, experts.down_proj, counts), loop)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 33])
def test_a_row_does_not_depend_on_how_its_group_is_split(experts, rows):
    """Replicas split an expert's rows into smaller groups; every row must keep its bits."""
    xs = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    gate_up, down = experts.gate_up_proj[:1], experts.down_proj[:1]
    whole = grouped_swiglu(xs, gate_up, down, [rows])
    for size in (1, 2, 3, 4, 5, 8):
        parts = [grouped_swiglu(xs[i : i + size], gate_up, down, [len(xs[i : i + size])], [rows])
                 for i in range(0, rows, size)]
        assert torch.equal(torch.cat(parts), whole), size


def test_routing_matches_eplb_route(experts, group):
    placement = balanced_placement(np.array([[9.0, 1, 1, 5, 1, 1, 1, 3]]), 12, 1)
    assert placement.replica_counts.max() > 1
    shard = ShardedExperts(experts, placement.slot_to_expert[0], 0, 0, 1, group)
    _, ids, _ = routing(50, k=3)
    assert shard.route(ids).reshape(ids.shape).tolist() == route(ids.numpy(), placement, 0).tolist()


@pytest.mark.parametrize("tokens", [1, 3, 30])
def test_sharded_experts_give_fused_bits_and_report_loads(experts, group, tokens):
    """Replicas split the hot experts' rows (12 slots for 8 experts), yet every token gets FusedExperts' bits."""
    placement = balanced_placement(np.array([[9.0, 1, 1, 5, 1, 1, 1, 3]]), 12, 1)
    shard = ShardedExperts(experts, placement.slot_to_expert[0], 0, 0, 1, group)
    x, ids, weights = routing(tokens, k=3)
    with moe_step(MoEStep()) as step:
        out = shard(x, ids, weights)
    assert torch.equal(out, experts(x, ids, weights))
    assert step.rank_loads == {0: [3 * tokens]} and step.exchange_bytes == 0  # one rank receives nothing


def test_moving_experts_keeps_outputs(experts, group):
    before = balanced_placement(np.ones((1, E)), 12, 1)
    after = Placement(np.array([[7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 6, 0]]), E, 1)
    shard = ShardedExperts(experts, before.slot_to_expert[0], 0, 0, 1, group)
    x, ids, weights = routing(30, k=2)
    assert shard.reassign(after.slot_to_expert[0]) == 0  # one rank: every expert is copied locally, none received
    assert shard.slot_to_expert.tolist() == after.slot_to_expert[0].tolist()
    assert torch.equal(shard(x, ids, weights), experts(x, ids, weights))
    for slot, expert in enumerate(after.slot_to_expert[0]):
        assert torch.equal(shard.gate_up_proj[slot], experts.gate_up_proj[expert])


def test_nested_moe_steps_are_refused():
    with moe_step(MoEStep()), pytest.raises(RuntimeError, match="do not nest"):
        with moe_step(MoEStep()):
            pass


def test_port_in_use_is_named():
    taken = host_store("127.0.0.1", None, 5)
    with pytest.raises(ValueError, match=f"127.0.0.1:{taken.port}"):
        host_store("127.0.0.1", taken.port, 5)


def test_group_needs_a_known_backend():
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        join_group("127.0.0.1", 1, 0, 1, "mpi", 5)


@pytest.mark.parametrize("options,error", [
    (dict(expert_parallel_size=0), "expert_parallel_size must be an integer >= 1"),
    (dict(eplb_interval=4), "need expert_parallel_size > 1"),
    (dict(num_redundant_experts=2), "need expert_parallel_size > 1"),
    (dict(expert_parallel_size=2, eplb_interval=0), "eplb_interval must be >= 1"),
    (dict(expert_parallel_size=2, dist_backend="mpi"), "dist_backend must be 'gloo' or 'nccl'"),
    (dict(expert_parallel_size=2, master_port=70000), "master_port must be in"),
])
def test_parallel_options_are_checked(options, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig.from_kwargs(**options)


def test_parallel_options_reach_the_config():
    parallel = EngineConfig.from_kwargs(expert_parallel_size=4, num_redundant_experts=4, eplb_interval=8).parallel
    assert (parallel.expert_parallel_size, parallel.num_redundant_experts, parallel.eplb_interval) == (4, 4, 8)
    assert parallel.master_port is None  # a free port unless one is given
