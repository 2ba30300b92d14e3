"""Mixture of experts for any MoE model: a top-k router, fused expert weights, optional shared experts.

Routing (DeepSeek-V2/V3, Qwen-MoE, Mixtral are all special cases):
  scores = sigmoid(x W_r^T) or softmax(x W_r^T)            (float32)
  choice = scores + e_score_correction_bias                 (the bias steers selection only)
  group-limited: keep the `topk_group` best of `n_group` expert groups, scored by
                 the sum of each group's top-2 choices (noaux_tc) or its max score (group_limited_greedy)
  ids = top-k(choice); weights = scores[ids], / sum if norm_topk_prob, * routed_scaling_factor

Experts: a token's k (token, choice) rows are sorted by expert, each expert's rows go through one grouped GEMM per
projection, and a token's k outputs are added back in choice order. Expert parallelism (distributed/expert_parallel.py)
swaps FusedExperts for a module with the same call that holds only one rank's experts.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class TopKRouter(nn.Module):
    """x [T, H] -> (weights float32 [T, k], expert ids int64 [T, k])."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str = "softmax",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        group_score: str = "top2_sum",
        correction_bias: bool = False,
    ) -> None:
        super().__init__()
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide the {num_experts} routed experts")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"topk_group={topk_group} of n_group={n_group} groups cannot hold top_k={top_k} experts")
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group = n_group
        self.topk_group = topk_group
        self.group_score = group_score
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:
            choice = self._mask_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        if self.group_score == "top2_sum":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(self.topk_group, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask[..., None], float("-inf")).view_as(choice)


