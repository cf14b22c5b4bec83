"""Sampling parameters of one request, and the sampler that turns logits into tokens.

Greedy when ``temperature == 0``. Each request owns a ``torch.Generator``: seeded requests
draw the same tokens whatever else shares their batch (given the same logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None  # stop strings; not part of the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError("max_tokens must be an integer")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row. logits: [N, vocab] (any float dtype, any device)."""
    if not params:
        return []
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i].cpu(), p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """row: [vocab] fp32 logits -> a token drawn from the tempered, top-k/top-p cut softmax."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=g).item())
