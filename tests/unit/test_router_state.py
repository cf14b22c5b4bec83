from __future__ import annotations

from typing import Any

import pytest

from actors.serving.router_state import RouterState
from policies.replica_stats import ReplicaStats
from policies.routing import ROUTING_POLICIES, RouteRequest, make_routing_policy
from store.block_pool import BlockPool
from store.hashing import chained_block_hashes

BS = 4
POLICY_NAMES = ROUTING_POLICIES.names()


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def snapshot(t: float, **counters: Any) -> ReplicaStats:
    """A stats record taken at ``t``: idle, 100 free of 100 blocks, but for ``counters``."""
    base: dict[str, Any] = dict(
        num_running=0,
        num_waiting=0,
        queued_prefill_tokens=0,
        free_blocks=100,
        total_blocks=100,
        kv_usage=0.0,
        cache_hit_ratio=0.0,
    )
    return ReplicaStats(**{**base, **counters}, time=t)


def request(tokens: list[int], rid: str = "q", session: str | None = None) -> RouteRequest:
    return RouteRequest(rid, chained_block_hashes(tokens, BS), len(tokens), session)


def state(policy: str = "prefix_aware", n: int = 3, **kw) -> RouterState:
    s = RouterState(policy, block_size=BS, clock=kw.pop("clock", FakeClock()), **kw)
    for k in range(n):
        s.add_replica(f"r{k}", total_blocks=64)
    return s


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError) as e:
        RouterState("fastest")
    for name in POLICY_NAMES:
        assert name in str(e.value)
    assert set(POLICY_NAMES) == {
        "random",
        "round_robin",
        "least_loaded",
        "power_of_two",
        "prefix_aware",
        "consistent_hash",
    }
    with pytest.raises(ValueError, match="bad options"):
        RouterState("round_robin", max_imbalance=3)
    # Options reach the policy; hyphens are accepted for underscores.
    assert make_routing_policy("prefix-aware", max_imbalance=7.0).max_imbalance == 7.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_ranks_every_replica_once(name):
    s = state(name, n=4)
    for k in range(10):
        ranking = s.route(request(list(range(k, k + 9)), rid=f"q{k}", session=f"s{k % 3}"))
        assert sorted(ranking) == ["r0", "r1", "r2", "r3"]
    assert RouterState(name).route(request([1, 2, 3, 4])) == []  # no replicas yet


