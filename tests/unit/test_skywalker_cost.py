"""The SkyWalker cost experiment on a small steady trace split by a diurnal curve."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from sim.metrics import RequestStats
from sim.skywalker_cost import CostSetup, attainment, even, experiment, format_result
from sim.skywalker_eval import steady_arrivals
from sim.workload import TraceRequest


def steady_trace(path: Path, n: int, gap_s: float) -> Path:
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        rows.append(f"{(t0 + timedelta(seconds=i * gap_s)).isoformat(' ')},600,40")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_attainment_counts_misses_and_unanswered_per_region():
    stats = [
        RequestStats("a", 0.0, 10, 1, ttft=0.5),
        RequestStats("b", 0.0, 10, 1, ttft=3.0),
        RequestStats("c", 0.0, 10, 1),  # never answered
        RequestStats("d", 0.0, 10, 1, ttft=0.1),
    ]
    region_of = {"a": "us", "b": "us", "c": "eu", "d": "eu"}
    assert attainment(stats, region_of, 2.0) == {"us": 0.5, "eu": 0.5, "asia": 1.0}


def test_even_split_gives_the_remainder_to_the_first_regions():
    assert even(7) == (3, 2, 2)
    assert even(9) == (3, 3, 3)


def test_global_provisioning_needs_fewer_replicas_at_the_same_attainment(tmp_path):
    trace = steady_trace(tmp_path / "steady.csv", 900, 0.02)
    setup = CostSetup(
        trace=str(trace),
        limit=900,
        speed=1.0,
        poisson_rate=0.0,
        kv_tokens=0,
        amplitude=1.0,
        ttft_slo=2.0,
        target=0.95,
        max_per_region=8,
    )
    res = experiment(setup)
    assert res["region_peak"] is not None and res["global_peak"] is not None
    chosen = next(
        r
        for r in res["runs"]
        if r["system"] == "region-local" and r["replicas"] == res["region_peak"]
    )
    assert min(chosen["attainment"].values()) >= setup.target
    pooled = [
        r for r in res["runs"] if r["system"] == "SkyWalker" and r["total"] == res["global_peak"]
    ]
    assert min(pooled[0]["attainment"].values()) >= setup.target
    assert pooled[0]["forwarded"] > 0
    assert sum(res["region_peak"]) > res["global_peak"]
    assert format_result(res)[-1].startswith("skywalker replicas region-peak/global: ")


def test_steady_arrivals_keep_the_requests_and_their_order_at_the_rate():
    reqs = [TraceRequest(f"r{i}", 100.0 * (i % 7), 10 + i, 5) for i in range(2000)]
    out = steady_arrivals(reqs, 20.0, seed=3)
    assert [r.input_len for r in out] == [r.input_len for r in reqs]
    assert out[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(out, out[1:], strict=False))
    assert abs(out[-1].arrival / (len(out) - 1) - 1 / 20.0) < 0.005
