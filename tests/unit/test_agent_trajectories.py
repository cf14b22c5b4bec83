"""Agent trajectories from a conversation trace (``sim.agent_trajectories``) and their
simulated report (``sim.report_agents``), on hand-built traces."""

from __future__ import annotations

import pytest

from policies.pd_costs import LinearPrefillTime
from sim.agent_trajectories import (
    AgentTrajectory,
    AgentTurn,
    build_trajectories,
    conversation_chains,
    scaled,
    summary,
)
from sim.dualpath import DualPathConfig, DualPathSim, Trajectory, Turn
from sim.report_agents import agents_section, live_lines, simulate
from sim.traces import DEFAULT_TRACE_DIR, load_trace
from sim.workload import TraceRequest


def req(i: int, at: float, inp: int, out: int, hashes: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(f"r{i}", at, inp, out, hashes)


# Two conversations sharing a system block (0): A = r0 -> r2 -> r4, B = r1 -> r3; r5 shares
# only A's first two blocks with r0 (r0's full blocks are 0, 1: it continues nothing, as r2
# already continued r0), r6 shares block 0 only (too short a prefix: a new conversation).
TRACE = [
    req(0, 0.0, 1200, 100, (0, 1, 2)),
    req(1, 1.0, 1100, 50, (0, 5, 6)),
    req(2, 10.0, 1400, 80, (0, 1, 2, 3)),
    req(3, 12.0, 1300, 60, (0, 5, 6, 7)),
    req(4, 30.0, 1700, 90, (0, 1, 2, 3, 4)),
    req(5, 31.0, 1100, 10, (0, 1, 9)),
    req(6, 32.0, 600, 10, (0, 8)),
]


def test_chains_follow_full_block_prefixes():
    chains = conversation_chains(TRACE)
    ids = [[r.request_id for r in c] for c in chains]
    assert ids == [["r0", "r2", "r4"], ["r1", "r3"], ["r5"], ["r6"]]


def test_user_turns_come_from_the_trace_and_tool_steps_fill_the_rest():
    (t,) = build_trajectories(TRACE, 1, seed=3, min_user_turns=3, turns=(9, 9))
    assert t.source == "r0" and t.first == 1200 and len(t.turns) == 9
    users = [s for s in t.turns if not s.tool]
    # appends: 1400 - 1200 - 100 = 100, 1700 - 1400 - 80 = 220; pauses the arrival gaps
    assert [(s.append, s.output, s.pause_s) for s in users] == [
        (0, 100, 0.0),
        (100, 80, 10.0),
        (220, 90, 20.0),
    ]
    # six tool steps, two after each user turn, each in the paper's ranges
    assert [s.tool for s in t.turns] == [False, True, True] * 3
    for s in t.turns:
        if s.tool:
            assert 430 <= s.append <= 610 and 150 <= s.output <= 180 and s.pause_s > 0
    lengths = t.prompt_lengths()
    assert lengths[0] == 1200
    for k in range(1, 9):  # each prompt: the previous one, its answer, the append
        assert lengths[k] == lengths[k - 1] + t.turns[k - 1].output + t.turns[k].append


def test_deterministic_by_seed():
    a = build_trajectories(TRACE, 5, seed=1, turns=(4, 12))
    assert a == build_trajectories(TRACE, 5, seed=1, turns=(4, 12))
    assert a != build_trajectories(TRACE, 5, seed=2, turns=(4, 12))
    with pytest.raises(ValueError, match="4\\+ turns"):
        build_trajectories(TRACE, 1, min_user_turns=4)


def test_scaled_shrinks_lengths_pauses_and_turns():
    t = AgentTrajectory(
        1000,
        (AgentTurn(0, 160, 0.0, False), AgentTurn(480, 170, 8.0, True), AgentTurn(3, 1, 1.0, True)),
        "r0",
    )
    (s,) = scaled([t], length=1 / 16, pause=0.5, max_turns=2, max_output=10, max_pause_s=3.0)
    assert s.first == 62 and s.source == "r0"
    assert s.turns == (AgentTurn(0, 10, 0.0, False), AgentTurn(30, 10, 3.0, True))
    (c,) = scaled([t], length=1 / 16, max_first=50)
    assert c.first == 50 and c.turns[2].append == 1 and c.turns[2].output == 1


def test_summary_counts():
    t = AgentTrajectory(100, (AgentTurn(0, 10, 0.0, False), AgentTurn(20, 30, 2.0, True)), "r")
    s = summary([t])
    assert s["turns"] == 2 and s["mean_final_context"] == 100 + 10 + 20 + 30
    assert s["tool_share"] == 1.0 and s["median_tool_pause_s"] == 2.0


# -- the simulator path ----------------------------------------------------------------------
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


def test_a_pause_delays_the_next_turn_and_ttft_counts_from_its_arrival():
    # turn 0: prefill 0-1, decode 5 x 0.1 to 1.5; turn 1 arrives at 1.5 + 2 = 3.5, reads
    # its 104-token hit in 1.04 s, prefills 4.54-5.54 (TTFT 2.04), decodes to 6.04.
    paused = DualPathSim(CFG, "basic")
    r = paused.run([Trajectory(100, [Turn(0, 5), Turn(10, 5, pause=2.0)])])
    assert r.completion_time == pytest.approx(6.04)
    assert paused.ttfts == pytest.approx([1.0, 2.04])
    at_once = DualPathSim(CFG, "basic").run([Trajectory(100, [Turn(0, 5), Turn(10, 5)])])
    assert at_once.completion_time == pytest.approx(4.04)


def test_as_sim_keeps_prompts_and_pauses():
    t = AgentTrajectory(100, (AgentTurn(0, 5, 0.0, False), AgentTurn(10, 5, 2.0, True)), "r")
    assert t.as_sim() == Trajectory(100, [Turn(0, 5, 0.0), Turn(10, 5, 2.0)])
    res = simulate([t], CFG, "basic", ttft_slo=1.5)
    assert res.ttft_p50 == pytest.approx(1.52)  # the median of 1.0 and 2.04
    assert res.completion == pytest.approx(6.04) and res.completion_p50 == pytest.approx(6.04)
    assert res.goodput == pytest.approx(1 / 6.04)  # one turn of two within 1.5 s


def test_section_compares_variants_and_shows_live_figures():
    live = {
        s: {
            "ttft_p50_ms": 100.0,
            "ttft_p99_ms": 200.0,
            "completion_p50_s": 3.0,
            "goodput_turns_s": 1.5,
            "cached_share": 0.5,
        }
        for s in ("colocated", "pd-prefill", "dualpath")
    }
    lines = agents_section(TRACE, trajectories=3, pd=(1, 2), live=live)
    text = "\n".join(lines)
    for v in ("| basic |", "| dual |", "| dual+sched |", "| colocated |", "| dualpath |"):
        assert v in text
    row = next(x for x in live_lines(live) if x.startswith("| pd-prefill"))
    assert row == "| pd-prefill | 100 | 200 | 3.0 | 1.50 | 50% | n/a |"


@pytest.mark.skipif(
    not (DEFAULT_TRACE_DIR / "conversation_trace.jsonl").exists(), reason="no trace folder"
)
def test_the_repository_trace_has_multi_turn_conversations():
    chains = conversation_chains(load_trace("conversation"))
    multi = [c for c in chains if len(c) > 1]
    assert len(multi) > 2000 and max(map(len, multi)) >= 40
    for c in multi:  # every later turn carries its predecessor's full blocks
        for a, b in zip(c, c[1:], strict=False):
            assert (
                a.hash_ids and b.hash_ids and b.hash_ids[: len(a.hash_ids) - 1] == a.hash_ids[:-1]
            )
