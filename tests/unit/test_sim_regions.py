"""The multi-region simulator: every request placed once, forwarding takes one hop and its
delay shows in TTFT, and the global balancer pays the delay to its region."""

from dataclasses import replace

import pytest

from policies.region_balancer import BalancerConfig
from policies.routing import RoundRobin
from sim.closed_loop import ClientLoad, ClosedLoopClients, conversations
from sim.cluster import InstanceSpec
from sim.presets import ClusterConfig, make_cost
from sim.regional_workload import region_weights, split_regions
from sim.regions import MultiRegionCluster
from sim.skywalker_eval import RegionRun, replica_split
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


def conversation_trace() -> list[TraceRequest]:
    """12 conversations of 1-3 turns; a turn's hash ids extend its predecessor's."""
    out = []
    for c in range(12):
        for t in range(1 + c % 3):
            ids = (0, 100 + c, *range(1000 * c, 1000 * c + t + 1))
            out.append(TraceRequest(f"r{c}.{t}", float(c), 512 * len(ids), 8, hash_ids=ids))
    return out


def test_conversations_group_turns_in_trace_order():
    convs = conversations(conversation_trace())
    assert len(convs) == 12
    assert [len(c) for c in convs[:3]] == [1, 2, 3]
    assert [r.request_id for r in convs[2]] == ["r2.0", "r2.1", "r2.2"]


def test_closed_loop_turn_follows_answer_and_nothing_after_duration():
    convs = conversations(conversation_trace())
    load = ClientLoad(clients=2, duration=60.0, period=60.0, amplitude=0.5, think=0.5)
    clients = ClosedLoopClients(convs, ["a", "b"], load)
    first = clients.initial()
    # at t = 0 region a is at its peak (weight 1.5: 3 clients), b at its trough (1 client)
    at_zero = [r for r in first if r.arrival < 1.0]
    assert sorted(clients.region_of[r.request_id] for r in at_zero) == ["a"] * 3 + ["b"]
    c = MultiRegionCluster(
        {"a": 1, "b": 1},
        spec(),
        DELAY,
        clients.region_of,
        balancer=BalancerConfig(),
        follow=clients.answered,
    )
    stats = {s.request_id: s for s in c.run(first)}
    assert all(s.done for s in stats.values())
    assert len(stats) == clients.issued
    assert all(s.arrival <= load.duration for s in stats.values())
    # each conversation: its turns in order, each sent think seconds after the previous
    # answer reached the client, and all from one region
    by_conv: dict[str, list[str]] = {}
    for rid in stats:
        by_conv.setdefault(rid.split(".")[0], []).append(rid)
    assert len(by_conv) == len(convs)  # the load ran every conversation within the hour
    for rids in by_conv.values():
        rids.sort(key=lambda r: int(r.split(".")[1]))
        assert len({clients.region_of[r] for r in rids}) == 1
        for prev, nxt in zip(rids, rids[1:], strict=False):
            assert stats[nxt].arrival == pytest.approx(stats[prev].finish + load.think)
    # later turns find their predecessor's blocks cached
    assert sum(s.cached_tokens for s in stats.values()) > 0
    assert len(c.loop) == 0


def test_replica_split_spreads_a_total_over_the_regions():
    run = RegionRun("SkyWalker", "conversation", None, 1.0, 4)
    assert replica_split(run) == {"us": 4, "eu": 4, "asia": 4}
    assert replica_split(replace(run, replicas_total=11)) == {"us": 4, "eu": 4, "asia": 3}
    with pytest.raises(ValueError, match="at least 3"):
        replica_split(replace(run, replicas_total=2))
