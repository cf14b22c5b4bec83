"""sim.regional_workload.diurnal_arrivals: the live cost bench's per-region arrival schedule."""

from __future__ import annotations

import math

import pytest

from sim.regional_workload import diurnal_arrivals

REGIONS = ("us", "eu", "asia")


def test_arrivals_ordered_in_window_and_deterministic() -> None:
    xs = diurnal_arrivals(20.0, 30.0, REGIONS, 30.0, 0.8, seed=3)
    times = [t for t, _ in xs]
    assert times == sorted(times)
    assert all(0.0 <= t < 30.0 for t in times)
    assert {g for _, g in xs} == set(REGIONS)
    assert xs == diurnal_arrivals(20.0, 30.0, REGIONS, 30.0, 0.8, seed=3)
    assert xs != diurnal_arrivals(20.0, 30.0, REGIONS, 30.0, 0.8, seed=4)


def test_total_rate_flat_and_each_region_peaks_a_third_apart() -> None:
    rate, period = 200.0, 30.0
    xs = diurnal_arrivals(rate, 3 * period, REGIONS, period, 0.8, seed=0)
    # the sum is Poisson at `rate`: within 4 standard deviations of its mean
    n = rate * 3 * period
    assert abs(len(xs) - n) < 4 * math.sqrt(n)
    # region k's share is highest in the sixth of the period around its peak at k / 3
    bins = 6
    for k, g in enumerate(REGIONS):
        counts = [0] * bins
        for t, r in xs:
            if r == g:
                phase = (t / period - k / 3 + 0.5 / bins) % 1.0
                counts[int(phase * bins)] += 1
        assert counts[0] == max(counts)
        # weight 1.8 at the peak against 0.2 at the trough: far more than twice
        assert counts[0] > 2 * counts[bins // 2]


def test_no_swing_splits_evenly() -> None:
    xs = diurnal_arrivals(300.0, 30.0, REGIONS, 30.0, 0.0, seed=1)
    share = [sum(1 for _, g in xs if g == r) / len(xs) for r in REGIONS]
    assert all(abs(s - 1 / 3) < 0.05 for s in share)


@pytest.mark.parametrize(
    "rate, duration, period, amplitude",
    [(0.0, 10.0, 10.0, 0.5), (1.0, 0.0, 10.0, 0.5), (1.0, 10.0, 0.0, 0.5), (1.0, 10.0, 10.0, 1.5)],
)
def test_bad_arguments_refused(rate, duration, period, amplitude) -> None:
    with pytest.raises(ValueError):
        diurnal_arrivals(rate, duration, REGIONS, period, amplitude)
