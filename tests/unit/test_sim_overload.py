"""Admission modes in a simulated P/D cluster: what early rejection (decode load now) and
its predictive variant (decode load when the request gets there) do differently."""

from __future__ import annotations

from sim.presets import ClusterConfig, build_cluster
from sim.workload import TraceRequest


def cluster(admission: str):
    cfg = ClusterConfig(
        mode="pd",
        policy="conductor",
        instances=3,
        prefill=1,
        model="llama3-8b",
        gpu="H100",
        tp=1,
        block_size=16,
        prefill_cache_tokens=50_000,
        prefill_budget=2048,
        admission=admission,
        tbt_slo=1.0,  # nothing is refused: only the choice of decode instance is compared
        decode_duration=100.0,
    )
    return build_cluster(cfg)


def burst() -> list[TraceRequest]:
    """One long decode running alone, then a burst of six prompts at once."""
    first = TraceRequest("long", 0.0, 512, 2000, (1,), trace_block_size=512)
    rest = [TraceRequest(f"b{i}", 2.0, 1024, 20, (10 + i, 20 + i)) for i in range(6)]
    return [first, *rest]


def tight(admission: str):
    """The burst's cluster with the TBT SLO at what the instance holding the long decode
    predicts for one more request now: early rejection (load now) accepts the whole burst;
    three burst requests landing on one instance exceed it."""
    c = cluster(admission)
    long_blocks = -(-(512 + 2000) // 16)
    c.conductor.tbt_slo = c.conductor.decode_tbt(2, long_blocks + 1024 // 16)
    return c


def test_early_rejection_judges_the_decode_load_now_and_admits_the_whole_burst():
    c = tight("early")
    stats = {s.request_id: s for s in c.run(burst())}
    assert all(s.done for s in stats.values())
    # Ranked by committed load (running + pending), the burst still spreads.
    assert {stats[f"b{i}"].decode_instance for i in range(6)} == {0, 1}
    c.check_integrity()


def test_prediction_counts_the_burst_that_will_land_and_refuses_what_would_miss_the_slo():
    c = tight("predictive")
    stats = {s.request_id: s for s in c.run(burst())}
    accepted = [f"b{i}" for i in range(6) if stats[f"b{i}"].done]
    refused = [f"b{i}" for i in range(6) if stats[f"b{i}"].rejected]
    assert stats["long"].done and accepted and refused
    assert {stats[r].rejected for r in refused} == {"tbt_slo"}
    # The first arrivals, which meet less of the burst at decode, are the ones admitted.
    assert accepted == [f"b{i}" for i in range(len(accepted))]
    # Without any admission control (same SLO) the whole burst goes through.
    assert all(s.done for s in tight("none").run(burst()))
    c.check_integrity()


def test_every_mode_accounts_for_every_request_and_frees_every_block():
    for admission in ("none", "baseline", "early", "predictive"):
        c = cluster(admission)
        stats = c.run(burst())
        assert len(stats) == 7 and all(s.done or s.rejected for s in stats)
        for view, d in zip(c._decode_views(), c.decodes, strict=True):
            assert (view.num_running, view.pending, view.used_blocks) == (0, 0, 0)
            assert view.pending_blocks == 0 and d.pool.num_free == d.pool.num_blocks
        c.check_integrity()
