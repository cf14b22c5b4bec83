"""A replica's runtime predictor: how long one batch takes, fitted online from its steps.

A batch is ``placement.cost_model.Batch``: ``(new tokens, context tokens)`` per request, a
prefill chunk at its context offset or a decode ``(1, context)``. Until it has measured
enough steps the predictor answers from its ``prior`` (the simulator's roofline, or a
coarse cold-start guess); after that from the step model the Conductor's fitter fits
(``policies.pd_costs.CostFitter``, one implementation for both): ``base + a * new + b *
context + c * attention pairs + r * requests`` per step, refitted over a sliding window as
steps arrive (or once, from a calibration's steps, by ``fit_steps``).

On top of ``batch_time`` it answers what a scheduler asks: a request's remaining prefill
time (its uncomputed tokens in chunks, each reading the context before it), the smallest
efficient chunk at a context offset, and the largest chunk that keeps a batch under a
target time. Those are what ``policies.slack`` and ``policies.batch_packer`` take (through
their small protocols; policies never import this module).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from placement.cost_model import Batch, CostModel
from policies.dualpath import attention_time_fn
from policies.pd_costs import CostFitter, LinearPrefillTime, fit_prefill_time

# Before the first fit and without a prior: 1 ms per step and 0.1 ms per new token (the
# order of the tiny model on one CPU core); replaced after ``min_samples`` measured steps.
COLD_START = LinearPrefillTime(base=1e-3, per_new_token=1e-4)
MAX_TERMS = 64  # most chunk predictions one remaining-prefill estimate makes
OVERRUN_WINDOW = 64  # recent steps whose measured / predicted ratios ``overrun`` reads


class RuntimePredictor:
    """``prefill_time`` is the fitted step model (``LinearPrefillTime``), the attribute
    ``CostFitter.refit`` sets on a Conductor; None until the first fit."""

    def __init__(
        self,
        prior: CostModel | None = None,
        chunk_size: int = 512,
        window: int = 256,
        min_samples: int = 16,
        refit_every: int = 16,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.prior = prior
        self.chunk_size = chunk_size  # chunks of a remaining-prefill estimate
        self.fitter = CostFitter(
            block_bytes=1,
            chunk_size=chunk_size,
            window=window,
            min_samples=min_samples,
            refit_every=refit_every,
        )
        self.prefill_time: LinearPrefillTime | None = None
        # measured / predicted seconds of recent steps with a prompt chunk, each predicted
        # by the fit in force when it was measured (none before the first fit)
        self.overruns: deque[float] = deque(maxlen=OVERRUN_WINDOW)
        self._observed = 0  # steps observed: the key of the cached ``overrun`` answer
        self._overrun: tuple[int, float, float] = (-1, 0.0, 1.0)  # (key, quantile, answer)

    # -- fitting -----------------------------------------------------------------------------
    def observe(self, batch: Batch, seconds: float) -> bool:
        """Record one measured step; True when it triggered a refit."""
        if not batch or seconds <= 0:
            return False
        predicted = self.prefill_time.step_time(batch) if self.prefill_time else 0.0
        if predicted > 0 and any(n > 1 for n, _ in batch):
            self.overruns.append(seconds / predicted)
        self._observed += 1
        self.fitter.add_prefill_step(list(batch), seconds)
        return "prefill" in self.fitter.refit(self)

    def fit_steps(
        self, batches: Sequence[Batch], seconds: Sequence[float], trim: float = 0.0
    ) -> None:
        """Fit the step model once from measured steps (an offline calibration, e.g. a grid of
        step shapes), by the fitter ``observe`` refits with; ``trim``: refit without that
        share of worst-fitting steps (timing outliers)."""
        if len(batches) != len(seconds):
            raise ValueError("need one measured time per batch")
        samples = [(list(b), t) for b, t in zip(batches, seconds, strict=True) if b and t > 0]
        self.prefill_time = fit_prefill_time(samples, self.chunk_size, trim)

    @property
    def fitted(self) -> bool:
        return self.prefill_time is not None

    def overrun(self, quantile: float, min_steps: int = 8) -> float:
        """The ``quantile`` of recent steps' measured over predicted time (steps with a
        prompt chunk, the last ``OVERRUN_WINDOW``): how far a step can run over the fitted
        mean. 1.0 until ``min_steps`` such steps were measured after a fit."""
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be in [0, 1]")
        key, q, answer = self._overrun
        if key == self._observed and q == quantile:
            return answer
        answer = 1.0
        if len(self.overruns) >= max(1, min_steps):
            s = sorted(self.overruns)
            answer = s[min(len(s) - 1, int(quantile * len(s)))]
        self._overrun = (self._observed, quantile, answer)
        return answer

    # -- predictions ---------------------------------------------------------------------------
    def batch_time(self, batch: Batch) -> float:
        """Seconds one step computing ``batch`` takes (0 for an empty batch)."""
        if not batch:
            return 0.0
        if self.prefill_time is not None:
            return self.prefill_time.step_time(batch)
        if self.prior is not None:
            return self.prior.batch_time(batch)
        return COLD_START.step_time(batch)

    def attention_time(self, batch: Batch) -> float:
        """Seconds of one step computing ``batch`` spent on attention: its (new token,
        earlier token) pairs and context reads, from the fitted step model (DualPath's
        attention quota, ``policies.dualpath``). Before the first fit the cold-start model,
        which has no attention terms: 0, so only the token budget bounds a step."""
        return attention_time_fn(self.prefill_time or COLD_START)(batch)

    def remaining_prefill_time(
        self, new_tokens: int, context_tokens: int, chunk: int | None = None
    ) -> float:
        """Seconds to compute ``new_tokens`` prompt tokens after ``context_tokens`` already
        in KV, alone, in chunks of ``chunk`` (default ``chunk_size``). A prompt of more
        than ``MAX_TERMS`` chunks is priced in ``MAX_TERMS`` runs of equal chunks, each at
        its middle chunk's context (exact for costs linear in the context; a 1M-token
        prompt costs 64 predictions, not thousands)."""
        step = chunk or self.chunk_size
        if new_tokens <= 0:
            return 0.0
        full, tail = divmod(new_tokens, step)
        t = self.batch_time([(tail, context_tokens + full * step)]) if tail else 0.0
        runs = min(full, MAX_TERMS)
        for k in range(runs):
            first, last = k * full // runs, (k + 1) * full // runs  # chunks [first, last)
            middle = (first + last - 1) / 2
            at = context_tokens + int(middle * step)
            t += (last - first) * self.batch_time([(step, at)])
        return t

    def efficient_chunk(
        self, context_tokens: int, tolerance: float = 0.25, limit: int = 8192
    ) -> int:
        """The smallest chunk at ``context_tokens`` whose time per token is within
        ``tolerance`` of the best chunk up to ``limit``: below it the step's fixed costs
        (launch, weights, reading the context) dominate. Time per token falls and then
        rises with the chunk (attention), so the search runs on its falling side."""
        if limit < 1:
            raise ValueError("limit must be at least 1")

        def per_token(n: int) -> float:
            return self.batch_time([(n, context_tokens)]) / n

        sizes = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
        best = min(sizes, key=per_token)
        goal = per_token(best) * (1.0 + tolerance)
        lo, hi = 1, best  # per_token(hi) <= goal; find the smallest such n on [1, best]
        while lo < hi:
            mid = (lo + hi) // 2
            if per_token(mid) <= goal:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def largest_chunk(self, batch: Batch, context_tokens: int, target: float, limit: int) -> int:
        """The most new tokens (at most ``limit``) one request at ``context_tokens`` may add
        to ``batch`` with the step still predicted at most ``target`` seconds; 0 if not
        even one fits. Batch time grows with the chunk, so a binary search finds it."""
        base = list(batch)

        def fits(n: int) -> bool:
            return self.batch_time([*base, (n, context_tokens)]) <= target

        if limit < 1 or not fits(1):
            return 0
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        m = self.prefill_time
        if m is None:
            return "prior" if self.prior is not None else "cold start"
        return (
            f"base={m.base:.3g}s new={m.per_new_token:.3g}s/token "
            f"context={m.per_cached_token:.3g}s/token pairs={m.per_attention_pair:.3g}s/pair "
            f"request={m.per_request:.3g}s"
        )


class TailStepTime:
    """The step predictor Medha's batch packer sizes chunks with: the fitted step time
    times the ``quantile`` of recent steps' measured / predicted ratio
    (``RuntimePredictor.overrun``). The fit is a mean, and a TBT SLO bounds a tail: where
    steps' times scatter around the fit (cores shared by pipeline stages, the driver and
    other processes), a chunk sized to the mean runs over the target in about half the
    steps; sized to this, in about ``1 - quantile`` of them. Where the fit is exact the
    ratio is 1 and this is the fit. The efficient chunk is the fit's (a scale changes no
    per-token comparison); slack and deadlines keep the mean (``RuntimePredictor``)."""

    def __init__(self, predictor: RuntimePredictor, quantile: float = 0.9) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be in [0, 1]")
        self.predictor = predictor
        self.quantile = quantile

    def factor(self) -> float:
        return self.predictor.overrun(self.quantile)

    def batch_time(self, batch: Batch) -> float:
        return self.predictor.batch_time(batch) * self.factor()

    def efficient_chunk(self, context_tokens: int) -> int:
        return self.predictor.efficient_chunk(context_tokens)

    def largest_chunk(self, batch: Batch, context_tokens: int, target: float, limit: int) -> int:
        return self.predictor.largest_chunk(batch, context_tokens, target / self.factor(), limit)
