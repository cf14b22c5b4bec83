"""bench/pd_profile.py (``bench/pd_isolation.py --http --profile``): which row a thread is
charged to, and how a long gap's excess is split between the decode engine and delivery."""

from __future__ import annotations

import pytest

from bench import pd_profile as pp


def test_rows_by_process_title_and_thread_name():
    ours, client = {10, 11, 12, 13, 14}, 99
    assert pp._role("ray::pd-d0-ab:DecodeReplica.report", "decode-d0", 10, ours, client) == (
        pp.DECODE_ENGINE
    )
    assert pp._role("ray::pd-d0-ab:DecodeReplica", "grpc", 10, ours, client) == (
        "decode other threads"
    )
    assert pp._role("ray::pd-p0-ab:PrefillReplica", "prefill-p0", 11, ours, client) == (
        pp.PREFILL_ENGINE
    )
    title = "ray::ServeReplica:meridian:Replica-pd"
    assert pp._role(title, "meridian-engine", 12, ours, client) == pp.CONDUCTOR_LOOP
    assert pp._role("ray::ServeReplica:meridian:Ingress", "x", 13, ours, client) == "ingress"
    assert pp._role("ray::ProxyActor", "x", 14, ours, client) == "Serve proxy"
    assert pp._role("python bench.py", "x", 99, ours, client) == "client"
    assert pp._role("ray::ProxyActor", "x", 50, ours, client) == "other work"  # not ours


def test_a_gap_whose_engine_step_was_late_is_charged_to_the_engine():
    # steps every 20 ms up to 0.98, then one interval of 220 ms ending at 1.2, then every
    # 20 ms again; the long prompt arrives at 1.0 and its first token comes at 2.0
    ends = [0.02 * i for i in range(50)] + [1.2 + 0.02 * i for i in range(40)]
    steps = [(e - 0.015, e) for e in ends]
    # the client saw a gap of 150 ms across the late step (its excess all the engine's)
    # and one of 120 ms while the engine kept its pace (all delivery)
    times = [[1.07, 1.09, 1.24, 1.26, 1.28, 1.30, 1.32, 1.44, 1.46]]
    split, engine_p50, engine_p99 = pp.split_gaps(times, 1.0, 2.0, steps, 0.02)
    assert engine_p50 == pytest.approx(0.02)
    # 40 intervals during, one of them 220 ms: sim.metrics.percentile's p99 (numpy's linear
    # interpolation) lies 0.61 of the way from 20 ms to it
    assert engine_p99 == pytest.approx(0.02 + 0.61 * 0.2)
    assert split.gaps == 2
    assert split.excess == pytest.approx(0.13 + 0.10)
    assert split.engine == pytest.approx(0.13)
    assert split.delivery == pytest.approx(0.10)


def test_rates_of_an_engine_sampled_once_in_a_span_come_from_the_marks():
    """A starved sampler may read an engine thread once (or twice at one time) between two
    marks: its rate is then the marks' snapshots', never a division by a zero span."""
    snap0 = {pp.MACHINE: (0, 0), pp.DECODE_ENGINE: (0, 0)}
    snap1 = {pp.MACHINE: (2_000_000_000, 0), pp.DECODE_ENGINE: (500_000_000, 250_000_000)}
    samples = {pp.DECODE_ENGINE: [(1.5, 10, 5, 1), (1.5, 10, 5, 1)]}
    profile = pp.RunProfile({"arrival": (1.0, snap0), "first": (2.0, snap1)}, samples)
    rates = profile.rates("arrival", "first")
    assert rates[pp.DECODE_ENGINE] == (0.5, 0.25)
    assert rates[pp.OTHER][0] == 1.5  # the machine's 2 CPU-s less the rows'
