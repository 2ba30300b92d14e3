"""Expert parallelism inside a built model: each rank holds only the routed experts of its physical slots.

Every rank runs the whole model on the same tokens (attention, dense MLPs, shared experts, routers and the LM head
are replicated); only the routed experts are sharded. Per MoE layer, on every rank:

  1. routing is computed from the same hidden states with the same code, so every rank sees the same expert ids;
  2. each (token, choice) row takes a physical slot by `eplb.route`'s rule (choice n of expert e goes to e's replica
     n mod r_e, replicas in ascending slot order), so every rank agrees on where every row runs;
  3. the rows are sorted by slot; rank r owns slots [r*S, (r+1)*S), so its rows are one contiguous run of that order,
     which it computes with one grouped GEMM per projection (layers/moe.py);
  4. one all_gather of every rank's rows (padded to the busiest rank's count) gives every rank every row's output;
  5. they are combined exactly as FusedExperts combines them: a token's k outputs weighted and added in choice order.

A row's output does not depend on which rank or replica computed it, nor on how many rows shared its expert
(layers/moe.py: GROUP_ROWS), and the combine order is fixed, so every rank ends the layer with the same hidden
states, and they are the bits one process computes on the same batch.

Moving experts (`ShardedExperts.reassign`): one layer at a time, at a step boundary, in one all_to_all.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deepinfer.distributed.eplb import Placement
from deepinfer.layers.moe import FusedExperts, combine, current_moe_step, grouped_swiglu, sort_rows


class ShardedExperts(nn.Module):
    """One rank's slots of one MoE layer, called as FusedExperts is: (x [T, H], ids [T, k], weights [T, k]) -> [T, H].
    gate|up [S, 2I, H] and down [S, H, I] hold the experts of slots [rank*S, (rank+1)*S)."""

    def __init__(self, experts: FusedExperts, slot_to_expert: np.ndarray, layer: int, rank: int, num_ranks: int,
                 group: dist.ProcessGroup) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.layer, self.rank, self.num_ranks, self.group = layer, rank, num_ranks, group
        self.slots_per_rank = len(slot_to_expert) // num_ranks
        local = torch.from_numpy(np.array(slot_to_expert[self._mine()], dtype=np.int64))
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[local].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(experts.down_proj.data[local].clone(), requires_grad=False)
        self._set_table(slot_to_expert)

    def _mine(self, rank: int | None = None) -> slice:
        rank = self.rank if rank is None else rank
        return slice(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def _set_table(self, slot_to_expert: np.ndarray) -> None:
        row = np.array(slot_to_expert, dtype=np.int64)
        row.flags.writeable = False
        self.slot_to_expert = row
        replicas = np.bincount(row, minlength=self.num_experts)
        self._replicas = torch.from_numpy(replicas)
        self._first_replica = torch.from_numpy(np.cumsum(replicas) - replicas)
        self._slots_by_expert = torch.from_numpy(np.argsort(row, kind="stable"))  # one run per expert, ascending
        self._local_experts = torch.from_numpy(row[self._mine()].copy())

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    def route(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical slots of the flat (token, choice) rows: `eplb.route`'s rule, in torch."""
        flat = ids.flatten().cpu()
        order = flat.argsort(stable=True)
        seen = torch.bincount(flat, minlength=self.num_experts)
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(flat.numel()) - (seen.cumsum(0) - seen)[flat[order]]
        slots = self._slots_by_expert[self._first_replica[flat] + nth % self._replicas[flat]]
        return slots.to(ids.device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, counts = sort_rows(self.route(ids), self.num_slots)
        per_rank = counts.view(self.num_ranks, -1).sum(dim=1).tolist()
        first = sum(per_rank[: self.rank])
        mine = order[first : first + per_rank[self.rank]]
        expert_rows = torch.bincount(ids.flatten().cpu(), minlength=self.num_experts)[self._local_experts]
        local = grouped_swiglu(x[mine // ids.shape[1]], self.gate_up_proj, self.down_proj,
                               counts[self._mine()].tolist(), expert_rows.tolist())
        out = self._all_gather(local, per_rank)
        step = current_moe_step()
        if step is not None:
            step.rank_loads[self.layer] = per_rank
            step.exchange_bytes += (self.num_ranks - 1) * max(per_rank) * out.shape[1] * out.element_size()
        return combine(out, order, weights)

    def _all_gather(self, local: torch.Tensor, per_rank: list[int]) -> torch.Tensor:
        """Every rank's rows, concatenated in rank order: [sum(per_rank), H]."""
        widest = max(per_rank)
        if widest == 0:
            return local
        padded = local if local.shape[0] == widest else torch.cat([local, local.new_zeros(widest - local.shape[0],
                                                                                          local.shape[1])])
        parts = [torch.empty_like(padded) for _ in range(self.num_ranks)]
        self.group.allgather([parts], [padded]).wait()
        parts[self.rank] = local
        return torch.cat([part[:n] for part, n in zip(parts, per_rank)])

    def reassign(self, slot_to_expert: np.ndarray) -> int:
        """Takes this layer's new slot -> expert row (every rank calls it with the same row at the same step boundary,
        one layer at a time); returns how many experts this rank received from others. A slot whose new expert this
        rank already holds is copied locally; any other comes from the rank holding the expert's first old slot, all
        of them in one all_to_all (gloo and NCCL alike): every rank derives the same send and receive lists, ordered
        by destination (source) rank, then by new slot."""
        old, new = self.slot_to_expert, np.asarray(slot_to_expert, dtype=np.int64)
        if new.shape != old.shape:
            raise ValueError(f"layer {self.layer}: placement has {new.shape[0]} slots, this model {old.shape[0]}")
        if np.array_equal(old, new):
            return 0
        experts, first_slot = np.unique(old, return_index=True)
        source_rank = np.empty(self.num_experts, dtype=np.int64)
        source_rank[experts] = first_slot // self.slots_per_rank  # every expert has a slot (Placement checks it)

        def incoming(rank: int) -> list[tuple[int, int]]:
            """(new slot on `rank`, expert) for the experts `rank` must receive, by new slot."""
            held = old[self._mine(rank)]
            return [(j, int(e)) for j, e in enumerate(new[self._mine(rank)]) if e not in held]

        gate_up, down = self.gate_up_proj.data, self.down_proj.data
        sends = [[e for _, e in incoming(dst) if source_rank[e] == self.rank] if dst != self.rank else []
                 for dst in range(self.num_ranks)]
        receives = incoming(self.rank)
        held = list(old[self._mine()])
        sent = [torch.cat([gate_up[held.index(e)].flatten(), down[held.index(e)].flatten()])
                for dst in sends for e in dst]
        size = gate_up[0].numel() + down[0].numel()
        payload = torch.cat(sent) if sent else gate_up.new_empty(0)
        arrived = gate_up.new_empty(len(receives) * size)
        if any(incoming(rank) for rank in range(self.num_ranks)):  # every rank takes the same branch
            self.group.alltoall_base(arrived, payload, [size * sum(source_rank[e] == src for _, e in receives)
                                                        for src in range(self.num_ranks)],
                                     [size * len(dst) for dst in sends]).wait()
        new_gate_up, new_down = torch.empty_like(gate_up), torch.empty_like(down)
        by_source = sorted(receives, key=lambda item: (source_rank[item[1]], item[0]))
        for chunk, (j, _) in zip(arrived.split(size), by_source):
            new_gate_up[j] = chunk[: gate_up[0].numel()].view_as(gate_up[0])
            new_down[j] = chunk[gate_up[0].numel() :].view_as(down[0])
        for j, expert in enumerate(new[self._mine()]):
            if expert in held:
                new_gate_up[j], new_down[j] = gate_up[held.index(expert)], down[held.index(expert)]
        self.gate_up_proj = nn.Parameter(new_gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(new_down, requires_grad=False)
        self._set_table(new)
        return len(receives)


def shard_experts(model: nn.Module, placement: Placement, rank: int, group: dist.ProcessGroup) -> list[ShardedExperts]:
    """Replaces every MoE layer's FusedExperts in `model` (listed by its `moe_layers()`) with this rank's slots of
    `placement`, in place; the other experts' weights are released."""
    layers = model.moe_layers()
    if len(layers) != placement.num_layers:
        raise ValueError(f"placement covers {placement.num_layers} MoE layers, the model has {len(layers)}")
    for moe in layers:
        if not isinstance(moe.experts, FusedExperts):
            raise ValueError(f"MoE layer {moe.moe_index} holds {type(moe.experts).__name__}, expected FusedExperts")
        if moe.experts.num_experts != placement.num_experts:
            raise ValueError(f"placement has {placement.num_experts} experts, layer {moe.moe_index} "
                             f"{moe.experts.num_experts}")
        moe.experts = ShardedExperts(moe.experts, placement.slot_to_expert[moe.moe_index], moe.moe_index, rank,
                                     placement.num_ranks, group)
    return [moe.experts for moe in layers]
