"""Split one trace across regions whose load follows a diurnal curve offset in time.

Region ``k`` of ``n`` has weight ``w_k(t) = 1 + amplitude * cos(2 pi (t / period - k / n))``
at time ``t``: each region peaks a ``period / n`` after the previous one, and the weights
sum to ``n`` at every instant, so the aggregate load is the trace's own (the SkyWalker
paper's premise: regional loads swing, their sum is steady). A conversation (``session``)
is drawn into one region at its first request, with probability proportional to the
weights then, and keeps it: a user does not change continent mid-conversation.

Session keys: a Mooncake request's first two hash ids (the trace's system prompt, then the
conversation's own first block); a request without hash ids is its own session.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from sim.workload import TraceRequest


def session_key(req: TraceRequest) -> str:
    if req.hash_ids:
        return "s" + "-".join(map(str, req.hash_ids[:2]))
    return "r" + req.request_id


def region_weights(t: float, n: int, period: float, amplitude: float) -> list[float]:
    return [1.0 + amplitude * math.cos(2 * math.pi * (t / period - k / n)) for k in range(n)]


def split_regions(
    requests: Sequence[TraceRequest],
    regions: Sequence[str],
    period: float,
    amplitude: float = 0.8,
    seed: int = 0,
) -> tuple[list[TraceRequest], dict[str, str]]:
    """The requests with session ids set, and each request id's region."""
    if not 0.0 <= amplitude <= 1.0:
        raise ValueError("amplitude must be in [0, 1]")
    if period <= 0:
        raise ValueError("period must be positive")
    rng = random.Random(seed)
    n = len(regions)
    home: dict[str, str] = {}
    out: list[TraceRequest] = []
    region_of: dict[str, str] = {}
    for r in requests:
        key = session_key(r)
        if key not in home:
            w = region_weights(r.arrival, n, period, amplitude)
            home[key] = rng.choices(list(regions), weights=w)[0]
        out.append(replace(r, session_id=key))
        region_of[r.request_id] = home[key]
    return out, region_of


def diurnal_arrivals(
    rate: float,
    duration: float,
    regions: Sequence[str],
    period: float,
    amplitude: float = 0.8,
    seed: int = 0,
) -> list[tuple[float, str]]:
    """(time, region) of Poisson arrivals at ``rate`` per second over ``[0, duration)``,
    in time order, each one's region drawn in proportion to ``region_weights`` at its time:
    region ``k`` then receives a Poisson stream of rate ``rate * w_k(t) / len(regions)``."""
    if rate <= 0 or duration <= 0 or period <= 0:
        raise ValueError("rate, duration and period must be positive")
    if not 0.0 <= amplitude <= 1.0:
        raise ValueError("amplitude must be in [0, 1]")
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = rng.expovariate(rate)
    while t < duration:
        w = region_weights(t, len(regions), period, amplitude)
        out.append((t, rng.choices(list(regions), weights=w)[0]))
        t += rng.expovariate(rate)
    return out
