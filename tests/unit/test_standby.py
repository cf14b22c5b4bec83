"""Warm standby replicas: the pure pool (``policies.standby``) and the router holding one
(a standby is out of the routing view until an active replica leaves, then takes its place
at once and is asked for its whole cached set)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from actors.serving.config import ReplicaGroupConfig
from actors.serving.metrics import ReplicaMetrics
from actors.serving.router import RouterDeployment
from policies.replica_stats import ReplicaStats
from policies.routing import RouteRequest
from policies.standby import StandbyPool


def test_pool_keeps_wanted_active_and_promotes_the_oldest_standby():
    pool = StandbyPool({"main": 2})
    assert [pool.join(r, "main") for r in ("a", "b", "c", "d")] == [True, True, False, False]
    assert pool.standby_ids() == ["c", "d"]
    assert pool.leave("a") == "c"  # the first standby to join takes the place
    assert pool.active["main"] == ["b", "c"] and pool.standby_ids() == ["d"]
    assert pool.leave("d") is None  # a standby leaving promotes nothing
    assert pool.leave("b") is None  # no standby left: the group runs short until one joins
    assert pool.join("e", "main") is True  # the replacement fills the active place
    assert pool.join("f", "main") is False
    assert pool.leave("unknown") is None


def test_a_group_without_a_wanted_count_keeps_every_replica_active():
    pool = StandbyPool({"main": 1})
    assert [pool.join(r, "other") for r in ("x", "y", "z")] == [True, True, True]
    assert not pool.is_standby("z") and pool.standby_ids() == []


def stats(total: int = 64) -> ReplicaStats:
    return ReplicaStats(0, 0, 0, total, total, 0.0, 0.0, time=0.0)


def ranked(pairs: list[tuple[str, str]]) -> set[str]:
    return {rid for rid, _ in pairs}


SNAP = ReplicaMetrics().snapshot()


async def joined(active: int, *replicas: str) -> RouterDeployment:
    """A router for group "main" wanting ``active`` active replicas, each of ``replicas``
    joined by its first report (the later ones as spares)."""
    router = RouterDeployment("least_loaded", block_size=16, active_replicas={"main": active})
    for rid in replicas:
        await router.report(rid, "main", stats(), SNAP, [], None, True)
    return router


def test_router_routes_around_a_standby_until_an_active_replica_dies():
    async def run() -> None:
        router = await joined(2, "a", "b", "s")
        assert ranked(await router.route(RouteRequest("q0", [], 8))) == {"a", "b"}
        assert await router.standby() == ["s"]
        assert set(await router.snapshot()) == {"a", "b"}
        # the standby's reports are kept, not routed on
        stored = [("stored", 7)]
        assert await router.report("s", "main", stats(), SNAP, stored, None, False) is False
        assert ranked(await router.route(RouteRequest("q1", [], 8))) == {"a", "b"}

        await router.removed(["a"])  # Serve found "a" dead: "s" serves in its place at once
        assert ranked(await router.route(RouteRequest("q2", [], 8))) == {"b", "s"}
        assert await router.standby() == []
        assert set(await router.snapshot()) == {"b", "s"}
        # the promoted standby's next report is asked for its whole cached set, once
        assert await router.report("s", "main", stats(), SNAP, [], None, False) is True
        assert await router.report("s", "main", stats(), SNAP, [], [7], False) is False
        # a push from the dead replica still in flight does not bring it back
        assert await router.report("a", "main", stats(), SNAP, [], None, False) is False
        # Serve's replacement joins as the new standby
        await router.report("r", "main", stats(), SNAP, [], None, True)
        assert await router.standby() == ["r"]
        assert ranked(await router.route(RouteRequest("q3", [], 8))) == {"b", "s"}

    asyncio.run(run())


def test_a_request_serve_overflowed_onto_a_standby_is_not_recorded_on_it():
    async def run() -> None:
        router = await joined(1, "a", "s")
        req = RouteRequest("q0", [], 8)
        assert ranked(await router.route(req)) == {"a"}
        await router.moved(req, "a", "s")  # "a" was full: Serve took the last tier
        view = router.state.view
        assert [v.replica_id for v in view.replicas] == ["a"]
        assert view.replicas[0].num_waiting == 0  # the record left "a" and went nowhere

    asyncio.run(run())


@pytest.mark.parametrize(
    "extra", [{"num_prefill": 1, "num_decode": 1}, {"autoscaling": {"max_replicas": 3}}]
)
def test_standby_is_refused_for_disaggregated_and_autoscaled_groups(extra):
    with pytest.raises(ValidationError, match="standby_replicas is for colocated groups"):
        ReplicaGroupConfig(name="g", standby_replicas=1, **extra)


def test_a_replica_restarting_its_workers_hands_its_place_to_a_spare():
    async def run() -> None:
        router = await joined(2, "a", "b", "s")
        # "a" lost a worker and brings its group up again: "s" serves meanwhile
        assert await router.report("a", "main", stats(), SNAP, [], None, False, True) is False
        assert ranked(await router.route(RouteRequest("q0", [], 8))) == {"b", "s"}
        assert await router.report("a", "main", stats(), SNAP, [], None, False, True) is False
        assert set(await router.snapshot()) == {"b", "s"} and await router.standby() == []
        # recovered: it rejoins as the group's spare
        assert await router.report("a", "main", stats(), SNAP, [], None, False) is False
        assert await router.standby() == ["a"]
        assert ranked(await router.route(RouteRequest("q1", [], 8))) == {"b", "s"}

    asyncio.run(run())


def test_without_a_spare_a_restarting_replica_stays_in_the_view():
    async def run() -> None:
        router = await joined(2, "a", "b")
        await router.report("a", "main", stats(), SNAP, [], None, False, True)
        assert ranked(await router.route(RouteRequest("q0", [], 8))) == {"a", "b"}

    asyncio.run(run())
