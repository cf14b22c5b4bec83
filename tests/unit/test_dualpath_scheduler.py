"""DualPath's scheduler on plain data: PE choice (alpha/beta classes), DE choice (group
spread, Z rule), read-path choice, and the intra-engine batch fill with a binary-searched
chunk."""

from __future__ import annotations

import pytest

from policies.dualpath import (
    DECODE_PATH,
    PREFILL_PATH,
    EngineLoad,
    QueuedPrefill,
    WaitingRequest,
    attention_time_fn,
    fill_batch,
    pick_decode,
    pick_path,
    pick_prefill,
    read_threshold,
    schedule,
    spread_over_groups,
    work_threshold,
    z_bound,
)
from policies.pd_costs import LinearPrefillTime


def pe(name: str, node: str, tok: int = 0, seq: int = 0) -> EngineLoad:
    return EngineLoad(name, node, unfinished_requests=seq, unfinished_tokens=tok)


def de(name: str, node: str, tok: int = 0, seq: int = 0, free: int = 10_000, group: str = "g"):
    return EngineLoad(name, node, seq, tok, free_tokens=free, group=group)


def test_thresholds_are_tokens_in_their_windows():
    assert read_threshold(1000.0) == 3000
    assert work_threshold(200.0) == 1000
    with pytest.raises(ValueError, match="positive"):
        read_threshold(0.0)


def test_prefill_choice_skips_engines_over_beta_and_prefers_short_read_queues():
    engines = [pe("a", "n1", tok=10), pe("b", "n2", tok=50), pe("c", "n3", tok=5000)]
    # c has the longest work: over beta, never picked
    assert pick_prefill(engines, {}, alpha=100, beta=1000).engine_id == "a"
    # a's node reads more than alpha: b (under alpha) wins despite more tokens
    assert pick_prefill(engines, {"n1": 500}, alpha=100, beta=1000).engine_id == "b"
    # both nodes over alpha: smallest tok_e among them
    assert pick_prefill(engines, {"n1": 500, "n2": 500}, 100, 1000).engine_id == "a"
    # everyone over beta: nobody
    assert pick_prefill(engines, {}, alpha=100, beta=1) is None


def test_groups_get_requests_by_smallest_summed_tokens():
    engines = [de("d1", "n1", tok=100, group="x"), de("d2", "n2", tok=0, group="y")]
    waiting = [WaitingRequest(f"r{i}", 60) for i in range(3)]
    queues = spread_over_groups(waiting, engines)
    # y (0) takes r0 -> 60; y (60 < 100) takes r1 -> 120; x (100) takes r2
    assert [r.request_id for r in queues["y"]] == ["r0", "r1"]
    assert [r.request_id for r in queues["x"]] == ["r2"]


def test_z_counts_only_queued_lengths_that_fit_the_free_hbm():
    engines = [de("d1", "n1", tok=100, free=150), de("d2", "n2", tok=300, free=0)]
    queued = [WaitingRequest("a", 100), WaitingRequest("b", 100)]  # only a fits in 150
    assert z_bound(queued, engines) == pytest.approx(1.05 * (100 + 400) / 2)


def test_decode_choice_prefers_few_requests_under_z_else_least_tokens():
    engines = [de("d1", "n1", tok=100, seq=5), de("d2", "n2", tok=300, seq=1)]
    # both under Z: fewest unfinished requests wins even with more tokens
    assert pick_decode(engines, 50, z=1000).engine_id == "d2"
    # only d1 stays under Z
    assert pick_decode(engines, 50, z=200).engine_id == "d1"
    # nobody under Z: smallest tok_e
    assert pick_decode(engines, 50, z=10).engine_id == "d1"
    # no HBM anywhere
    assert pick_decode([de("d1", "n1", free=10)], 50, z=1000) is None


def test_read_path_is_the_side_with_the_shorter_disk_queue():
    assert pick_path("p", "d", {"p": 10, "d": 5}) == DECODE_PATH
    assert pick_path("p", "d", {"p": 5, "d": 10}) == PREFILL_PATH
    assert pick_path("p", "d", {}) == PREFILL_PATH  # tie: the prefill side


def test_with_link_rates_the_read_goes_where_it_ends_first():
    rates = {"p": 100.0, "d": 400.0}  # the decode node's storage link reads 4x faster
    # equal queues: the faster side; (0 + 100) / 400 < (0 + 100) / 100
    assert pick_path("p", "d", {}, rates, hit_tokens=100) == DECODE_PATH
    # the decode side's queue 4x longer is the same time: a tie, the prefill side
    assert pick_path("p", "d", {"p": 100, "d": 700}, rates, hit_tokens=100) == PREFILL_PATH
    assert pick_path("p", "d", {"p": 100, "d": 600}, rates, hit_tokens=100) == DECODE_PATH
    # equal rates: the shorter queue, as without rates
    same = {"p": 1.0, "d": 1.0}
    assert pick_path("p", "d", {"p": 10, "d": 5}, same, 7) == DECODE_PATH
    assert pick_path("p", "d", {"p": 5, "d": 10}, same, 7) == PREFILL_PATH
    with pytest.raises(ValueError, match="positive rate for node 'd'"):
        pick_path("p", "d", {}, {"p": 1.0}, 1)


