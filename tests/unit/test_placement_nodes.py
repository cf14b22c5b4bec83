"""Node placement over plain node records: the round-robin rule, GPU vs CPU-only clusters,
KV-store shards, TCP addresses, replacements after a node is gone. No Ray."""

from __future__ import annotations

import pytest

from placement.nodes import Node, NodePlacement, ReplicaSpec, nodes_carrying
from placement.resources import PlacementError

GPU = {"GPU": 1}


def nodes(n: int, **resources: float) -> list[Node]:
    return [Node(f"n{i}", f"10.0.0.{i}", dict(resources)) for i in range(n)]


def pd(num_prefill: int, num_decode: int, worker: dict | None = None) -> list[ReplicaSpec]:
    return [ReplicaSpec(f"p{i}", "prefill", worker=worker or {}) for i in range(num_prefill)] + [
        ReplicaSpec(f"d{j}", "decode", worker=worker or {}) for j in range(num_decode)
    ]


@pytest.mark.parametrize("num_nodes", [1, 2, 3, 5])
def test_cpu_cluster_keeps_todays_rule(num_nodes):
    """Prefill i on node i, decode j on node num_prefill + j, modulo the node count."""
    plan = NodePlacement(nodes(num_nodes, CPU=2))
    plan.place(pd(2, 3))
    for i in range(2):
        assert plan.node_id(f"p{i}") == f"n{i % num_nodes}"
    for j in range(3):
        assert plan.node_id(f"d{j}") == f"n{(2 + j) % num_nodes}"


def test_kinds_are_ordered_prefill_decode_colocated_whatever_the_input_order():
    plan = NodePlacement(nodes(3))
    plan.place([ReplicaSpec("c0", "colocated"), ReplicaSpec("d0", "decode"), *pd(1, 0)])
    assert [plan.node_id(r) for r in ("p0", "d0", "c0")] == ["n0", "n1", "n2"]


def test_nodes_are_taken_in_node_id_order():
    plan = NodePlacement(list(reversed(nodes(2))))
    plan.place(pd(1, 1))
    assert [n.node_id for n in plan.nodes] == ["n0", "n1"]
    assert plan.node_id("p0") == "n0"


def test_apart_and_tcp_host_on_several_nodes():
    plan = NodePlacement(nodes(2))
    plan.place(pd(1, 2))
    assert plan.apart("d0", ["p0"])  # decode 0 on n1, prefill on n0: KV over TCP
    assert not plan.apart("d1", ["p0"])  # decode 1 wraps around to n0
    assert plan.tcp_host("d0") == "10.0.0.1" and plan.tcp_host("p0") == "10.0.0.0"


def test_one_node_cluster_serves_tcp_on_loopback_and_nothing_is_apart():
    plan = NodePlacement(nodes(1, CPU=2))
    plan.place(pd(2, 2))
    assert not plan.apart("d0", ["p0", "p1"])
    assert plan.tcp_host("d1") == "127.0.0.1"


def test_gpu_replicas_skip_a_gpu_less_head_node():
    cluster = [Node("head", "10.0.0.9", {"CPU": 8})] + nodes(2, CPU=8, GPU=2)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1, GPU))
    assert plan.node_id("p0") == "n0" and plan.node_id("d0") == "n1"
    assert plan.place_shards(1) == ["s0", "s1", "s2"]  # store shards go on every node
    assert plan.node_id("s0") == "head"


def test_a_full_gpu_node_passes_the_replica_to_the_next():
    """Two one-GPU nodes and a node with four GPUs: the fourth replica's turn is n0 again,
    which is full, so it goes on the next node with a free GPU."""
    cluster = [
        Node("n0", "a", {"GPU": 1}),
        Node("n1", "b", {"GPU": 1}),
        Node("n2", "c", {"GPU": 4}),
    ]
    plan = NodePlacement(cluster)
    plan.place(pd(2, 2, GPU))
    assert [plan.node_id(r) for r in ("p0", "p1", "d0", "d1")] == ["n0", "n1", "n2", "n2"]


def test_replica_workers_count_against_the_node():
    plan = NodePlacement(nodes(2, GPU=4))
    plan.place([ReplicaSpec("c0", "colocated", num_workers=4, worker=GPU)])
    assert plan.node_id("c0") == "n0"
    with pytest.raises(PlacementError, match="no node can hold colocated replica c1"):
        NodePlacement(nodes(2, GPU=4)).place(
            [ReplicaSpec("c1", "colocated", num_workers=8, worker=GPU)]
        )


