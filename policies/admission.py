"""Overload arithmetic for the Conductor: decode load in the near future, and Retry-After.

Mooncake judges load by SLO attainment: a pool is loaded when its predicted TTFT (prefill)
or TBT (decode) exceeds the limit. Early rejection judges both at arrival. Because a
request reaches decode only after its prefill (``now + TTFT``), judging decode by its
*current* load makes prefill and decode load oscillate in anti-phase; the prediction
variant instead estimates decode load at that moment:

    running(at) = running now - those whose decode ends by ``at``
                  + requests whose prefill ends by ``at``

Every function here is plain arithmetic on numbers, so the live runtime, the simulator and
the tests share it. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

ADMISSION_MODES = ("early", "predictive", "none")


def slo_load(ttft: float, tbt: float, ttft_slo: float, tbt_slo: float) -> float:
    """Load as SLO attainment: ``max(ttft / ttft_slo, tbt / tbt_slo)``; > 1 means overloaded.

    Taking the larger of the prefill and the decode ratio is Mooncake's early rejection.
    """
    return max(ttft / ttft_slo, tbt / tbt_slo)


def running_at(
    num_running: int,
    finish_times: Sequence[float],
    now: float,
    at: float,
    decode_duration: float,
) -> float:
    """Expected number of the currently running decodes still running at time ``at``.

    With predicted ``finish_times`` (one per running request): those with a finish time
    after ``at``. Without them, Mooncake's assumption that every decode lasts a uniform
    ``decode_duration`` t_d, and running requests started uniformly over the last t_d
    (steady state), so a fraction ``min(1, (at - now) / t_d)`` of them ends by ``at``:

        ``running(at) = num_running * max(0, 1 - (at - now) / t_d)``
    """
    if finish_times:
        return float(sum(1 for f in finish_times if f > at))
    if decode_duration <= 0:
        return 0.0
    return num_running * max(0.0, 1.0 - (at - now) / decode_duration)


def prefill_done_by(queued_requests: float, queue_time: float, dt: float) -> float:
    """Expected number of the requests queued on a prefill instance that finish within
    ``dt`` seconds. The queue drains at a steady rate over ``queue_time``:

        ``done = queued_requests * min(1, dt / queue_time)``   (all of it if queue_time = 0)
    """
    if queued_requests <= 0:
        return 0.0
    if queue_time <= 0:
        return float(queued_requests)
    return queued_requests * min(1.0, dt / queue_time)


def time_until_finished(
    k: int,
    num_running: int,
    finish_times: Sequence[float],
    now: float,
    decode_duration: float,
) -> float:
    """Seconds until ``k`` of the running decodes have finished (0 if ``k <= 0``).

    With ``finish_times``: the k-th earliest, minus ``now``. Without: uniform ages over
    t_d mean they finish at a steady rate of ``num_running / t_d``, so ``k / num_running * t_d``.
    More than are running: ``t_d`` (or the last finish time), a full turnover.
    """
    if k <= 0:
        return 0.0
    if finish_times:
        ordered = sorted(finish_times)
        return max(0.0, ordered[min(k, len(ordered)) - 1] - now)
    if num_running <= 0:
        return decode_duration
    return min(1.0, k / num_running) * decode_duration


def ttft_retry_after(predicted_ttft: float, ttft_slo: float) -> float:
    """A prefill queue drains at one second of work per second, so after the excess
    ``predicted_ttft - ttft_slo`` the same request would meet the SLO (absent new arrivals).
    """
    return max(0.0, predicted_ttft - ttft_slo)


def finishes_needed(
    fits: Callable[[int], bool],
    num_running: int,
) -> int | None:
    """Smallest ``k`` in ``0..num_running`` with ``fits(k)`` true, or None (monotone
    predicate: finishing more requests never hurts), by binary search."""
    if not fits(num_running):
        return None
    lo, hi = 0, num_running
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def blocks_per_request(used_blocks: int, num_running: int) -> int:
    """Average KV blocks a running decode holds (``ceil(used / running)``; 0 if idle)."""
    return math.ceil(used_blocks / num_running) if num_running > 0 else 0
