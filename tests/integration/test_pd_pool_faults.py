"""A disaggregated group served as one shared pool (``actors.disagg.pool_actors``) under
closed-loop load while its Conductor's process (the group's one Serve replica) and a KV
store shard are killed: every request ends with its exact greedy tokens or a clear
retriable error, nothing is lost, the app is back at full strength by itself, and the
prefill and decode replicas that ran before the Conductor died are the ones serving after
it (the new Conductor attached to them; nothing was restarted)."""

from __future__ import annotations

import pytest

from bench import soak

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

PHASE = soak.pd_phase(kinds=["replica", "store"])


def engine_actors() -> set[tuple[str, int]]:
    return {(a.kind, a.pid) for a in soak.live_actors() if a.kind in ("prefill", "decode")}


def test_conductor_and_store_shard_killed_under_load_lose_nothing():
    token_lists = soak.prompts(6, seed=3)
    cases = list(zip(token_lists, soak.reference_tokens(token_lists), strict=True))
    with soak.running_app(PHASE, num_cpus=2) as url:
        before = engine_actors()
        lines: list[str] = []
        report = soak.soak(
            url, PHASE, cases, faults=1, clients=2, pause=(0.5, 1.5), log=lines.append
        )
        after = engine_actors()
    table = soak.table([report]) + "\n" + "\n".join(lines)
    for kind in PHASE.kinds:
        k = report.kinds[kind]
        assert k.faults == 1 and k.not_recovered == 0, table
    tallies = report.tally.values()
    assert sum(t.ok for t in tallies) > 0, table
    assert sum(t.lost + t.dropped for t in tallies) == 0, table
    assert sum(t.wrong for t in tallies) == 0, table
    assert report.leaked == 0 and report.blocks, table
    assert len(before) == 2 and after == before, (before, after)