def test_schedule_splits_reads_by_the_links_rates():
    prefill, decode = [pe("p0", "np")], [de("d0", "nd")]
    waiting = [WaitingRequest(f"r{i}", 1000, hit_tokens=900) for i in range(5)]
    rates = {"np": 100.0, "nd": 400.0}
    out = schedule(waiting, prefill, decode, {}, 10**6, 10**6, read_rates=rates)
    # 4 of 5 reads on the 4x faster side: both queues then drain in 9 s
    assert [a.path for a in out.assignments].count(DECODE_PATH) == 4
    assert out.read_queues == {"nd": 3600, "np": 900}


def test_schedule_alternates_read_paths_to_balance_storage_links():
    prefill = [pe("p0", "np")]
    decode = [de("d0", "nd")]
    waiting = [WaitingRequest(f"r{i}", 1000, hit_tokens=900) for i in range(4)]
    out = schedule(waiting, prefill, decode, {}, alpha=10**6, beta=10**6)
    assert [a.path for a in out.assignments] == [
        PREFILL_PATH,
        DECODE_PATH,
        PREFILL_PATH,
        DECODE_PATH,
    ]
    assert out.read_queues == {"np": 1800, "nd": 1800}
    # loads grew: the PE by the computed tokens, the DE by whole prompts
    assert out.prefill["p0"].unfinished_tokens == 4 * 100
    assert out.decode["d0"].unfinished_tokens == 4 * 1000
    assert out.decode["d0"].free_tokens == 10_000 - 4000
    # the Basic baseline reads everything on the prefill side
    basic = schedule(waiting, prefill, decode, {}, alpha=10**6, beta=10**6, dual_path=False)
    assert {a.path for a in basic.assignments} == {PREFILL_PATH}
    assert basic.read_queues == {"np": 3600}


def test_schedule_stops_at_the_first_request_that_cannot_be_placed():
    prefill = [pe("p0", "n0"), pe("p1", "n1")]
    decode = [de("d0", "n0", free=2500)]
    waiting = [WaitingRequest(f"r{i}", 1000, hit_tokens=0) for i in range(4)]
    out = schedule(waiting, prefill, decode, {}, alpha=100, beta=10**6)
    # the DE holds two whole prompts; FIFO: r2 waits and r3 does not overtake it
    assert [a.request_id for a in out.assignments] == ["r0", "r1"]
    assert [a.prefill for a in out.assignments] == ["p0", "p1"]  # balanced by tok_e
    # beta: a PE with more than beta unfinished tokens takes nothing more
    tight = schedule(waiting, prefill, [de("d0", "n0")], {}, alpha=100, beta=999)
    assert [a.prefill for a in tight.assignments] == ["p0", "p1"]


def test_schedule_prefers_a_prefill_engine_whose_node_reads_little():
    prefill = [pe("busy", "n0"), pe("idle", "n1", tok=500)]
    decode = [de("d0", "n2")]
    out = schedule([WaitingRequest("r", 100)], prefill, decode, {"n0": 5000}, 1000, 10**6)
    assert out.assignments[0].prefill == "idle"


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="hit_tokens"):
        WaitingRequest("r", 10, hit_tokens=10)
    with pytest.raises(ValueError, match="at least one"):
        schedule([], [], [de("d", "n")], {}, 1, 1)


def quadratic(chunks):
    return sum(n * (n + c) for n, c in chunks) * 1e-6


def test_fill_batch_takes_whole_requests_then_the_largest_chunk_that_fits():
    queue = [QueuedPrefill("a", 100), QueuedPrefill("b", 100), QueuedPrefill("c", 1000, 200)]
    quota = 0.1  # a: 0.01, b: 0.01 -> 0.08 left for c
    batch = fill_batch(queue, quadratic, quota)
    assert batch[:2] == [("a", 100), ("b", 100)]
    name, n = batch[2]
    assert name == "c" and 0 < n < 1000
    used = quadratic([(100, 0), (100, 0)])
    # the largest chunk: n fits, n + 1 does not
    assert used + quadratic([(n, 200)]) <= quota < used + quadratic([(n + 1, 200)])
    assert len(batch) == 3  # the batch ends at the overflowing request


def test_fill_batch_always_makes_progress_and_checks_its_quota():
    assert fill_batch([QueuedPrefill("big", 10**6)], quadratic, 1e-9) == [("big", 1)]
    assert fill_batch([], quadratic, 1.0) == []
    with pytest.raises(ValueError, match="quota"):
        fill_batch([QueuedPrefill("a", 1)], quadratic, 0.0)


def test_attention_time_comes_from_the_fitted_prefill_model():
    model = LinearPrefillTime(
        base=1.0, per_new_token=1.0, per_cached_token=0.5, per_attention_pair=0.01
    )
    t = attention_time_fn(model)
    # base and per-token costs are not attention: only pairs and the context read count
    assert t([(10, 20)]) == pytest.approx(0.01 * 10 * 30 + 0.5 * 20)
    assert t([(10, 0), (5, 5)]) == pytest.approx(0.01 * 100 + 0.01 * 50 + 0.5 * 5)