def test_more_gpu_replicas_than_gpus_is_refused_with_what_to_change():
    plan = NodePlacement(nodes(2, CPU=4, GPU=1))
    with pytest.raises(PlacementError, match=r"need \{GPU: 3\} in all.*\{GPU: 2\}.*fewer"):
        plan.place(pd(2, 1, GPU))


def test_gpu_replicas_on_a_cpu_only_cluster_are_refused():
    with pytest.raises(PlacementError, match="no node can hold prefill replica p0"):
        NodePlacement(nodes(2, CPU=4)).place(pd(1, 1, GPU))


def test_an_empty_cluster_is_refused():
    with pytest.raises(PlacementError, match="no live node"):
        NodePlacement([])


@pytest.mark.parametrize("num_nodes", [1, 2, 3])
def test_one_shard_set_per_node(num_nodes):
    plan = NodePlacement(nodes(num_nodes))
    ids = plan.place_shards(2)
    assert ids == [f"s{i}" for i in range(2 * num_nodes)]
    assert [plan.node_id(s) for s in ids] == [f"n{i // 2}" for i in range(2 * num_nodes)]
    assert plan.tcp_host("s0") == ("127.0.0.1" if num_nodes == 1 else "10.0.0.0")


def test_replacement_stays_on_its_node_while_it_lives():
    cluster = nodes(3)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1))
    assert plan.replace("d0", cluster) == "n1"
    assert plan.node_id("d0") == "n1"


def test_replacement_moves_off_a_dead_node_to_the_least_loaded_and_addresses_follow():
    cluster = nodes(3)
    plan = NodePlacement(cluster)
    plan.place(pd(2, 1))  # p0 n0, p1 n1, d0 n2
    plan.place_shards(1)  # one shard on every node
    alive = [cluster[0], cluster[1]]  # n2 is gone
    assert plan.replace("d0", alive) == "n0"  # n0 and n1 tie: the first
    assert plan.node_id("d0") == "n0" and plan.tcp_host("d0") == "10.0.0.0"
    assert not plan.apart("d0", ["p0"]) and plan.apart("d0", ["p1"])


def test_replacement_on_the_last_live_node_serves_on_loopback():
    cluster = nodes(2)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1))
    assert plan.replace("d0", [cluster[0]]) == "n0"
    assert plan.tcp_host("d0") == "127.0.0.1" and not plan.apart("d0", ["p0"])


def test_gpu_replacement_goes_where_a_gpu_is_free():
    cluster = nodes(3, GPU=1)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1, GPU))  # p0 n0, d0 n1; n2's GPU is free
    assert plan.replace("d0", [cluster[0], cluster[2]]) == "n2"


def test_gpu_replacement_with_no_free_gpu_left_is_refused():
    cluster = nodes(2, GPU=1)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1, GPU))
    with pytest.raises(PlacementError, match="no live node has room for a replacement of d0"):
        plan.replace("d0", [cluster[0]])


def test_a_replacement_may_land_on_a_node_that_joined_since():
    cluster = nodes(2)
    plan = NodePlacement(cluster)
    plan.place(pd(1, 1))
    fresh = Node("n9", "10.0.0.99", {})
    assert plan.replace("d0", [cluster[0], fresh]) == "n9"  # n0 holds p0 already
    assert plan.tcp_host("d0") == "10.0.0.99" and plan.node("d0") == fresh


def test_a_regions_actors_use_only_the_nodes_carrying_its_resource():
    nodes = [
        Node("n0", "10.0.0.1", {"CPU": 8}),
        Node("n1", "10.0.0.2", {"CPU": 8, "region-us": 100}),
        Node("n2", "10.0.0.3", {"CPU": 8, "region-eu": 100}),
        Node("n3", "10.0.0.4", {"CPU": 8, "region-us": 100}),
    ]
    us = nodes_carrying(nodes, {"region-us": 0.001})
    assert [n.node_id for n in us] == ["n1", "n3"]
    assert nodes_carrying(nodes, {}) == nodes  # unpinned: every node
    plan = NodePlacement(us)
    plan.place([ReplicaSpec("p0", "prefill"), ReplicaSpec("d0", "decode")])
    assert {plan.node_id("p0"), plan.node_id("d0")} == {"n1", "n3"}
    with pytest.raises(PlacementError, match="region-asia"):
        nodes_carrying(nodes, {"region-asia": 0.001})
