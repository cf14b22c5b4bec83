from __future__ import annotations

import pytest

from policies import admission as adm
from policies.conductor import (
    Conductor,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
    apply_decision,
    finish_decode,
    start_decode,
)

BS = 16


def prefill_time(new: int, cached: int) -> float:
    return 0.001 * new + 0.0001 * cached  # 1 ms per new token, a little per cached one


def decode_tbt(batch: int, blocks: int) -> float:
    return 0.01 + 0.001 * batch + 0.00001 * blocks


def slow_transfer(blocks: int) -> float:
    return 1.0 * blocks


def fast_transfer(blocks: int) -> float:
    return 0.001 * blocks


def conductor(transfer=slow_transfer, **kw) -> Conductor:
    kw.setdefault("ttft_slo", 10.0)
    kw.setdefault("tbt_slo", 1.0)
    kw.setdefault("admission", "early")  # judged at arrival unless a test says otherwise
    return Conductor(prefill_time, decode_tbt, transfer, **kw)


HASHES = list(range(100, 112))  # 12 full blocks


def request(n_blocks=12, tokens=None, max_tokens=64, rid="q") -> ConductorRequest:
    tokens = tokens if tokens is not None else n_blocks * BS + 8
    return ConductorRequest(rid, HASHES[:n_blocks], tokens, max_tokens, BS)


def decodes(n=2, **kw) -> list[DecodeInstance]:
    kw.setdefault("total_blocks", 1000)
    return [DecodeInstance(f"d{i}", **kw) for i in range(n)]


def test_prefers_prefix_holder_until_its_queue_makes_another_faster():
    c = conductor()
    holder = PrefillInstance("p0", cached=set(HASHES[:10]))
    other = PrefillInstance("p1")
    r = request()  # 200 tokens; the holder computes 40, the other 200 (transfer is too slow)
    for queued in (0, 100, 140):
        holder.queued_tokens = queued
        d = c.schedule(r, [other, holder], decodes(), now=0.0)
        assert d.accepted and d.prefill_id == "p0"
        assert d.cached_blocks == 10 and d.transfer_from is None
        assert d.predicted_ttft == pytest.approx(0.001 * queued + 0.04 + 0.016)
    holder.queued_tokens = 170  # 0.17 + 0.056 > 0.2: the empty instance is now faster
    d = c.schedule(r, [other, holder], decodes(), now=0.0)
    assert d.prefill_id == "p1" and d.cached_blocks == 0 and d.transfer_from is None
    assert d.predicted_ttft == pytest.approx(0.2)


def test_copies_the_prefix_when_transfer_beats_recomputing():
    c = conductor(transfer=fast_transfer)
    holder = PrefillInstance("p0", queued_tokens=5000, cached=set(HASHES[:10]))
    other = PrefillInstance("p1")
    d = c.schedule(request(), [holder, other], decodes(), now=0.0)
    assert d.prefill_id == "p1" and d.transfer_from == "p0" and d.cached_blocks == 10
    assert d.predicted_ttft == pytest.approx(0.010 + 0.04 + 0.016)


def test_rejects_when_decode_pool_is_full():
    c = conductor()
    pool = decodes(2, total_blocks=100, used_blocks=95, num_running=5)
    d = c.schedule(request(), [PrefillInstance("p0")], pool, now=0.0)
    assert not d.accepted and d.reason == "decode_full"
    assert d.prefill_id is None and d.decode_id is None
    assert d.retry_after is not None and d.retry_after > 0
    # One instance with room is enough; it is chosen.
    pool.append(DecodeInstance("d9", total_blocks=100, used_blocks=50, num_running=5))
    d = c.schedule(request(), [PrefillInstance("p0")], pool, now=0.0)
    assert d.accepted and d.decode_id == "d9"


def test_decode_choice_is_lowest_tbt_with_room():
    c = conductor()
    pool = [
        DecodeInstance("busy", num_running=50, used_blocks=100, total_blocks=1000),
        DecodeInstance("idle_small", num_running=0, used_blocks=0, total_blocks=10),
        DecodeInstance("light", num_running=5, used_blocks=100, total_blocks=1000),
    ]
    d = c.schedule(request(), [PrefillInstance("p0")], pool, now=0.0)
    assert d.decode_id == "light"  # idle_small cannot hold 13 + 4 = 17 blocks
    assert d.predicted_tbt == pytest.approx(decode_tbt(6, 100 + 13))


