"""Sparse MoE feed-forward block (Mixtral): a router, then ``num_local_experts`` SwiGLU experts
of which each token uses ``num_experts_per_tok``.

Expert weights are stacked: ``w13: [E, 2 * I, H]`` (gate rows then up rows, i.e. HF ``w1``
then ``w3``) and ``w2: [E, H, I]`` (HF ``w2``), so expert e is ``w2[e] @ (silu(w1 x) * w3 x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import combine, dispatch, route
from models.config import ModelConfig


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = inter
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)  # router: [E, H]
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on ``x: [n, H]`` -> ``[n, H]``."""
        gate, up = F.linear(x, self.w13[index]).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate).mul_(up), self.w2[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, H]`` -> ``[T, H]``."""
        weights, expert_ids = route(self.gate(x), self.top_k)  # [T, k] each
        plan = dispatch(expert_ids, self.num_experts)
        grouped = x.index_select(0, plan.token_ids)  # [T * k, H], expert-major
        expert_out = torch.empty_like(grouped)
        for index, count in enumerate(plan.counts):
            if count:
                rows = plan.slab(index)
                expert_out[rows] = self.expert(index, grouped[rows])
        return combine(expert_out, plan, weights, x.shape[0])
