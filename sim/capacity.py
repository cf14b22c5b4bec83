"""Effective request capacity: the highest load at which a target share of requests meets
both SLOs (Mooncake section 5.1), found by replaying a trace at several speeds.

Load is the replay speed (arrival times divided by it). ``attainment_curve`` runs the
cluster once per speed and keeps the whole summary, so every TBT SLO is read from the same
runs when admission does not depend on the SLO. ``capacity`` reads the highest speed whose
attainment is at least ``target``, interpolating linearly where the curve crosses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sim.cluster import ClusterBase
from sim.metrics import Summary, summarize
from sim.workload import TraceRequest, scale_time


def attainment_curve(
    build: Callable[[], ClusterBase],
    requests: Sequence[TraceRequest],
    speeds: Sequence[float],
    ttft_slo: float,
    tbt_slos: Sequence[float],
) -> dict[float, Summary]:
    out = {}
    for speed in sorted(speeds):
        stats = build().run(scale_time(requests, speed))
        out[speed] = summarize(stats, ttft_slo, tbt_slos)
    return out


def capacity(curve: dict[float, Summary], tbt_slo: float, target: float = 0.9) -> float:
    """Highest speed with attainment >= target (0 if none), interpolated between points."""
    speeds = sorted(curve)
    att = [curve[s].attainment[tbt_slo] for s in speeds]
    best = 0.0
    for i, (s, a) in enumerate(zip(speeds, att, strict=True)):
        if a < target:
            continue
        best = s
        if i + 1 < len(speeds) and att[i + 1] < target:
            s2, a2 = speeds[i + 1], att[i + 1]
            best = s + (s2 - s) * (a - target) / (a - a2)
    return best


def search_capacity(
    build: Callable[[], ClusterBase],
    requests: Sequence[TraceRequest],
    ttft_slo: float,
    tbt_slo: float,
    target: float = 0.9,
    lo: float = 0.25,
    hi: float = 8.0,
    iters: int = 6,
) -> float:
    """Bisection over the speed, for when the admission depends on the SLO."""

    def ok(speed: float) -> bool:
        s = summarize(build().run(scale_time(requests, speed)), ttft_slo, [tbt_slo])
        return s.attainment[tbt_slo] >= target

    if not ok(lo):
        return 0.0
    if ok(hi):
        return hi
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
