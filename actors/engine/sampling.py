"""Sampling parameters of one request, and the sampler that turns logits into tokens.

Greedy when ``temperature == 0``. Sampling is stateless: token ``index`` of a request is drawn
with a generator seeded from ``(seed, index)``, so a seeded request draws the same tokens
whatever shares its batch, on whichever worker samples it, and after its KV was recomputed.
Requests without a seed get a random one when they are added.
"""

from __future__ import annotations

import torch

from policies.request import SampleSpec, SamplingParams

__all__ = ["SampleSpec", "SamplingParams", "sample", "token_seed"]


_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, index) -> distinct seeds


def token_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index) % (1 << 63)


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """One token per row. logits: [N, vocab] (any float dtype, any device)."""
    if not specs:
        return []
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, spec in enumerate(specs):
        if spec[0] != 0.0:
            out[i] = _sample_row(logits[i].cpu(), spec)
    return out


def _sample_row(row: torch.Tensor, spec: SampleSpec) -> int:
    """row: [vocab] fp32 logits -> a token drawn from the tempered, top-k/top-p cut softmax."""
    temperature, top_k, top_p, seed, index = spec
    row = row / temperature
    if top_k > 0 and top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator().manual_seed(token_seed(seed, index))
    return int(torch.multinomial(probs, 1, generator=generator).item())
