"""The multi-region simulator: every request placed once, forwarding takes one hop and its
delay shows in TTFT, and the global balancer pays the delay to its region."""

from policies.region_balancer import BalancerConfig
from policies.routing import RoundRobin
from sim.cluster import InstanceSpec
from sim.presets import ClusterConfig, make_cost
from sim.regional_workload import region_weights, split_regions
from sim.regions import MultiRegionCluster
from sim.workload import TraceRequest

DELAY = {("a", "b"): 0.05}


def spec() -> InstanceSpec:
    cost = make_cost(ClusterConfig(model="llama3-8b", gpu="L40S", tp=1))
    return InstanceSpec(cost, 2000, 16, token_budget=2048)


def burst(n: int) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.0, 4000, 20, session_id=f"s{i}") for i in range(n)]


def test_a_burst_in_one_region_spills_over_one_hop_and_pays_the_delay():
    reqs = burst(6)
    region_of = {r.request_id: "a" for r in reqs}
    c = MultiRegionCluster({"a": 1, "b": 1}, spec(), DELAY, region_of, balancer=BalancerConfig())
    stats = c.run(reqs)
    assert all(s.done for s in stats)
    assert 0 < c.forwarded < len(reqs)
    served_b = [s for s in stats if s.prefill_instance == 1]
    assert len(served_b) == c.forwarded  # each forwarded request ran in b, none came back
    assert min(s.ttft for s in served_b) >= 2 * DELAY[("a", "b")]
    lb_a, lb_b = c.balancers["a"], c.balancers["b"]
    assert lb_b.forwarded == 0 and lb_a.placed_local + lb_b.placed_local == len(reqs)
    assert len(c.loop) == 0  # probes stopped once everything finished


def test_region_local_never_forwards_and_global_pays_the_way_in():
    reqs = burst(4)
    region_of = {r.request_id: "b" for r in reqs}
    local = MultiRegionCluster(
        {"a": 1, "b": 1}, spec(), DELAY, region_of, balancer=BalancerConfig(forward=False)
    )
    stats = local.run(reqs)
    assert local.forwarded == 0 and all(s.prefill_instance == 1 for s in stats)
    glob = MultiRegionCluster(
        {"a": 1, "b": 1}, spec(), DELAY, region_of, global_policy=RoundRobin()
    )
    stats = glob.run(burst(4))
    assert all(s.done for s in stats)
    # b's clients reach the balancer in a (one delay) and, served in a, get tokens back
    # after another: at least 2 x 50 ms
    assert min(s.ttft for s in stats) >= 2 * DELAY[("a", "b")]


def test_diurnal_split_keeps_sessions_and_follows_the_weights():
    w = region_weights(0.0, 3, 100.0, 0.8)
    assert abs(sum(w) - 3) < 1e-9 and w[0] == max(w)
    reqs = [TraceRequest(f"r{i}", float(i), 10, 1, hash_ids=(0, i % 50, 7)) for i in range(400)]
    out, region_of = split_regions(reqs, ["x", "y", "z"], period=400.0)
    by_session: dict[str, set[str]] = {}
    for r in out:
        by_session.setdefault(r.session_id or "", set()).add(region_of[r.request_id])
    assert all(len(v) == 1 for v in by_session.values())
    assert len(by_session) == 50