def test_early_rejection_when_predicted_ttft_exceeds_slo():
    c = conductor(ttft_slo=1.0, admission="early")
    busy = [PrefillInstance("p0", queued_tokens=3000), PrefillInstance("p1", queued_tokens=2000)]
    d = c.schedule(request(), busy, decodes(), now=5.0)
    assert not d.accepted and d.reason == "ttft_slo"
    assert d.predicted_ttft == pytest.approx(2.0 + 0.2)
    assert d.retry_after == pytest.approx(1.2)  # the excess drains in that long
    # Without admission control the same request goes through.
    d = conductor(ttft_slo=1.0, admission="none").schedule(request(), busy, decodes(), now=5.0)
    assert d.accepted and d.prefill_id == "p1"


def test_early_rejection_judges_decode_load_at_arrival():
    c = conductor(tbt_slo=0.05, admission="early")
    pool = decodes(1, num_running=100, used_blocks=200)
    d = c.schedule(request(), [PrefillInstance("p0")], pool, now=0.0)
    assert not d.accepted and d.reason == "tbt_slo"
    assert d.retry_after is not None and d.retry_after >= 1.0


def test_predictive_accepts_what_early_refuses_when_decode_load_is_about_to_fall():
    # The request waits ~1 s for prefill; every running decode lasts 0.5 s, so by the time
    # it reaches decode the current batch has gone.
    prefills = [PrefillInstance("p0", queued_tokens=800)]
    pool = decodes(1, num_running=100, used_blocks=200)
    kw = dict(ttft_slo=5.0, tbt_slo=0.05, decode_duration=0.5)
    early = conductor(admission="early", **kw).schedule(request(), prefills, pool, now=0.0)
    assert not early.accepted and early.reason == "tbt_slo"
    pred = conductor(admission="predictive", **kw).schedule(request(), prefills, pool, now=0.0)
    assert pred.accepted, pred
    # At arrival it meets the 800 queued tokens' requests (about 4 of this size) plus itself.
    assert pred.predicted_tbt < 0.05
    # Long decodes: nothing will have finished, so prediction refuses too.
    slow = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=0.05, decode_duration=100.0)
    assert not slow.schedule(request(), prefills, pool, now=0.0).accepted


def test_predictive_uses_finish_times_and_counts_prefill_arrivals():
    c = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=0.05, decode_duration=100.0)
    soon = decodes(1, num_running=100, used_blocks=200)
    soon[0].finish_times = [0.1] * 100
    prefills = [PrefillInstance("p0", queued_tokens=800)]
    assert c.schedule(request(), prefills, soon, now=0.0).accepted
    # The same, but another prefill instance will hand decode 50 requests by then.
    flood = PrefillInstance("p1", queued_tokens=5000, queued_requests=50, queue_time=0.5)
    d = c.schedule(request(), prefills + [flood], soon, now=0.0)
    assert not d.accepted and d.reason == "tbt_slo"


def test_replication_proposed_only_when_gain_passes_threshold():
    hot = PrefillInstance("p0", queued_tokens=10_000, cached=set(HASHES[:8]))
    cold = PrefillInstance("p1", cached=set(HASHES[:2]))
    d = conductor(replication_threshold=2.0).schedule(request(), [hot, cold], decodes(), 0.0)
    assert d.prefill_id == "p1" and d.transfer_from is None  # slow transfer: computes locally
    assert d.replicate_blocks == HASHES[2:8] and d.replicate_from == "p0"
    # 8 / 2 = 4 is not above 5: no replication.
    d = conductor(replication_threshold=5.0).schedule(request(), [hot, cold], decodes(), 0.0)
    assert d.prefill_id == "p1" and d.replicate_blocks == [] and d.replicate_from is None
    # The holder itself chosen: nothing to replicate.
    hot.queued_tokens = 0
    d = conductor(replication_threshold=2.0).schedule(request(), [hot, cold], decodes(), 0.0)
    assert d.prefill_id == "p0" and d.replicate_blocks == []
    # An instance with no local prefix always gains past any finite threshold.
    hot.queued_tokens = 10_000
    empty = PrefillInstance("p2")
    d = conductor(replication_threshold=100.0).schedule(request(), [hot, empty], decodes(), 0.0)
    assert d.prefill_id == "p2" and d.replicate_blocks == HASHES[:8]


def test_fully_cached_prompt_still_computes_its_last_token():
    c = conductor()
    r = request(n_blocks=4, tokens=4 * BS)  # exactly 4 full blocks, all cached
    p = PrefillInstance("p0", cached=set(HASHES[:4]))
    d = c.schedule(r, [p], decodes(), 0.0)
    assert d.predicted_ttft == pytest.approx(prefill_time(1, 4 * BS - 1))


