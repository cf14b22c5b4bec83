import pytest

from policies.region_balancer import (
    BalancedRequest,
    BalancerConfig,
    BalancerStatus,
    RegionBalancer,
    nearest_alive,
)
from policies.residency import ResidencyPolicy


def req(rid, hashes=(), tenant=None, session=None, forwarded=False):
    return BalancedRequest(rid, tuple(hashes), 0.0, session, tenant, "us", forwarded)


def balancer(push="selective", residency=None, choice="trie"):
    b = RegionBalancer("lb-us", "us", BalancerConfig(push=push, choice=choice), residency)
    for r in ("us0", "us1"):
        b.add_replica(r)
        b.on_replica_probe(r, 0, 0.0, 0.0)
    b.add_remote("lb-eu", "eu")
    b.add_remote("lb-asia", "asia")
    return b


def test_local_first_with_prefix_affinity_then_fcfs_wait():
    b = balancer()
    b.remove_remote("lb-eu")
    b.remove_remote("lb-asia")
    b.submit(req("a", [1, 2]), 0.0)
    (p,) = b.dispatch(0.0)
    assert (p.target, p.kind, p.matched_blocks) == ("us0", "local", 0)
    b.on_finished("a", 0.5)
    b.on_replica_probe("us0", 0, 0.6, 0.6)
    b.submit(req("b", [1, 2, 3]), 0.7)
    b.submit(req("c", [1, 2, 4]), 0.7)
    b.submit(req("d", [1]), 0.7)
    placed = b.dispatch(0.7)
    # b goes where [1, 2] was served; c finds us0 taken (optimistic count) and goes to us1;
    # d waits: no replica is free and there is no peer
    assert [(p.request.request_id, p.target, p.matched_blocks) for p in placed] == [
        ("b", "us0", 2),
        ("c", "us1", 0),
    ]
    assert [r.request_id for r in b.queue] == ["d"]
    b.on_prefilled("c", 0.8)  # c's first token: us1 takes the next one
    assert [(p.request.request_id, p.target) for p in b.dispatch(0.8)] == [("d", "us1")]


def test_forwarding_choice_uses_the_snapshot_and_peer_availability():
    b = balancer()
    for r in ("us0", "us1"):
        b.on_replica_probe(r, 1, 0.0, 0.0)  # both local replicas busy
    b.on_remote_probe("lb-eu", BalancerStatus(1, 0), 0.0, 0.0)
    b.on_remote_probe("lb-asia", BalancerStatus(3, 0), 0.0, 0.0)
    b.submit(req("a", [5, 6]), 0.0)
    (p,) = b.dispatch(0.0)
    assert p.kind == "forward" and p.request.forwarded
    first = p.target
    # the next request with the same prefix follows it while that peer is available
    b.on_remote_probe(first, BalancerStatus(2, 0), 0.1, 0.1)
    b.submit(req("b", [5, 6, 7]), 0.1)
    (p2,) = b.dispatch(0.1)
    assert (p2.target, p2.matched_blocks) == (first, 2)
    # a peer with a long queue or no free replica is skipped
    b.on_remote_probe("lb-eu", BalancerStatus(1, 5), 0.2, 0.2)
    b.on_remote_probe("lb-asia", BalancerStatus(0, 0), 0.2, 0.2)
    b.submit(req("c", [5, 6]), 0.2)
    assert b.dispatch(0.2) == []
    b.on_remote_probe("lb-eu", BalancerStatus(1, 2), 0.3, 0.3)
    assert [p.target for p in b.dispatch(0.3)] == ["lb-eu"]


def test_a_forwarded_request_is_never_forwarded_again():
    b = balancer()
    for r in ("us0", "us1"):
        b.on_replica_probe(r, 1, 0.0, 0.0)
    b.on_remote_probe("lb-eu", BalancerStatus(4, 0), 0.0, 0.0)
    b.submit(req("a", [1], forwarded=True), 0.0)
    assert b.dispatch(0.0) == []  # waits for a local replica
    b.on_replica_probe("us1", 0, 0.1, 0.1)
    (p,) = b.dispatch(0.1)
    assert (p.target, p.kind) == ("us1", "local")


