"""Sparse mixture-of-experts plumbing, Mixtral style (matches HF ``MixtralSparseMoeBlock``).

``route``: softmax over all experts in float32, top-k, renormalise the k weights to sum to 1.
``dispatch``: sort the (token, expert) pairs by expert so each expert sees one contiguous slab.
``combine``: scale each expert output by its routing weight and add it back to its token.
The expert computation in between is the caller's (a loop over experts, or remote expert
workers that each receive their slab).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits: [T, E]`` -> ``(weights [T, k] float32, expert_ids [T, k] int64)``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


@dataclass
class ExpertDispatch:
    """Where each (token, choice) pair goes. ``N = T * k`` pairs, grouped by expert."""

    token_ids: torch.Tensor  # [N] int64: input row of each pair, in expert order
    pair_ids: torch.Tensor  # [N] int64: flat index ``t * k + choice`` into the [T, k] weights
    counts: list[int]  # [E]: pairs per expert; expert e owns rows offsets[e]:offsets[e+1]
    offsets: list[int]  # [E + 1]

    def slab(self, expert: int) -> slice:
        return slice(self.offsets[expert], self.offsets[expert + 1])


def dispatch(expert_ids: torch.Tensor, num_experts: int) -> ExpertDispatch:
    """Group the pairs of ``expert_ids: [T, k]`` by expert (stable: tokens stay in order)."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return ExpertDispatch(token_ids=order // top_k, pair_ids=order, counts=counts, offsets=offsets)


def combine(
    expert_out: torch.Tensor,
    plan: ExpertDispatch,
    weights: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """``expert_out: [N, H]`` in dispatch order -> ``[T, H]`` weighted sum per token.

    The product with the float32 weight is cast back to ``expert_out.dtype`` before the sum,
    as Hugging Face does.
    """
    scale = weights.reshape(-1)[plan.pair_ids].unsqueeze(-1)  # [N, 1] float32
    scaled = (expert_out * scale).to(expert_out.dtype)
    out = torch.zeros(
        num_tokens, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device
    )
    out.index_add_(0, plan.token_ids, scaled)
    return out
