"""Runtime estimates the Conductor takes as inputs, and their fit to measured runs.

    prefill_time(new_tokens, cached_tokens) = base + a * new + b * cached + c * new * (new + cached)
    decode_tbt(batch_size, context_blocks)  = base + a * batch_size + b * context_blocks
    transfer_time(blocks)                   = blocks * block_bytes / bytes_per_second

The quadratic prefill term is attention over the prompt (each new token attends to every
earlier one), the cached term the cost of reading a reused prefix. ``fit_prefill_time`` and
``fit_decode_tbt`` are ordinary least squares over measured samples (``(new, cached,
seconds)`` and ``(batch, blocks, seconds)``), so the live runtime and the simulator fit
the same model the same way. Coefficients are clamped at zero (a cost never falls as the
work grows). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearPrefillTime:
    base: float = 0.0
    per_new_token: float = 0.0
    per_cached_token: float = 0.0
    per_attention_pair: float = 0.0

    def __call__(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * (new_tokens + cached_tokens)
        return (
            self.base
            + self.per_new_token * new_tokens
            + self.per_cached_token * cached_tokens
            + self.per_attention_pair * pairs
        )


@dataclass(frozen=True)
class LinearDecodeTBT:
    base: float = 0.0
    per_request: float = 0.0
    per_block: float = 0.0

    def __call__(self, batch_size: int, context_blocks: int) -> float:
        return self.base + self.per_request * batch_size + self.per_block * context_blocks


def transfer_time_fn(block_bytes: int, bytes_per_second: float) -> Callable[[int], float]:
    """``transfer_time(blocks)`` for a link of ``bytes_per_second``."""
    if block_bytes <= 0 or bytes_per_second <= 0:
        raise ValueError("block_bytes and bytes_per_second must be positive")

    def transfer_time(blocks: int) -> float:
        return max(0, blocks) * block_bytes / bytes_per_second

    return transfer_time


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """``argmin_x |A x - y|^2`` by the normal equations (Gaussian elimination with partial
    pivoting; a tiny ridge keeps a rank-deficient design solvable)."""
    if not rows or len(rows) != len(targets):
        raise ValueError("need as many targets as rows, and at least one")
    k = len(rows[0])
    # scale every column to at most 1 in magnitude: the normal equations stay well posed
    norms = [max(abs(r[i]) for r in rows) or 1.0 for i in range(k)]
    rows = [[r[i] / norms[i] for i in range(k)] for r in rows]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, targets, strict=True)) for i in range(k)]
    scale = max(abs(ata[i][i]) for i in range(k)) or 1.0
    for i in range(k):
        ata[i][i] += 1e-12 * scale
    m = [ata[i] + [aty[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            continue
        for r in range(k):
            if r != col and m[r][col] != 0:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] / norms[i] if m[i][i] else 0.0 for i in range(k)]


def fit_prefill_time(samples: Sequence[tuple[int, int, float]]) -> LinearPrefillTime:
    """Fit to measured ``(new tokens, cached tokens, seconds)`` prefill runs."""
    rows = [(1.0, float(n), float(c), float(n * (n + c))) for n, c, _ in samples]
    x = [max(0.0, v) for v in least_squares(rows, [t for _, _, t in samples])]
    return LinearPrefillTime(*x)


def fit_decode_tbt(samples: Sequence[tuple[int, int, float]]) -> LinearDecodeTBT:
    """Fit to measured ``(batch size, context blocks, seconds per step)`` decode steps."""
    rows = [(1.0, float(b), float(k)) for b, k, _ in samples]
    x = [max(0.0, v) for v in least_squares(rows, [t for _, _, t in samples])]
    return LinearDecodeTBT(*x)
