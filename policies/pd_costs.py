"""Runtime estimates the Conductor takes as inputs, and their fit to measured runs.

    prefill_time(new, cached) = sum over the prompt's chunks k (n_k new tokens after c_k
                                of context, c_0 = cached) of
                                base + a * n_k + b * c_k + c * n_k * (n_k + c_k) + r
    decode_tbt(batch_size, context_blocks)  = base + a * batch_size + b * context_blocks
    transfer_time(blocks)                   = blocks * block_bytes / bytes_per_second

The quadratic prefill term is attention over the prompt (each new token attends to every
earlier one), the cached term the cost of reading a reused prefix; a prompt longer than
the chunk size runs as several steps, each paying ``base`` and reading the context before
it, and ``r`` is paid once per request of a step (sampling, its row of the LM head, its
metadata), so a step of many decodes costs more than one of a single decode.
``fit_prefill_time`` fits measured steps (``(chunks, seconds)``) by non-negative least
squares on *relative* residuals (each step weighted by ``1 / seconds``: a 1 ms decode step
counts as much as a 10 ms chunk, so the model is right for both, not only for the
biggest steps), optionally refitted without the worst-fitting share of steps (timing
outliers). ``fit_decode_tbt`` is least squares over ``(batch, blocks, seconds)``,
refitted without the share ``decode_trim`` of steps farthest from the fit (so a few host
stalls do not swing the slope), ``fit_transfer_time`` the mean bandwidth of measured
copies, so the live runtime and the simulator fit the same model the same way.
Coefficients are never negative (a cost never falls as the work grows). ``CostFitter``
keeps a sliding window of each and refits a Conductor's estimates as measurements arrive.
Stdlib only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LinearPrefillTime:
    base: float = 0.0  # per step (kernel launches, sampling, the step's fixed cost)
    per_new_token: float = 0.0
    per_cached_token: float = 0.0  # per token of context read before the chunk
    per_attention_pair: float = 0.0
    chunk_size: int = 0  # prompts run in chunks of this many tokens (0: one pass)
    per_request: float = 0.0  # per request of a step (a prompt's chunk is one per step)

    def __call__(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        step = self.chunk_size if self.chunk_size > 0 else new_tokens
        chunks = [
            (min(step, new_tokens - done), cached_tokens + done)
            for done in range(0, new_tokens, step)
        ]
        steps, new, context, pairs = prefill_features(chunks)
        return (
            (self.base + self.per_request) * steps
            + self.per_new_token * new
            + self.per_cached_token * context
            + self.per_attention_pair * pairs
        )

    def step_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One step running ``chunks`` together, each ``(new tokens, context tokens)`` (a
        decode is ``(1, context)``): the model ``fit_prefill_time`` fits to measured steps,
        the fixed cost counted once."""
        if not chunks:
            return 0.0
        steps, new, context, pairs = prefill_features(chunks)
        return (
            self.base
            + self.per_request * steps
            + self.per_new_token * new
            + self.per_cached_token * context
            + self.per_attention_pair * pairs
        )


def prefill_features(chunks: Sequence[tuple[int, int]]) -> tuple[float, float, float, float]:
    """(steps, new tokens, context tokens, attention pairs) of running ``chunks``, each
    ``(new tokens, context tokens before them)``, one step per chunk."""
    steps = new = context = pairs = 0.0
    for n, c in chunks:
        steps += 1
        new += n
        context += c
        pairs += n * (n + c)
    return steps, new, context, pairs


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


def nonnegative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float]
) -> list[float]:
    """``least_squares`` with every coefficient >= 0: drop the most negative coefficient's
    column and refit until none is negative (active set; a handful of columns here)."""
    active = list(range(len(rows[0]))) if rows else []
    x = [0.0] * len(active)
    while active:
        sol = least_squares([[r[i] for i in active] for r in rows], targets)
        if min(sol) >= 0:
            for i, v in zip(active, sol, strict=True):
                x[i] = v
            return x
        active.pop(min(range(len(sol)), key=sol.__getitem__))
    return x


def fit_prefill_time(
    samples: Sequence[tuple[Sequence[tuple[int, int]], float]],
    chunk_size: int = 0,
    trim: float = 0.0,
    passes: int = 2,
) -> LinearPrefillTime:
    """Fit to measured steps: ``(chunks, seconds)`` with ``chunks`` the ``(new tokens,
    context tokens)`` of each request the step ran (a decode is ``(1, context)``; their
    features add up, the step's fixed cost counts once). Non-negative least squares on
    relative residuals (rows scaled by ``1 / seconds``); then ``passes`` refits without the
    ``trim`` share of steps whose relative residual is largest. Predictions split prompts
    by ``chunk_size``."""
    if not samples or any(t <= 0 for _, t in samples):
        raise ValueError("need at least one measured step, each of a positive duration")
    feats = [(1.0, *prefill_features(chunks)[1:], float(len(chunks))) for chunks, _ in samples]
    seconds = [t for _, t in samples]

    def solve(keep: Sequence[int]) -> list[float]:
        rows = [[f / seconds[i] for f in feats[i]] for i in keep]
        return nonnegative_least_squares(rows, [1.0] * len(rows))

    keep = list(range(len(samples)))
    w = solve(keep)
    for _ in range(passes if trim > 0 else 0):
        resid = [abs(sum(a * f for a, f in zip(w, x, strict=True)) - t) / t
                 for x, t in zip(feats, seconds, strict=True)]  # fmt: skip
        cut = sorted(resid)[min(len(resid) - 1, int((1.0 - trim) * len(resid)))]
        keep = [i for i, r in enumerate(resid) if r <= cut]
        w = solve(keep)
    base, new, context, pairs, per_request = w
    return LinearPrefillTime(base, new, context, pairs, chunk_size, per_request)


