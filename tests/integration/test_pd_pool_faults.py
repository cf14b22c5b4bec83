"""The soak's P/D phase at CI size (``bench/soak.py``'s own code on one app): a disaggregated
group served as one shared pool (``actors.disagg.pool_actors``) under closed-loop load while
actors of each kind are killed, as ``actors.fault_targets`` finds them. Every request ends
with its exact greedy tokens, or retriable and then sent again until it does; nothing is
lost, the app is back at full strength by itself and no block is left in use.

- The Conductor's process (the group's one Serve replica) and a KV store shard: the prefill
  and decode replicas that ran before the Conductor died are the ones serving after it (the
  new Conductor attached to them; nothing was restarted).
- A prefill and a decode replica (named in the pool's namespace, not Serve's): each is found,
  killed, and replaced by a new actor.
- The pool scaled down under load: a prefill or decode replica asked to drain is drained
  with requests on it and retired (a replacement joined first); and the weights updated
  under load (the admin route, the app's own weights as a new version): every request
  still gets the reference tokens, every pool replica runs the new version.
"""

from __future__ import annotations

import pytest

from actors.fault_targets import live_actors
from bench import soak, soak_app

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

APP_PHASE = soak_app.pd_phase()


def engine_actors() -> set[tuple[str, str]]:
    return {(a.kind, a.actor_id) for a in live_actors(["prefill", "decode"])}


@pytest.fixture(scope="module")
def cases():
    token_lists = soak_app.prompts(6, seed=3)
    return list(zip(token_lists, soak_app.reference_tokens(token_lists), strict=True))


@pytest.fixture(scope="module")
def app():
    with soak_app.running_app(APP_PHASE, num_cpus=2) as url:
        yield url


def soak_once(url: str, kinds: list[str], cases) -> tuple[soak.PhaseReport, str]:
    """One kill of each of ``kinds`` under the load of two clients, each kill as soon as the
    app is at full strength and a request is in flight."""
    phase = soak_app.pd_phase(kinds=kinds)
    lines: list[str] = []
    report = soak.soak(url, phase, cases, faults=1, clients=2, pause=(0, 0), log=lines.append)
    return report, soak.table([report]) + "\n" + "\n".join(lines)


def assert_nothing_lost(report: soak.PhaseReport, kinds: list[str], table: str) -> None:
    for kind in kinds:
        k = report.kinds[kind]
        assert k.not_found == 0, table  # the lookup found a live actor of the kind
        assert k.faults == 1 and k.not_recovered == 0 and len(k.recovery_s) == 1, table
    tallies = report.tally.values()
    assert sum(t.ok for t in tallies) > 0, table
    assert sum(t.lost + t.dropped for t in tallies) == 0, table
    assert sum(t.wrong for t in tallies) == 0, table
    assert sum(t.gave_up for t in tallies) == 0, table  # every retriable one was retried, ok
    assert report.leaked == 0 and report.blocks, table


def test_conductor_and_store_shard_killed_under_load_lose_nothing(app, cases):
    kinds = ["replica", "store"]
    before = engine_actors()
    report, table = soak_once(app, kinds, cases)
    after = engine_actors()
    assert_nothing_lost(report, kinds, table)
    assert len(before) == 2 and after == before, (before, after)


def test_prefill_and_decode_replicas_killed_under_load_lose_nothing(app, cases):
    kinds = ["prefill", "decode"]
    before = engine_actors()
    report, table = soak_once(app, kinds, cases)
    after = engine_actors()
    assert_nothing_lost(report, kinds, table)
    assert {k for k, _ in before} == {k for k, _ in after} == {"prefill", "decode"}
    assert not before & after, (before, after)  # both replaced: the killed ones were found


def test_a_pool_scaled_down_and_a_weight_update_under_load_lose_nothing(app, cases):
    kinds = [soak_app.SCALE_DOWN, soak_app.WEIGHTS]
    before = engine_actors()
    report, table = soak_once(app, kinds, cases)
    after = engine_actors()
    assert_nothing_lost(report, kinds, table)
    assert sorted(k for k, _ in after) == ["decode", "prefill"], (before, after)
    assert len(before & after) == 1, (before, after)  # the drained one left, a new one came


def test_a_conductor_after_weight_updates_attaches_without_loading_them_again(app, cases):
    """After the update of the test above, the Conductor's process is killed under load:
    the next Conductor catches up on the app's weight log, but the pool replicas it
    attaches to run the latest version already and load nothing (before, each reloaded
    every update of the log: a Conductor kill after three updates took about 30 s instead
    of 4 in the soak)."""
    import ray

    from actors.fault_targets import handle

    def versions_and_loads() -> dict[str, tuple[int, int]]:
        actors = live_actors(["prefill", "decode"])
        got = ray.get([handle(a).weight_version.remote() for a in actors])
        loads = ray.get([handle(a).loads.remote() for a in actors])
        return {a.actor_id: (v, n) for a, v, n in zip(actors, got, loads, strict=True)}

    before = versions_and_loads()
    assert before and all(v >= 1 for v, _ in before.values()), before  # an update ran
    report, table = soak_once(app, ["replica"], cases)
    assert_nothing_lost(report, ["replica"], table)
    assert versions_and_loads() == before, table  # the same actors, nothing loaded again
    # the update the dead Conductor sent lived in its process's objects: a later update
    # still builds the replicas' weights (each keeps what it loaded, not a dead ref)
    report, table = soak_once(app, [soak_app.WEIGHTS], cases)
    assert_nothing_lost(report, [soak_app.WEIGHTS], table)