def test_apply_decision_updates_the_views():
    c = conductor()
    prefills = [PrefillInstance("p0", queued_requests=0)]
    pool = decodes(1, num_running=1, used_blocks=3, finish_times=[3.0])
    r = request(n_blocks=2, tokens=40, max_tokens=24)
    d = c.schedule(r, prefills, pool, now=1.0)
    apply_decision(d, r, prefills, pool, now=1.0)
    assert prefills[0].queued_tokens == 40 and prefills[0].queued_requests == 1
    assert prefills[0].cached == set(HASHES[:2])
    # Decode: reserved, not yet load.
    assert (pool[0].pending, pool[0].pending_blocks) == (1, 4)
    assert (pool[0].num_running, pool[0].used_blocks) == (1, 3)
    finish = 1.0 + d.predicted_ttft + 24 * d.predicted_tbt
    start_decode(pool[0], 4, finish)
    assert (pool[0].pending, pool[0].pending_blocks) == (0, 0)
    assert (pool[0].num_running, pool[0].used_blocks) == (2, 7)
    assert pool[0].finish_times == [3.0, finish]
    finish_decode(pool[0], 3)
    assert (pool[0].num_running, pool[0].used_blocks) == (1, 4)
    with pytest.raises(ValueError):
        start_decode(pool[0], 4)  # nothing pending


def test_pending_requests_take_room_but_not_decode_load():
    c = conductor(tbt_slo=0.05, admission="early")
    r = request()  # 13 + 4 = 17 lifetime blocks
    pool = decodes(
        1, total_blocks=100, num_running=1, used_blocks=10, pending=40, pending_blocks=80
    )
    d = c.schedule(r, [PrefillInstance("p0")], pool, now=0.0)
    assert not d.accepted and d.reason == "decode_full"  # 10 + 80 + 17 > 100
    pool[0].pending_blocks = 70
    d = c.schedule(r, [PrefillInstance("p0")], pool, now=0.0)
    assert d.accepted
    # Early rejection judges the decodes running now, not the 40 still in prefill.
    assert d.predicted_tbt == pytest.approx(decode_tbt(2, 10 + 13)) and d.predicted_batch == 2


def test_predictive_counts_each_instances_pending_requests_that_land_in_time():
    # One prefill queue of 10 requests takes 2 s; this request waits behind all of them.
    c = conductor(admission="predictive", ttft_slo=10.0, tbt_slo=0.05, decode_duration=1000.0)
    prefills = [PrefillInstance("p0", queued_tokens=2000, queued_requests=10, queue_time=2.0)]
    pool = [
        DecodeInstance("heavy", total_blocks=1000, pending=8, pending_blocks=160),
        DecodeInstance("light", total_blocks=1000, pending=2, pending_blocks=40),
    ]
    d = c.schedule(request(), prefills, pool, now=0.0)
    # All 10 queued requests land before this one: "light" will run 2 (+ itself).
    assert d.accepted and d.decode_id == "light"
    assert d.predicted_tbt == pytest.approx(decode_tbt(3, 40 + 13)) and d.predicted_batch == 3
    # Early rejection sees two idle instances (the tie goes to the one with more room).
    e = conductor(admission="early", ttft_slo=10.0, tbt_slo=0.05).schedule(
        request(), prefills, pool, now=0.0
    )
    assert e.decode_id == "light" and e.predicted_tbt == pytest.approx(decode_tbt(1, 13))
    assert e.predicted_batch == 1


def test_rejections_always_carry_retry_after():
    c = conductor(ttft_slo=0.01, tbt_slo=0.001)
    for pool in (decodes(1), decodes(1, total_blocks=5)):
        d = c.schedule(request(), [PrefillInstance("p0")], pool, 0.0)
        assert not d.accepted and d.retry_after is not None and d.retry_after >= 1.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        conductor(admission="sometimes")
    with pytest.raises(ValueError):
        conductor().schedule(request(), [], decodes(), 0.0)