def fit_decode_tbt(
    samples: Sequence[tuple[int, int, float]], trim: float = 0.0, passes: int = 2
) -> LinearDecodeTBT:
    """Fit to measured ``(batch size, context blocks, seconds per step)`` decode steps by
    least squares; then ``passes`` refits without the ``trim`` share of steps farthest
    above or below the fit (stalls of the host, not of the batch)."""
    rows = [(1.0, float(b), float(k)) for b, k, _ in samples]
    seconds = [t for _, _, t in samples]
    keep = list(range(len(rows)))
    x = [max(0.0, v) for v in least_squares(rows, seconds)]
    for _ in range(passes if trim > 0 and len(rows) > 3 else 0):
        resid = [abs(sum(a * f for a, f in zip(x, r, strict=True)) - t)
                 for r, t in zip(rows, seconds, strict=True)]  # fmt: skip
        cut = sorted(resid)[min(len(resid) - 1, int((1.0 - trim) * len(resid)))]
        keep = [i for i, e in enumerate(resid) if e <= cut]
        fit = least_squares([rows[i] for i in keep], [seconds[i] for i in keep])
        x = [max(0.0, v) for v in fit]
    return LinearDecodeTBT(*x)


def fit_transfer_time(
    samples: Sequence[tuple[int, float]], block_bytes: int
) -> Callable[[int], float]:
    """``transfer_time(blocks)`` at the bandwidth of measured ``(blocks, seconds)`` copies."""
    nbytes = sum(b for b, _ in samples) * block_bytes
    seconds = sum(t for _, t in samples)
    if nbytes <= 0 or seconds <= 0:
        raise ValueError("need at least one measured copy of a positive size and duration")
    return transfer_time_fn(block_bytes, nbytes / seconds)


class CostFitter:
    """The last ``window`` measurements of each kind; ``refit`` replaces a Conductor's
    estimates (any object with ``prefill_time``, ``decode_tbt`` and ``transfer_time``)
    with fits once a kind has ``min_samples`` and ``refit_every`` new ones since its last
    fit. A kind never measured keeps the estimate it had."""

    def __init__(
        self,
        block_bytes: int,
        chunk_size: int = 0,
        window: int = 256,
        min_samples: int = 8,
        refit_every: int = 8,
        decode_trim: float = 0.1,
    ) -> None:
        if window < min_samples or min_samples < 1 or refit_every < 1:
            raise ValueError("need window >= min_samples >= 1 and refit_every >= 1")
        self.block_bytes = block_bytes
        self.chunk_size = chunk_size
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.decode_trim = decode_trim
        self.prefill: deque[tuple[tuple[tuple[int, int], ...], float]] = deque(maxlen=window)
        self.decode: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.transfer: deque[tuple[int, float]] = deque(maxlen=window)
        self._new = {"prefill": 0, "decode": 0, "transfer": 0}
        self.num_fits = {"prefill": 0, "decode": 0, "transfer": 0}

    def add_prefill_step(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        if chunks and seconds > 0:  # the fit weighs steps by 1 / seconds
            self.prefill.append((tuple((int(n), int(c)) for n, c in chunks), float(seconds)))
            self._new["prefill"] += 1

    def add_decode_step(self, batch_size: int, context_blocks: int, seconds: float) -> None:
        if batch_size > 0:
            self.decode.append((int(batch_size), int(context_blocks), float(seconds)))
            self._new["decode"] += 1

    def add_transfer(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0:
            self.transfer.append((int(blocks), float(seconds)))
            self._new["transfer"] += 1

    def _due(self, kind: str, samples: Sized) -> bool:
        return len(samples) >= self.min_samples and self._new[kind] >= self.refit_every

    def refit(self, conductor: Any) -> list[str]:
        """Refit what is due; returns the kinds refitted."""
        done = []
        if self._due("prefill", self.prefill):
            conductor.prefill_time = fit_prefill_time(list(self.prefill), self.chunk_size)
            done.append("prefill")
        if self._due("decode", self.decode):
            conductor.decode_tbt = fit_decode_tbt(list(self.decode), self.decode_trim)
            done.append("decode")
        if self._due("transfer", self.transfer):
            conductor.transfer_time = fit_transfer_time(list(self.transfer), self.block_bytes)
            done.append("transfer")
        for kind in done:
            self._new[kind] = 0
            self.num_fits[kind] += 1
        return done