def test_residency_filter():
    pol = ResidencyPolicy({"acme": ["us", "eu"], "gov": ["us"]})
    assert pol.allowed("acme", "eu") and not pol.allowed("acme", "asia")
    assert pol.allowed(None, "asia") and pol.allowed("other", "asia")
    assert pol.filter("gov", ["eu", "us", "asia"]) == ["us"]
    assert ResidencyPolicy(default=["eu"]).filter("x", ["us", "eu"]) == ["eu"]
    with pytest.raises(ValueError):
        ResidencyPolicy({"t": []})
    b = balancer(residency=pol)
    for r in ("us0", "us1"):
        b.on_replica_probe(r, 1, 0.0, 0.0)
    b.on_remote_probe("lb-eu", BalancerStatus(1, 0), 0.0, 0.0)
    b.on_remote_probe("lb-asia", BalancerStatus(4, 0), 0.0, 0.0)
    assert b.remote_candidates(req("g", tenant="gov"), 0.0) == []
    assert b.remote_candidates(req("x", tenant="acme"), 0.0) == ["lb-eu"]
    assert b.remote_candidates(req("y"), 0.0) == ["lb-eu", "lb-asia"]
    b.submit(req("g", tenant="gov"), 0.0)
    assert b.dispatch(0.0) == []  # gov may only use us: it waits


def test_push_modes():
    imm = balancer("immediate")
    for i in range(5):
        imm.submit(req(f"q{i}", [i]), 0.0)
    assert len(imm.dispatch(0.0)) == 5  # blind pushing never waits
    cap = RegionBalancer("lb", "us", BalancerConfig(push="cap", outstanding_cap=2))
    cap.add_replica("r")
    for i in range(3):
        cap.submit(req(f"q{i}"), 0.0)
    assert [p.request.request_id for p in cap.dispatch(0.0)] == ["q0", "q1"]
    cap.on_prefilled("q0", 0.1)
    assert cap.dispatch(0.1) == []  # a cap counts until finish
    cap.on_finished("q0", 0.2)
    assert [p.request.request_id for p in cap.dispatch(0.2)] == ["q2"]
    with pytest.raises(ValueError):
        BalancerConfig(push="eager")


def test_session_hash_skips_unavailable_replicas():
    b = balancer(choice="hash")
    b.submit(req("a", session="s1"), 0.0)
    (p,) = b.dispatch(0.0)
    owner = p.target
    other = "us1" if owner == "us0" else "us0"
    b.on_finished("a", 0.1)
    b.on_replica_probe(owner, 0, 0.2, 0.2)
    b.submit(req("b", session="s1"), 0.2)
    assert b.dispatch(0.2)[0].target == owner  # same session, same replica
    b.submit(req("c", session="s1"), 0.3)
    assert b.dispatch(0.3)[0].target == other  # the owner is busy: next on the ring


def test_status_and_nearest_alive():
    b = balancer()
    b.on_replica_probe("us0", 1, 0.0, 0.0)
    assert b.status(0.0) == BalancerStatus(1, 0)
    delay = {("us", "eu"): 0.04, ("us", "asia"): 0.08, ("eu", "asia"): 0.1}
    alive = [("lb-asia", "asia"), ("lb-eu", "eu")]
    assert nearest_alive("us", alive, delay) == "lb-eu"
    assert nearest_alive("asia", alive, delay) == "lb-asia"
    assert nearest_alive("us", [], delay) is None


def test_exact_local_index_follows_what_replicas_hold_not_what_was_sent():
    from policies.target_choice import CachedPrefixChoice

    cached = {"us0": set(), "us1": {1, 2}}
    b = RegionBalancer("lb", "us", BalancerConfig(), local_choice=CachedPrefixChoice(cached))
    for r in ("us0", "us1"):
        b.add_replica(r)
        b.on_replica_probe(r, 0, 0.0, 0.0)
    b.submit(req("a", [1, 2, 3]), 0.0)
    (p,) = b.dispatch(0.0)
    assert (p.target, p.matched_blocks) == ("us1", 2)
    b.on_finished("a", 0.1)
    cached["us1"].clear()  # us1 evicted it (its events said so); us0 now holds it
    cached["us0"].update({1, 2, 3})
    b.on_replica_probe("us1", 0, 0.2, 0.2)
    b.submit(req("b", [1, 2, 3, 4]), 0.2)
    (p,) = b.dispatch(0.2)
    assert (p.target, p.matched_blocks) == ("us0", 3)


def test_measured_prefix_lengths_pick_the_holder_and_are_used_once():
    from policies.target_choice import MeasuredPrefixChoice

    choice = MeasuredPrefixChoice()
    b = RegionBalancer("lb", "us", BalancerConfig(), local_choice=choice)
    for r in ("us0", "us1"):
        b.add_replica(r)
        b.on_replica_probe(r, 0, 0.0, 0.0)
    choice.measured["a"] = {"us0": 0, "us1": 3, "eu0": 9}  # eu0 is not a candidate here
    b.submit(req("a", [1, 2, 3]), 0.0)
    (p,) = b.dispatch(0.0)
    assert (p.target, p.matched_blocks) == ("us1", 3)
    assert choice.measured == {}