def test_admission_arithmetic():
    assert adm.running_at(10, [], 0.0, 2.5, 10.0) == pytest.approx(7.5)
    assert adm.running_at(10, [], 0.0, 20.0, 10.0) == 0.0
    assert adm.running_at(3, [1.0, 2.0, 5.0], 0.0, 2.0, 10.0) == 1.0
    assert adm.prefill_done_by(10, 4.0, 1.0) == pytest.approx(2.5)
    assert adm.prefill_done_by(10, 0.0, 1.0) == 10
    assert adm.time_until_finished(2, 4, [], 0.0, 8.0) == pytest.approx(4.0)
    assert adm.time_until_finished(2, 3, [9.0, 4.0, 6.0], 1.0, 8.0) == pytest.approx(5.0)
    assert adm.finishes_needed(lambda k: k >= 7, 10) == 7
    assert adm.finishes_needed(lambda k: False, 10) is None
    assert adm.slo_load(2.0, 0.01, 1.0, 0.1) == pytest.approx(2.0)


def test_predictive_admission_is_the_default_everywhere():
    from actors.disagg.conductor import ConductorOptions, default_conductor
    from actors.serving.config import ConductorSectionConfig

    c = Conductor(prefill_time, decode_tbt, slow_transfer, ttft_slo=1.0, tbt_slo=1.0)
    assert c.admission == "predictive" and c.decode_duration is None
    assert ConductorOptions().admission == "predictive"
    assert ConductorSectionConfig().admission == "predictive"
    assert default_conductor(1024).admission == "predictive"


def test_queue_time_sums_each_queued_requests_own_prefill_time():
    def per_step(new: int, cached: int) -> float:
        return 0.1 + 0.001 * new + 0.0001 * cached  # each prompt pays its own 0.1 s step

    c = Conductor(per_step, decode_tbt, slow_transfer, ttft_slo=10.0, tbt_slo=1.0)
    p = PrefillInstance("p0", queued_tokens=300, queued=[(100, 0), (150, 40), (50, 0)])
    assert c.queue_time(p) == pytest.approx(per_step(100, 0) + per_step(150, 40) + per_step(50, 0))
    # the whole queue as one prompt would miss two of the three per-request costs
    assert c.queue_time(PrefillInstance("p0", queued_tokens=300)) == pytest.approx(per_step(300, 0))
    # an accepted request joins the queue with its own length
    r = request(n_blocks=2, tokens=40)
    d = c.schedule(r, [p], decodes(1), now=0.0)
    apply_decision(d, r, [p], decodes(1), now=0.0)
    assert p.queued[-1] == (40, 0) and c.queue_time(p) == pytest.approx(d.predicted_ttft)


def test_prefill_done_within_counts_the_queue_prefix_that_fits():
    assert adm.prefill_done_within([0.5, 0.5, 1.0], 0.99) == 1
    assert adm.prefill_done_within([0.5, 0.5, 1.0], 1.0) == 2
    assert adm.prefill_done_within([0.5, 0.5, 1.0], 5.0) == 3
    assert adm.prefill_done_within([], 1.0) == 0


def test_running_decodes_end_after_their_remaining_tokens_at_the_predicted_tbt():
    c = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=0.05)
    d = DecodeInstance("d0", total_blocks=1000, num_running=3, used_blocks=30)
    d.remaining_tokens = [1, 10, 100]
    tbt = decode_tbt(3, 30)
    assert c.finish_times(d, now=2.0) == pytest.approx([2.0 + tbt, 2.0 + 10 * tbt, 2.0 + 100 * tbt])
    d.remaining_tokens = [1, 10]  # stale (one per running request is needed): t_d applies
    assert c.finish_times(d, now=2.0) == []
    # t_d without a fixed decode_duration: this request's max_tokens at the predicted TBT
    r = request(max_tokens=64)
    assert c.decode_time(r, d) == pytest.approx(64 * decode_tbt(4, 30 + 13))


def test_running_decodes_are_priced_at_the_batch_the_pending_requests_join():
    # 2 running, 4 admitted and still in prefill: they join while the 2 decode, so the 2
    # end at the TBT of 6, later than at the TBT of the 2 alone
    c = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=0.05)
    d = DecodeInstance("d0", total_blocks=1000, num_running=2, used_blocks=20)
    d.remaining_tokens = [10, 20]
    alone = c.finish_times(d, now=0.0)
    d.pending, d.pending_blocks = 4, 40
    tbt = decode_tbt(6, 60)
    assert c.finish_times(d, now=0.0) == pytest.approx([10 * tbt, 20 * tbt])
    assert all(a < b for a, b in zip(alone, c.finish_times(d, now=0.0), strict=True))


