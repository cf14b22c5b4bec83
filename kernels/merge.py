"""Exact merge of partial attention states computed over disjoint KV shards.

If shard i gives ``(out_i, lse_i)`` with ``lse_i = log sum_j exp(s_j)`` over its keys (natural
log) and ``out_i`` the softmax-weighted mean of its values, attention over the union is
``out = sum_i w_i out_i`` with ``w_i = exp(lse_i - lse)`` and ``lse = log sum_i exp(lse_i)``.
A shard holding no key for a row has ``lse_i = -inf`` and weight 0; a row with no key anywhere
gets ``out = 0`` and ``lse = -inf``. This is what KV-cache parallelism reduces across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_attention_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs: [T, H, D]`` each, ``lses: [T, H]`` each -> ``(out [T, H, D], lse [T, H] fp32)``."""
    if len(outs) != len(lses) or not outs:
        raise ValueError("merge_attention_states needs one lse per output and at least one state")
    if len(outs) == 1:
        return outs[0], lses[0].float()
    lse_stack = torch.stack([lse.float() for lse in lses])  # [S, T, H]
    peak = lse_stack.max(dim=0).values  # [T, H]
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)  # all -inf -> 0
    weights = torch.exp(lse_stack - peak)  # [S, T, H]; exp(-inf) = 0
    total = weights.sum(dim=0)  # [T, H]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for shard_out, weight in zip(outs, weights, strict=True):
        # A shard with no keys for a row may hold NaN there; its weight is 0, so drop it.
        scaled = shard_out.float() * (weight / safe_total).unsqueeze(-1)
        out += torch.where((weight > 0).unsqueeze(-1), scaled, torch.zeros_like(scaled))
    lse = torch.log(total) + peak  # log(0) = -inf for rows with no keys
    return out.to(outs[0].dtype), lse
