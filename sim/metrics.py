"""Per-request latency records and the cluster-wide summary.

Definitions (Mooncake section 5.1):
- TTFT: first token time minus arrival;
- TPOT: (finish - first token) / (output tokens - 1), the mean gap;
- TBT: the mean of the longest 10% (rounded up, at least one) of a request's token gaps;
- a request is *effective* when TTFT <= ttft_slo and TBT <= tbt_slo; a rejected request is
  never effective. SLO attainment is the effective share of all arrived requests.
Invariant: every arrived request ends exactly once, either finished or rejected.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    request_id: str
    arrival: float
    input_len: int
    output_len: int
    cached_tokens: int = 0  # prefix-cache hit when its prefill was admitted
    first_token: float | None = None
    finish: float | None = None
    rejected: str | None = None  # the reason, when rejected
    prefill_instance: int | None = None
    decode_instance: int | None = None
    ttft: float | None = None
    tpot: float | None = None
    tbt: float | None = None
    _last: float | None = None
    _gaps: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
            self.ttft = now - self.arrival
        elif self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now

    def on_finish(self, now: float) -> None:
        self.finish = now
        gaps = self._gaps
        if gaps:
            k = max(1, math.ceil(0.1 * len(gaps)))
            self.tbt = sum(heapq.nlargest(k, gaps)) / k
            self.tpot = sum(gaps) / len(gaps)
        else:
            self.tbt = self.tpot = 0.0
        self._gaps = []

    def on_reject(self, reason: str, now: float) -> None:
        self.rejected = reason
        self.finish = now
        self._gaps = []

    @property
    def done(self) -> bool:
        return self.finish is not None and self.rejected is None

    def effective(self, ttft_slo: float, tbt_slo: float) -> bool:
        return (
            self.done
            and self.ttft is not None
            and self.ttft <= ttft_slo
            and (self.tbt or 0.0) <= tbt_slo
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``, interpolated linearly between
    the two nearest ranks (numpy's default, which vLLM's benchmarks report); NaN when empty.
    The one definition every bench and simulator report uses, so their tails compare."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"q is a percentile in [0, 100], got {q}")
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Summary:
    arrived: int
    completed: int
    rejected: int
    unfinished: int
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_mean: float
    tbt_mean: float
    tbt_p90: float
    cache_hit_ratio: float  # cached prompt tokens / prompt tokens of completed requests
    attainment: dict[float, float]  # tbt_slo -> effective share of arrived requests
    ttft_slo: float
    makespan: float

    def row(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, dict)}


def summarize(
    stats: Iterable[RequestStats],
    ttft_slo: float = 30.0,
    tbt_slos: Iterable[float] = (0.1, 0.2, 0.3),
) -> Summary:
    stats = list(stats)
    done = [s for s in stats if s.done]
    ttft = [s.ttft for s in done if s.ttft is not None]
    tbt = [s.tbt for s in done if s.tbt is not None]
    tpot = [s.tpot for s in done if s.tpot is not None]
    prompt = sum(s.input_len for s in done)
    n = len(stats)
    return Summary(
        arrived=n,
        completed=len(done),
        rejected=sum(1 for s in stats if s.rejected is not None),
        unfinished=sum(1 for s in stats if s.finish is None),
        ttft_mean=sum(ttft) / len(ttft) if ttft else float("nan"),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tpot_mean=sum(tpot) / len(tpot) if tpot else float("nan"),
        tbt_mean=sum(tbt) / len(tbt) if tbt else float("nan"),
        tbt_p90=percentile(tbt, 90),
        cache_hit_ratio=sum(s.cached_tokens for s in done) / prompt if prompt else 0.0,
        attainment={
            slo: (sum(1 for s in stats if s.effective(ttft_slo, slo)) / n if n else 0.0)
            for slo in tbt_slos
        },
        ttft_slo=ttft_slo,
        makespan=max((s.finish or 0.0) for s in stats) if stats else 0.0,
    )