def test_predicted_batch_counts_running_decodes_left_and_pending_requests_landed():
    # 3 running, each 100 tokens left at ~13 ms: none ends within this request's TTFT; the
    # 2 pending requests queued ahead of it on the one prefill instance land first
    c = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=1.0)
    prefills = [PrefillInstance("p0", queued=[(100, 0), (100, 0)])]
    d = DecodeInstance("d0", total_blocks=1000, num_running=3, used_blocks=30)
    d.remaining_tokens = [100, 100, 100]
    d.pending, d.pending_blocks = 2, 20
    decision = c.schedule(request(), prefills, [d], now=0.0)
    assert decision.accepted and decision.predicted_batch == 3 + 2 + 1
    # each running one with 1 token left ends before this request's prefill does
    d.remaining_tokens = [1, 1, 1]
    assert c.schedule(request(), prefills, [d], now=0.0).predicted_batch == 2 + 1


def test_predictive_prices_decode_from_the_step_time_predictor():
    # 100 decodes at ~0.11 s per token: they all end within the request's ~1 s prefill when
    # each has 5 tokens left, none do when each has 500 left.
    prefills = [PrefillInstance("p0", queued=[(800, 0)])]
    c = conductor(admission="predictive", ttft_slo=5.0, tbt_slo=0.05)
    pool = decodes(1, num_running=100, used_blocks=200)
    pool[0].remaining_tokens = [5] * 100
    assert c.schedule(request(), prefills, pool, now=0.0).accepted
    pool[0].remaining_tokens = [500] * 100
    d = c.schedule(request(), prefills, pool, now=0.0)
    assert not d.accepted and d.reason == "tbt_slo"
    # a predictor measuring 10x faster steps: the same 500 tokens end in time
    fast = Conductor(prefill_time, lambda b, k: decode_tbt(b, k) / 10, slow_transfer, 5.0, 0.05)
    pool[0].remaining_tokens = [50] * 100
    assert fast.schedule(request(), prefills, pool, now=0.0).accepted
    assert not c.schedule(request(), prefills, pool, now=0.0).accepted


def test_an_idle_decode_instance_never_refuses_on_tbt():
    # a fitted TBT above the SLO even for one request (a stale fit from a busy period):
    # an idle instance still admits, so it runs steps and the fit can learn again
    slow = Conductor(prefill_time, lambda b, k: 1.0, slow_transfer, 10.0, 0.05)
    for mode in ("early", "predictive"):
        slow.admission = mode
        assert slow.schedule(request(), [PrefillInstance("p0")], decodes(1), 0.0).accepted
        busy = decodes(1, num_running=1, used_blocks=10)
        d = slow.schedule(request(), [PrefillInstance("p0")], busy, 0.0)
        assert not d.accepted and d.reason == "tbt_slo"


def test_admission_judges_decode_tbt_times_its_measured_overrun():
    # decode_tbt(2, 12 + 13 blocks) ~ 12.25 ms: within a 20 ms SLO at the model, over it
    # once decode's steps run 2x the model (a loaded host the next refit would price in)
    prefills = [PrefillInstance("p0")]
    for mode in ("early", "predictive"):
        c = conductor(admission=mode, tbt_slo=0.02)
        pool = decodes(1, num_running=1, used_blocks=12, remaining_tokens=[1000])
        d = c.schedule(request(), prefills, pool, now=0.0)
        assert d.accepted and d.tbt_margin == 1.0
        for _ in range(8):
            c.observe_decode_step(2, 20, 2 * decode_tbt(2, 20))
        assert c.tbt_margin() == pytest.approx(2.0)
        d = c.schedule(request(), prefills, pool, now=0.0)
        assert not d.accepted and d.reason == "tbt_slo" and d.tbt_margin == pytest.approx(2.0)
        assert d.predicted_tbt == pytest.approx(decode_tbt(2, 12 + 13))  # the model's own
        assert d.retry_after is not None and d.retry_after >= 1.0
        # an idle instance still admits; "none" judges nothing
        assert c.schedule(request(), prefills, decodes(1), now=0.0).accepted
        c.admission = "none"
        assert c.schedule(request(), prefills, pool, now=0.0).accepted


def test_the_overrun_quantile_reads_the_tail_of_decode_steps():
    c = conductor(tbt_quantile=0.5)
    for k in range(10):  # one step in ten runs 3x over the model
        c.observe_decode_step(4, 40, (3.0 if k == 0 else 1.0) * decode_tbt(4, 40))
    assert c.tbt_margin() == pytest.approx(1.0)
    c.tbt_quantile = 0.95
    assert c.tbt_margin() == pytest.approx(3.0)
    with pytest.raises(ValueError):
        conductor(tbt_quantile=2.0)
