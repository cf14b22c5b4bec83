"""Sessions in cache-aware routing: the session breaks prefix-match ties and stands in when
nothing matches (its last replica, else its ring owner), never a hard pin."""

from __future__ import annotations

from policies.routing import ConsistentHash, PrefixAware, ReplicaView, RouteRequest

SYSTEM = [101, 102, 103, 104]  # a shared prompt every replica holds


def views(loads: dict[str, int], cached: dict[str, set[int]] | None = None) -> list[ReplicaView]:
    cached = cached or {}
    return [
        ReplicaView(rid, queued_prefill_tokens=q, cached=cached.get(rid, set()))
        for rid, q in loads.items()
    ]


def req(hashes: list[int], session: str | None = "s1") -> RouteRequest:
    return RouteRequest("r", hashes, 16 * len(hashes), session)


def test_nothing_matches_a_session_goes_to_its_ring_owner_then_stays():
    policy = PrefixAware()
    replicas = views({"a": 0, "b": 0, "c": 0})
    owner = ConsistentHash().rank(req([1]), replicas, 0.0)[0]
    assert policy.rank(req([1]), replicas, 0.0)[0] == owner
    # without a session the same request goes by load and cache size: the given order
    assert policy.rank(req([1], None), replicas, 0.0)[0] == "a"
    # the next turn sees a little load on the owner: it still leans to the session's replica
    busier = views({rid: 300 if rid == owner else 0 for rid in ("a", "b", "c")})
    assert policy.rank(req([2]), busier, 0.0)[0] == owner


def test_a_prefix_tie_is_broken_by_the_session_not_by_load():
    policy = PrefixAware()
    held = {rid: set(SYSTEM) for rid in ("a", "b", "c")}
    replicas = views({"a": 0, "b": 500, "c": 0}, held)
    first = policy.rank(req(SYSTEM + [7]), replicas, 0.0)[0]
    # every replica holds the same prefix: the session's replica wins, now the busiest
    shifted = views({rid: 400 if rid == first else 0 for rid in ("a", "b", "c")}, held)
    assert policy.rank(req(SYSTEM + [8]), shifted, 0.0)[0] == first


def test_a_longer_prefix_elsewhere_beats_the_session():
    policy = PrefixAware()
    replicas = views({"a": 0, "b": 0})
    first = policy.rank(req([1, 2, 3, 4]), replicas, 0.0)[0]
    other = "b" if first == "a" else "a"
    cached = {other: {1, 2, 3, 4, 5, 6}, first: {1, 2}}
    assert policy.rank(req([1, 2, 3, 4, 5, 6, 9]), views({"a": 0, "b": 0}, cached), 0.0)[0] == (
        other
    )


def test_an_overloaded_session_replica_falls_back_to_the_least_loaded():
    policy = PrefixAware(max_imbalance=1000)
    replicas = views({"a": 0, "b": 0, "c": 0})
    first = policy.rank(req([1]), replicas, 0.0)[0]
    loads = {rid: 5000 if rid == first else 10 * i for i, rid in enumerate(("a", "b", "c"))}
    ranking = policy.rank(req([2]), views(loads), 0.0)
    assert ranking[0] != first and ranking[-1] == first
    assert ranking[0] == min((r for r in loads if r != first), key=loads.__getitem__)


def test_a_removed_replica_hands_the_session_to_its_ring_owner_among_the_rest():
    policy = PrefixAware()
    replicas = views({"a": 0, "b": 0, "c": 0})
    first = policy.rank(req([1]), replicas, 0.0)[0]
    rest = [r for r in replicas if r.replica_id != first]
    owner = ConsistentHash().rank(req([1]), rest, 0.0)[0]
    assert policy.rank(req([2]), rest, 0.0)[0] == owner
    # affinity off: the session is ignored
    plain = PrefixAware(session_affinity=False)
    assert plain.rank(req([1]), replicas, 0.0)[0] == "a"


def test_remembered_sessions_are_bounded():
    policy = PrefixAware(max_sessions=2)
    replicas = views({"a": 0, "b": 0, "c": 0})
    for sid in ("x", "y", "z"):
        policy.rank(req([1], sid), replicas, 0.0)
    assert list(policy._sessions) == ["y", "z"]