def test_round_robin_rotates_and_membership_changes_apply():
    s = state("round_robin", n=3)
    assert [s.route(request([1]))[0] for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    s.remove_replica("r1")
    assert "r1" not in s and len(s) == 2 and s.replica_ids == ["r0", "r2"]
    assert all("r1" not in s.route(request([1])) for _ in range(3))


def test_prefix_aware_follows_the_replicas_cache_events():
    s = state("prefix_aware", n=3)
    tokens = list(range(40))  # 10 full blocks
    pool = BlockPool(num_blocks=16, block_size=BS)
    blocks = pool.allocate(10)
    for b, h in zip(blocks, chained_block_hashes(tokens, BS), strict=True):
        pool.register(b, h, tokens[:BS])  # only the hash matters to the router
    s.on_events("r2", pool.drain_events())
    follow_up = request(tokens + [99, 98, 97, 96], rid="q1")
    assert s.route(follow_up)[0] == "r2"
    # The replica evicts the first block: the chain is broken, the prefix is worth nothing.
    pool.release(blocks)
    pool.evict_all_cached()
    s.on_events("r2", pool.drain_events())
    assert s.view.replica("r2").cached >= set(follow_up.block_hashes[10:])  # its own routing
    assert not s.view.replica("r2").cached & set(follow_up.block_hashes[:10])
    # With equal loads and no prefix anywhere, the smallest cache footprint wins: r2 still
    # holds the follow-up's last block, r0 and r1 hold nothing.
    for rid in s.replica_ids:
        s.on_stats(rid, snapshot(s.clock()))
    assert s.route(request(tokens, rid="q2"))[0] == "r0"
    with pytest.raises(ValueError):
        s.on_events("r0", [("bogus", 1)])


def test_a_decision_is_recorded_before_any_event_or_stats():
    s = state("prefix_aware", n=4)
    first = request(list(range(32)), rid="a")
    chosen = s.route(first)[0]
    assert s.view.replica(chosen).num_waiting == 1
    # The next turn of the same conversation goes where the first went.
    assert s.route(request(list(range(48)), rid="b"))[0] == chosen


def test_stats_use_the_injected_clock_to_keep_newer_decisions():
    clock = FakeClock(10.0)
    s = state("least_loaded", n=2, clock=clock)
    s.on_stats("r0", snapshot(10.0))
    s.on_stats("r1", snapshot(10.0, queued_prefill_tokens=50))
    clock.t = 11.0
    assert s.route(request(list(range(8)), rid="a"))[0] == "r0"  # 8 tokens queued on r0
    # A snapshot taken before that decision (time 10.5) keeps it on top...
    s.on_stats("r0", snapshot(10.5))
    assert s.view.replica("r0").queued_prefill_tokens == 8
    # ...one taken after it (time 11.5, now 12) shows the replica's own count.
    clock.t = 12.0
    s.on_stats("r0", snapshot(11.5, queued_prefill_tokens=3))
    assert s.view.replica("r0").queued_prefill_tokens == 3


def test_messages_from_unknown_or_removed_replicas_are_dropped():
    s = state("least_loaded", n=2)
    s.remove_replica("r1")
    s.on_stats("r1", snapshot(0.0))
    s.on_events("r1", [("stored", 5)])
    s.resync("r9", [1, 2])
    assert s.replica_ids == ["r0"]
    assert s.route(request([1, 2, 3, 4])) == ["r0"]
    s.resync("r0", [7])
    assert s.view.replica("r0").cached == {7}


def test_consistent_hash_keeps_a_session_on_one_replica():
    s = state("consistent_hash", n=5)
    owners = {
        s.route(request([k, k + 1, k + 2, k + 3], rid=f"q{k}", session="u1"))[0] for k in range(8)
    }
    assert len(owners) == 1


def test_the_record_follows_where_a_request_runs_even_after_a_snapshot():
    """The replica deployment passes over a full first choice: the router hears where the
    request runs. A snapshot of the first that arrived meanwhile absorbed the request's load
    (counting nothing, as the replica never got it), but not its blocks, which only that
    replica's events could confirm: they leave it, and the next request with that prefix
    goes where the blocks are."""
    clock = FakeClock(10.0)
    s = state("prefix_aware", n=2, clock=clock)
    for rid in s.replica_ids:
        s.on_stats(rid, snapshot(10.0))
    q = request(list(range(32)), rid="q")
    first, second = s.route(q)
    clock.t = 10.5
    s.on_stats(first, snapshot(10.4))  # taken after the routing: the record's load is absorbed
    s.moved(q, first, second)
    assert not s.view.replica(first).cached & set(q.block_hashes)
    assert s.view.replica(second).cached >= set(q.block_hashes)
    assert s.view.replica(second).num_waiting == 1
    assert s.route(request(list(range(40)), rid="q2"))[0] == second


def test_a_request_that_runs_nowhere_leaves_no_record():
    """Refused by its replica (or its start failed): the routing's load and blocks are taken
    back, so the view is as it was before the request."""
    s = state("prefix_aware", n=2)
    before = [(v.queued_prefill_tokens, v.num_waiting, v.free_blocks) for v in s.view.replicas]
    q = request(list(range(32)), rid="q")
    first = s.route(q)[0]
    s.moved(q, first, None)
    assert [(v.queued_prefill_tokens, v.num_waiting, v.free_blocks) for v in s.view.replicas] == (
        before
    )
    assert all(not v.cached for v in s.view.replicas)
    s.view.index.check()
