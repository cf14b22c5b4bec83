"""A runtime predictor fitted to measurements: seconds = w . features(batch).

Features follow the roofline's terms, so a fit needs few points and extrapolates sanely:
a constant (per-iteration overhead), new tokens (linear layers), causal attention pairs
(``n*c + n*(n+1)/2``), context tokens read (KV bytes) and the number of requests (LM head and
per-request work). Weights are fitted by non-negative least squares, so no term can make a
bigger batch predict less time. It implements the same ``batch_time`` as the roofline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from placement.cost_model import Batch

FEATURES = ("const", "tokens", "attn_pairs", "context", "requests")


def features(batch: Batch) -> list[float]:
    tokens = sum(n for n, _ in batch)
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in batch)
    context = sum(n + c for n, c in batch)
    return [1.0, float(tokens), float(pairs), float(context), float(len(batch))]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0: drop the most negative coefficient and refit until none is."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def trimmed_fit(
    rows: Sequence[Sequence[float]], seconds: Sequence[float], trim: float, passes: int
) -> list[float]:
    """Non-negative least squares of ``seconds ~ rows @ w``, then ``passes`` refits without
    the ``trim`` share of rows whose relative residual is largest (timing outliers: GC
    pauses, OS noise, a co-tenant on the core)."""
    if len(rows) != len(seconds) or not rows:
        raise ValueError("need one measured time per batch, and at least one")
    a = np.array(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    # Scale columns so the solver sees comparable magnitudes; undo after.
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    w = nnls(a / scale, y) / scale
    for _ in range(passes if trim > 0 else 0):
        resid = np.abs(a @ w - y) / np.maximum(y, 1e-12)
        keep = resid <= np.quantile(resid, 1.0 - trim)
        w = nnls(a[keep] / scale, y[keep]) / scale
    return [float(v) for v in w]


@dataclass
class FittedCostModel:
    weights: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))

    @classmethod
    def fit(cls, batches: Sequence[Batch], seconds: Sequence[float]) -> FittedCostModel:
        if len(batches) != len(seconds) or not batches:
            raise ValueError("need one measured time per batch, and at least one")
        a = np.array([features(b) for b in batches])
        # Scale columns so the solver sees comparable magnitudes; undo after.
        scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
        w = nnls(a / scale, np.asarray(seconds, dtype=float)) / scale
        return cls([float(v) for v in w])

    def batch_time(self, batch: Batch) -> float:
        if not batch:
            return 0.0
        return float(sum(w * f for w, f in zip(self.weights, features(batch), strict=True)))

    def describe(self) -> str:
        return ", ".join(f"{k}={w:.3g}" for k, w in zip(FEATURES, self.weights, strict=True))


SPLIT_FEATURES = (
    "const",
    "prefill_tokens",
    "prefill_attn_pairs",
    "prefill_requests",
    "decode_requests",
    "decode_context",
    "mixed",
    "mixed_decode_requests",
    "mixed_decode_context",
)


def split_features(batch: Batch) -> list[float]:
    """Prefill entries (``n > 1``) and decode entries (``n == 1``) priced separately, and
    decode entries priced again when the batch also holds a prompt chunk (``mixed``): an
    engine may run a pure-decode batch through a batched path and a mixed batch through a
    per-request one, so a decode costs differently in each."""
    p_tokens = p_pairs = p_reqs = d_reqs = d_ctx = 0
    for n, c in batch:
        if n > 1:
            p_tokens += n
            p_pairs += n * c + n * (n + 1) // 2
            p_reqs += 1
        else:
            d_reqs += 1
            d_ctx += c
    pure = [1.0, float(p_tokens), float(p_pairs), float(p_reqs)]
    if p_reqs:
        return pure + [0.0, 0.0, 1.0, float(d_reqs), float(d_ctx)]
    return pure + [float(d_reqs), float(d_ctx), 0.0, 0.0, 0.0]


@dataclass
class SplitFittedCostModel:
    """``seconds = w . split_features(batch)``, fitted like ``FittedCostModel``."""

    weights: list[float] = field(default_factory=lambda: [0.0] * len(SPLIT_FEATURES))

    @classmethod
    def fit(
        cls,
        batches: Sequence[Batch],
        seconds: Sequence[float],
        trim: float = 0.1,
        passes: int = 2,
    ) -> SplitFittedCostModel:
        """Least squares, then ``passes`` refits without the ``trim`` share of steps whose
        relative residual is largest (timing outliers: GC pauses, OS noise)."""
        return cls(trimmed_fit([split_features(b) for b in batches], seconds, trim, passes))

    def batch_time(self, batch: Batch) -> float:
        if not batch:
            return 0.0
        return float(sum(w * f for w, f in zip(self.weights, split_features(batch), strict=True)))

    def describe(self) -> str:
        return ", ".join(f"{k}={w:.3g}" for k, w in zip(SPLIT_FEATURES, self.weights, strict=True))


PADDED_FEATURES = ("const", "tokens", "attn_padded", "kv_padded", "requests")


def padded_features(batch: Batch, block_size: int) -> list[float]:
    """Terms of an engine that pads the batch, like the torch reference attention backend:
    every sequence's KV is gathered into ``[B, L, ...]`` with ``L`` the longest context
    rounded up to whole blocks, and queries into ``[B, max_q, ...]``, so one step costs

        const + a * tokens (linear layers) + b * B * max_q * L (masked attention and its
        mask) + c * B * L (the KV gather) + d * B (per-request work: metadata, sampling,
        detokenizing)

    A short decode riding with a long prompt chunk pays the chunk's ``max_q``: that is the
    batch-composition cost a pairs-only model misses."""
    num = len(batch)
    max_q = max(n for n, _ in batch)
    length = -(-max(n + c for n, c in batch) // block_size) * block_size
    tokens = sum(n for n, _ in batch)
    return [1.0, float(tokens), float(num * max_q * length), float(num * length), float(num)]


@dataclass
class PaddedFittedCostModel:
    """``seconds = w . padded_features(batch, block_size)``, fitted like the split model."""

    block_size: int
    weights: list[float] = field(default_factory=lambda: [0.0] * len(PADDED_FEATURES))

    @classmethod
    def fit(
        cls,
        block_size: int,
        batches: Sequence[Batch],
        seconds: Sequence[float],
        trim: float = 0.1,
        passes: int = 2,
    ) -> PaddedFittedCostModel:
        rows = [padded_features(b, block_size) for b in batches]
        return cls(block_size, trimmed_fit(rows, seconds, trim, passes))

    def batch_time(self, batch: Batch) -> float:
        if not batch:
            return 0.0
        f = padded_features(batch, self.block_size)
        return float(sum(w * x for w, x in zip(self.weights, f, strict=True)))

    def describe(self) -> str:
        return ", ".join(f"{k}={w:.3g}" for k, w in zip(PADDED_FEATURES, self.weights, strict=True))