class FusedExperts(nn.Module):
    """All routed experts' SwiGLU weights in two stacked tensors: gate|up [E, 2I, H] and down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def checkpoint_loaders(self, prefix: str, shard_name: Callable | None = None) -> dict[str, Callable[[torch.Tensor], None]]:
        """Per-expert checkpoint tensor name (`{prefix}.{e}.gate_proj.weight`, ...) -> the function loading it."""
        return {
            f"{prefix}.{e}.{proj}.weight": (lambda t, e=e, proj=proj: self.load_expert(e, proj, t))
            for e in range(self.num_experts)
            for proj in EXPERT_PROJS
        }

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        i = self.intermediate_size
        target = {
            "gate_proj": self.gate_up_proj.data[expert, :i],
            "up_proj": self.gate_up_proj.data[expert, i:],
            "down_proj": self.down_proj.data[expert],
        }[proj]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape mismatch for expert {expert} {proj}: checkpoint {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> [T, H]."""
        order, counts = sort_rows(ids.flatten(), self.num_experts)
        out = grouped_swiglu(x[order // ids.shape[1]], self.gate_up_proj, self.down_proj, counts.tolist())
        return combine(out, order, weights)


# MKL computes a GEMM row with the same bits whatever the row count M only while M is a multiple of 4 (measured at
# 1, 2, 4 and 8 threads: a row differs in the last bit when M is 2-3, and with 2 or 8 threads also at 5-7 and 9-11),
# and a single row (M = 1) by a matrix-vector path of its own, 3x faster at decode batch 1. So an expert's rows are
# padded to a multiple of 4 unless the expert has a single row in the whole step (never split, and its row never
# meets another): a row's output then does not depend on how many rows share its expert, which the replicas of
# expert parallelism change (tests/distributed/test_expert_parallel.py).
GROUP_ROWS = 4


def sort_rows(groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [R]: the group (expert or slot) of each flat (token, choice) row -> (the rows sorted by group, stably;
    rows per group [num_groups])."""
    return groups.argsort(stable=True), torch.bincount(groups, minlength=num_groups)


def grouped_swiglu(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int],
                   expert_rows: list[int] | None = None) -> torch.Tensor:
    """down_g(silu(gate_g x) * up_g x) for each row x of group g: xs [R, H] sorted by group, counts[g] rows each,
    gate_up [G, 2I, H], down [G, H, I] -> [R, H]. expert_rows[g]: the rows of group g's expert in the whole step
    (more than counts[g] when replicas share them; default counts). A group is padded with zero rows to a multiple
    of GROUP_ROWS unless its expert has a single row (the pad rows are dropped from the output)."""
    padded = [n if total == 1 else -(-n // GROUP_ROWS) * GROUP_ROWS for n, total in zip(counts, expert_rows or counts)]
    rows, keep = xs, None
    if padded != counts:
        n, p = torch.tensor(counts), torch.tensor(padded)
        shift = (p.cumsum(0) - p) - (n.cumsum(0) - n)  # where each group starts, padded minus unpadded
        keep = (torch.arange(xs.shape[0]) + shift.repeat_interleave(n)).to(xs.device)
        rows = xs.new_zeros(sum(padded), xs.shape[1])
        rows[keep] = xs
    gate, up = _grouped_linear(rows, gate_up, padded).chunk(2, dim=-1)
    out = _grouped_linear(F.silu(gate) * up, down, padded)
    return out if keep is None else out[keep]


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x W_g^T for the rows of each group g: one torch._grouped_mm call on a CPU (a loop of GEMMs inside torch, the
    same bits as the Python loop below, without a Python step per expert); elsewhere one F.linear per group."""
    if x.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for g, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(x[start : start + n], weight[g])
            start += n
    return out


def combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T*k, H]: row j is the expert output of flat (token, choice) row order[j]; weights [T, k] -> [T, H].
    A token's k outputs are weighted and added left to right in choice order, in float32: the sum depends only on
    the token's own routing, never on the batch or on where its experts ran."""
    t, k = weights.shape
    per_choice = torch.empty_like(out)
    per_choice[order] = out
    per_choice = per_choice.view(t, k, -1).float()
    acc = per_choice[:, 0] * weights[:, :1]
    for j in range(1, k):
        acc = acc + per_choice[:, j] * weights[:, j : j + 1]
    return acc.to(out.dtype)


@dataclass
class MoEStep:
    """What one forward's MoE layers report, scoped with `with moe_step(MoEStep()):` around the forward and read by
    whoever opened it once the forward is done (the worker puts it on the step result). Keyed by `MoE.moe_index`."""

    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> tokens per logical expert [E]
    rank_loads: dict[int, list[int]] = field(default_factory=dict)  # expert parallelism: layer -> rows per rank
    exchange_bytes: int = 0  # expert parallelism: bytes one rank received for the combine, all layers

    def counts(self) -> list[list[int]] | None:
        """Per MoE layer (in order), tokens routed to each expert; None if no MoE layer ran."""
        return [self.expert_counts[i].tolist() for i in sorted(self.expert_counts)] or None


_STEP: contextvars.ContextVar[MoEStep | None] = contextvars.ContextVar("deepinfer_moe_step", default=None)


@contextlib.contextmanager
def moe_step(step: MoEStep) -> Iterator[MoEStep]:
    if _STEP.get() is not None:
        raise RuntimeError("MoE step contexts do not nest")
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def current_moe_step() -> MoEStep | None:
    """The open MoEStep, or None: then the layers report nothing."""
    return _STEP.get()


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts. Reports tokens per expert to the open MoEStep."""

    def __init__(self, gate: TopKRouter, experts: nn.Module, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        if gate.num_experts != experts.num_experts:
            raise ValueError(f"router has {gate.num_experts} experts, expert weights {experts.num_experts}")
        self.gate = gate
        self.experts = experts  # FusedExperts, or one rank's share of them under expert parallelism
        self.shared_experts = shared_experts
        self.moe_index: int | None = None  # place among the main model's MoE layers (see number_moe_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        step = current_moe_step()
        if step is not None and self.moe_index is not None:
            step.expert_counts[self.moe_index] = torch.bincount(ids.flatten(), minlength=self.gate.num_experts)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def number_moe_layers(mlps: Iterable[nn.Module]) -> list[MoE]:
    """The MoE layers among a model's per-layer MLPs, in order, each told its index (the EPLB layer index). MoE
    layers outside the main stack (MTP) keep None and report nothing."""
    layers = [m for m in mlps if isinstance(m, MoE)]
    for index, moe in enumerate(layers):
        moe.moe_index = index
    return layers
