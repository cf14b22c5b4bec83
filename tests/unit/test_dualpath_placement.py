"""DualPath's inter-engine rules as the live Conductor applies them, on plain data: the
Conductor's views become the rule's engine loads, the rule (``policies.dualpath.schedule``)
picks the prefill replica by read queue and unfinished tokens, the decode replica by the
Z rule and the read side, and a request no replica can take is refused with a reason."""

from __future__ import annotations

import pytest

from actors.disagg.conductor import RequestRejected, default_conductor
from actors.disagg.dualpath_placement import (
    REFERENCE_TOKENS,
    DualPathPlacer,
    decode_load,
    fitted_thresholds,
    prefill_load,
)
from actors.disagg.read_paths import ReadPaths
from policies.conductor import ConductorRequest, DecodeInstance, PrefillInstance, apply_decision
from policies.dualpath import DECODE_PATH, PREFILL_PATH, EngineLoad, WaitingRequest

BS = 16
CONDUCTOR = default_conductor(block_bytes=4096)


def test_views_become_engine_loads():
    p = prefill_load(PrefillInstance("p0", queued_tokens=120), in_prefill=3)
    assert p == EngineLoad("p0", "p0", unfinished_requests=3, unfinished_tokens=120)
    d = decode_load(
        DecodeInstance(
            "d1", num_running=2, used_blocks=5, total_blocks=20, pending=1, pending_blocks=3
        ),
        BS,
    )
    assert d == EngineLoad("d1", "d1", 3, 8 * BS, free_tokens=12 * BS)


def test_fitted_thresholds_follow_the_cost_model():
    alpha, beta = fitted_thresholds(CONDUCTOR, BS)
    # 4 GB/s over 4 kB blocks of 16 tokens, for 3 s; the prefill model at 512 tokens, 5 s
    assert alpha == int(BS / (4096 / 4e9) * 3.0)
    assert beta == int(REFERENCE_TOKENS / CONDUCTOR.prefill_time(REFERENCE_TOKENS, 0) * 5.0)
    assert 0 < beta < alpha


def loads(p0_tok: int = 0, p1_tok: int = 0) -> tuple[list[EngineLoad], list[EngineLoad]]:
    prefills = [EngineLoad("p0", "p0", 1, p0_tok), EngineLoad("p1", "p1", 1, p1_tok)]
    decodes = [EngineLoad("d0", "d0", 0, 0, free_tokens=1000)]
    return prefills, decodes


def test_a_prefill_replica_with_a_long_read_queue_is_passed_over():
    placer = DualPathPlacer(BS, "dual", thresholds=(40, 10_000))
    prefills, decodes = loads(p0_tok=24, p1_tok=64)
    req = WaitingRequest("r", 32)
    # p0 has fewer unfinished tokens and wins while its read queue is short ...
    a = placer.place(req, prefills, decodes, {"p0": 40}, CONDUCTOR)
    assert a.prefill == "p0"
    # ... and loses once its queue is over alpha, to p1 whose queue is not
    a = placer.place(req, prefills, decodes, {"p0": 80}, CONDUCTOR)
    assert a.prefill == "p1"


def test_the_read_side_is_the_shorter_queue_or_the_fixed_mode():
    prefills, decodes = loads()
    req = WaitingRequest("r", 100, hit_tokens=80)
    dual = DualPathPlacer(BS, "dual", thresholds=(10_000, 10_000))
    a = dual.place(req, prefills, decodes, {"p0": 50, "p1": 50, "d0": 10}, CONDUCTOR)
    assert (a.prefill, a.path, a.read_node) == ("p0", DECODE_PATH, "d0")
    a = dual.place(req, prefills, decodes, {"d0": 10}, CONDUCTOR)
    assert (a.path, a.read_node) == (PREFILL_PATH, "p0")
    fixed = DualPathPlacer(BS, DECODE_PATH, thresholds=(10_000, 10_000))
    a = fixed.place(req, prefills, decodes, {"d0": 500}, CONDUCTOR)
    assert (a.path, a.read_node) == (DECODE_PATH, "d0")
    basic = DualPathPlacer(BS, PREFILL_PATH, thresholds=(10_000, 10_000))
    a = basic.place(req, prefills, decodes, {"p0": 500}, CONDUCTOR)
    assert (a.path, a.read_node) == (PREFILL_PATH, "p0")


