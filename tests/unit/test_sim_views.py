"""The simulator's kept (incrementally refreshed) Conductor views equal fresh ones."""

from __future__ import annotations

from placement.fitted import SplitFittedCostModel
from sim.disaggregated import DisaggregatedCluster
from sim.presets import ClusterConfig, build_cluster
from sim.workload import TraceRequest


def _reqs(n: int) -> list[TraceRequest]:
    return [
        TraceRequest(f"r{i}", 0.05 * i, 600 + 97 * (i % 7), 5 + i % 4, tuple(range(i % 3 + 1)))
        for i in range(n)
    ]


def test_kept_prefill_views_match_fresh_ones_mid_run():
    cluster = build_cluster(ClusterConfig(instances=4, block_size=64))
    assert isinstance(cluster, DisaggregatedCluster)
    reqs = _reqs(40)
    for until in (0.3, 0.9, 1.7):
        if until == 0.3:
            cluster.run(reqs, until=until)
        else:
            cluster.loop.run(until)
        kept = cluster._prefill_views()
        for p, view in zip(cluster.prefills, kept, strict=True):
            fresh = cluster.fresh_prefill_view(p)
            assert (view.queued_tokens, view.queue_time) == (fresh.queued_tokens, fresh.queue_time)
            assert view.cached is p.cached
        for d, dv in zip(cluster.decodes, cluster._decode_views(), strict=True):
            fresh_d = cluster.fresh_decode_view(d)
            assert (dv.num_running, dv.used_blocks) == (fresh_d.num_running, fresh_d.used_blocks)
            assert (dv.pending, dv.pending_blocks) == (fresh_d.pending, fresh_d.pending_blocks)
    cluster.loop.run()
    assert all(s.done or s.rejected for s in cluster.stats.values())
    cluster.check_integrity()


def test_split_fit_recovers_weights():
    truth = SplitFittedCostModel([1e-3, 2e-5, 1e-8, 5e-4, 1e-4, 1e-7, 2e-3, 3e-3, 4e-6])
    batches = []
    for k in range(60):
        b = [(1, 100 + 13 * j) for j in range(k % 5)]
        if k % 3:
            b.append((16 + 7 * k, 50 * (k % 4)))
        batches.append(b or [(1, 10)])
    fit = SplitFittedCostModel.fit(batches, [truth.batch_time(b) for b in batches], trim=0.0)
    for b in batches:
        assert abs(fit.batch_time(b) - truth.batch_time(b)) <= 1e-6 + 1e-3 * truth.batch_time(b)
