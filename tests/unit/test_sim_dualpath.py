"""The DualPath simulator on a hand-checked case: two trajectories of two turns on one PE
and one DE, reads through 100 B/s storage links (1 byte per token)."""

from __future__ import annotations

import pytest

from policies.pd_costs import LinearPrefillTime
from sim.dualpath import (
    DualPathConfig,
    DualPathSim,
    Trajectory,
    Turn,
    agentic_trajectories,
    closed_loop_capacity,
    online_capacity,
    poisson_starts,
    run_variants,
    skewed,
)

CFG = DualPathConfig(
    num_prefill=1,
    num_decode=1,
    storage_bps=100.0,
    compute_bps=1e12,
    kv_bytes_per_token=1,
    prefill=LinearPrefillTime(base=1.0),  # every prefill takes 1 s
    decode_base=0.1,
    decode_per_seq=0.0,
    hbm_tokens=10_000,
)
TRAJS = [Trajectory(100, [Turn(10, 5), Turn(20, 5)]) for _ in range(2)]


def test_basic_reads_everything_on_the_prefill_side():
    # turn 0: no hit; A prefills 0-1 and decodes 5 x 0.1 to 1.5; B prefills 1-2, ends 2.5.
    # turn 1 (hit 114 tokens = 1.14 s of reading): A reads 1.5-2.64, prefills 2.64-3.64,
    # ends 4.14; B arrives at 2.5, waits for the link: reads 2.64-3.78, prefills 3.78-4.78,
    # ends 5.28
    r = DualPathSim(CFG, "basic").run(TRAJS)
    assert r.completion_time == pytest.approx(5.28)
    assert r.storage_bytes == [228, 0]
    assert r.storage_max_over_avg == pytest.approx(2.0)
    assert r.decode_path_share == 0.0


def test_dual_path_reads_the_second_turn_on_the_idle_decode_side():
    # B's turn 1 finds the PE's link busy (A's 114 tokens queued) and the DE's idle: it
    # reads there 2.5-3.64, then prefills when the PE frees at 3.64, and ends at 5.14
    r = DualPathSim(CFG, "dual").run(TRAJS)
    assert r.completion_time == pytest.approx(5.14)
    assert r.storage_bytes == [114, 114]
    assert r.storage_max_over_avg == pytest.approx(1.0)
    assert r.decode_path_share == pytest.approx(0.5)


def test_the_scheduler_variant_runs_every_turn_and_traces_have_the_papers_shape():
    trajs = agentic_trajectories(6, seed=1)
    assert all(60 <= len(t.turns) <= 157 for t in trajs)
    assert all(430 <= u.append <= 610 and 150 <= u.output <= 180 for t in trajs for u in t.turns)
    res = run_variants(DualPathConfig(num_prefill=1, num_decode=2), trajs)
    assert set(res) == {"basic", "dual", "dual+sched"}
    for r in res.values():
        assert r.completion_time > 0
    # a storage-bound setting: both dual variants finish before basic
    assert res["dual"].completion_time < res["basic"].completion_time
    assert res["dual+sched"].completion_time < res["basic"].completion_time
    with pytest.raises(ValueError, match="variant"):
        DualPathSim(CFG, "oracle")


def test_online_arrivals_and_capacity():
    starts = poisson_starts(50, rate=2.0, seed=3)
    assert starts == sorted(starts) and starts[0] > 0
    # online: trajectory B starts at 10 s, after A is done: no queueing, each turn's TTFT is
    # its read plus its 1 s prefill (0 + 1 s, then 1.14 + 1 s)
    r = DualPathSim(CFG, "basic").run(TRAJS, [0.0, 10.0])
    assert r.mean_ttft == pytest.approx((1.0 + 2.14 + 1.0 + 2.14) / 4)
    assert r.mean_tpot == pytest.approx(0.1)
    assert r.completion_time == pytest.approx(10.0 + 4.14)
    rates = [0.1, 1.0, 10.0]
    assert online_capacity(CFG, "dual", TRAJS, rates, 100.0, 1.0) == 10.0
    assert online_capacity(CFG, "dual", TRAJS, rates, 0.5, 1.0) == 0.0


def test_closed_loop_runs_a_fixed_number_of_trajectories_at_once():
    # one at a time: B starts when A ends (4.14 s, as online above) and takes as long
    r = DualPathSim(CFG, "basic").run(TRAJS, concurrency=1)
    assert r.completion_time == pytest.approx(2 * 4.14)
    # two at once is the offline run (5.28 s for 4 turns); both meet loose SLOs
    n, rate = closed_loop_capacity(CFG, "basic", TRAJS, 2, 100.0, 1.0)
    assert (n, rate) == (2, pytest.approx(4 / 5.28))
    assert closed_loop_capacity(CFG, "basic", TRAJS, 2, 0.5, 1.0) == (0, 0.0)


def test_under_skewed_storage_the_scheduler_reads_on_the_fast_side():
    # PEs' storage links read at a quarter of the DEs' (25 against 100 B/s): the
    # scheduler puts ~4 of 5 reads on the DEs' side; basic reads all on the slow side and
    # dual (token queues, rates unknown) about half
    trajs = agentic_trajectories(4, seed=0, turns=(6, 8), append=(40, 60), first=(100, 200))
    trajs = [Trajectory(t.first, [Turn(x.append, 5) for x in t.turns]) for t in trajs]
    res = run_variants(skewed(CFG, prefill_share=0.25), trajs)
    basic, dual, sched = res["basic"], res["dual"], res["dual+sched"]
    pe_share = sched.storage_bytes[0] / sum(sched.storage_bytes)
    assert basic.decode_path_share == 0.0
    assert 0.1 <= pe_share <= 0.3  # ~1/5 of the bytes on the slow PE link
    assert sched.decode_path_share > dual.decode_path_share
    assert sched.completion_time < dual.completion_time < basic.completion_time
    # the reverse: PEs' links 4x faster, the scheduler reads mostly there
    rev = DualPathSim(skewed(CFG, prefill_share=4.0), "dual+sched").run(trajs)
    assert rev.storage_bytes[0] > 0.7 * sum(rev.storage_bytes)


def test_skewed_needs_a_positive_share():
    with pytest.raises(ValueError, match="prefill_share"):
        skewed(CFG, prefill_share=0.0)
