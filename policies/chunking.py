"""How many prompt tokens one request may prefill in one iteration. Pure and pluggable."""

from __future__ import annotations

from typing import Protocol

from policies.sequence import Sequence


class ChunkRule(Protocol):
    def chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute now, at most ``budget`` and its uncomputed tokens."""
        ...


class FixedChunk:
    """At most ``size`` tokens per request per iteration; ``None`` means the whole prompt."""

    def __init__(self, size: int | None = None) -> None:
        if size is not None and size <= 0:
            raise ValueError("chunk size must be positive or None")
        self.size = size

    def chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        return n if self.size is None else min(n, self.size)