def test_with_link_rates_the_read_side_is_where_it_ends_first():
    prefills, decodes = loads()
    req = WaitingRequest("r", 100, hit_tokens=80)
    dual = DualPathPlacer(BS, "dual", thresholds=(10_000, 10_000))
    # the decode side's queue is longer, but its link reads 4x faster: (160 + 80) / 400
    # ends before (0 + 80) / 100
    rp = ReadPaths("dual", rates=(100 / BS, 400 / BS))  # blocks per second
    rates = rp.token_rates(BS, ["p0", "p1"], ["d0"])
    assert rates == {"p0": 100.0, "p1": 100.0, "d0": 400.0}
    a = dual.place(req, prefills, decodes, {"d0": 160}, CONDUCTOR, rates)
    assert (a.path, a.read_node) == (DECODE_PATH, "d0")
    a = dual.place(req, prefills, decodes, {"d0": 160}, CONDUCTOR)  # rates unknown
    assert (a.path, a.read_node) == (PREFILL_PATH, "p0")
    assert ReadPaths("dual").token_rates(BS, ["p0"], ["d0"]) is None


def test_decode_choice_follows_the_z_rule():
    placer = DualPathPlacer(BS, "dual", thresholds=(10_000, 10_000))
    prefills = [EngineLoad("p0", "p0")]
    # Z = 1.05 * (100 + 300 + 20) / 2 = 220.5: d0 (300 + 100) is over it, d1 (20 + 100)
    # under it although d1 runs more requests
    decodes = [
        EngineLoad("d0", "d0", 1, 300, free_tokens=1000),
        EngineLoad("d1", "d1", 4, 20, free_tokens=1000),
    ]
    assert placer.place(WaitingRequest("r", 100), prefills, decodes, {}, CONDUCTOR).decode == "d1"
    # Z = 1.05 * (5 + 100 + 98) / 2 = 106.6: both under it (105, 103), so the fewest
    # requests win over the fewest tokens
    decodes = [
        EngineLoad("d0", "d0", 1, 100, free_tokens=1000),
        EngineLoad("d1", "d1", 4, 98, free_tokens=1000),
    ]
    assert placer.place(WaitingRequest("r", 5), prefills, decodes, {}, CONDUCTOR).decode == "d0"


def test_requests_no_replica_can_take_are_refused_with_the_reason():
    placer = DualPathPlacer(BS, "dual", thresholds=(40, 100))
    prefills, decodes = loads(p0_tok=200, p1_tok=150)
    with pytest.raises(RequestRejected) as busy:
        placer.place(WaitingRequest("r", 10), prefills, decodes, {}, CONDUCTOR)
    assert busy.value.reason == "prefill_busy"
    prefills, decodes = loads()
    with pytest.raises(RequestRejected) as full:
        placer.place(WaitingRequest("r", 2000), prefills, decodes, {}, CONDUCTOR)
    assert full.value.reason == "decode_full"
    with pytest.raises(ValueError, match="thresholds"):
        DualPathPlacer(BS, "dual", thresholds=(-1, 5))


def test_decide_updates_the_views_like_any_accepted_decision():
    placer = DualPathPlacer(BS, "dual", thresholds=(10_000, 10_000))
    prefills = [PrefillInstance("p0", queued_tokens=50), PrefillInstance("p1")]
    decodes = [DecodeInstance("d0", total_blocks=64)]
    creq = ConductorRequest("r", list(range(6)), 100, 20, BS)
    decision, a = placer.decide(creq, 4, prefills, {"p0": 1}, decodes, {}, CONDUCTOR)
    assert (a.prefill, a.decode, decision.cached_blocks) == ("p1", "d0", 4)
    apply_decision(decision, creq, prefills, decodes, 0.0)
    assert prefills[1].queued_tokens == 100 - 4 * BS  # its uncomputed tokens
    assert (decodes[0].pending, decodes[0].pending_blocks) == (1, 8)  # 120 tokens' blocks


def test_read_paths_record_a_side_chosen_elsewhere():
    rp = ReadPaths("dual")
    rp.record("a#1", DECODE_PATH, "d0", 5)
    rp.record("b#1", PREFILL_PATH, "p0", 0)  # nothing stored: nothing queued
    assert rp.tokens(BS) == {"d0": 5 * BS}
    assert rp.counts == {PREFILL_PATH: 0, DECODE_PATH: 1}
    rp.done("a#1")
    assert rp.tokens(BS) == {"d0": 0}
