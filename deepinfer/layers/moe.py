"""Mixture of experts for any MoE model: a top-k router, fused expert weights, optional shared experts.

Routing (DeepSeek-V2/V3, Qwen-MoE, Mixtral are all special cases):
  scores = sigmoid(x W_r^T) or softmax(x W_r^T)            (float32)
  choice = scores + e_score_correction_bias                 (the bias steers selection only)
  group-limited: keep the `topk_group` best of `n_group` expert groups, scored by
                 the sum of each group's top-2 choices (noaux_tc) or its max score (group_limited_greedy)
  ids = top-k(choice); weights = scores[ids], / sum if norm_topk_prob, * routed_scaling_factor
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.linear import Linear

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
    """All routed experts' SwiGLU weights in two stacked tensors: gate|up [E, 2I, H] and down [E, H, I].

    Tokens are sorted by expert so each active expert runs one matmul over all its tokens; the k expert
    outputs of a token are then summed in slot order, which depends only on that token's own routing.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def checkpoint_loaders(self, prefix: str) -> dict[str, Callable[[torch.Tensor], None]]:
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

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k], counts [E] (tokens per expert) -> [T, H]."""
        t, k = ids.shape
        order = ids.flatten().argsort(stable=True)
        xs = x[order // k]  # row j of xs is (token, slot) order[j]
        out = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[expert])
            start += n
        per_slot = torch.empty_like(out)
        per_slot[order] = out
        combined = (per_slot.view(t, k, -1).float() * weights[..., None]).sum(dim=1)
        return combined.to(x.dtype)


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts; counts tokens per expert for load balancing."""

    def __init__(self, gate: TopKRouter, experts: FusedExperts, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        if gate.num_experts != experts.num_experts:
            raise ValueError(f"router has {gate.num_experts} experts, expert weights {experts.num_experts}")
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.register_buffer("expert_counts", torch.zeros(gate.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        counts = torch.bincount(ids.flatten(), minlength=self.gate.num_experts)
        self.expert_counts += counts
        out = self.experts(x, ids, weights, counts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def pop_expert_counts(self) -> list[int]:
        """Tokens routed to each expert since the last call (a token counts once for each of its k experts)."""
        counts = self.expert_counts.tolist()
        self.expert_counts.zero_()
        return counts

