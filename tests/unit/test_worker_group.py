"""Placement groups for a replica's tp x spp x kvp workers: bundles, strategy, the worker ->
bundle mapping, layouts that fit one node, spread over several, or do not fit. No Ray."""

from __future__ import annotations

import pytest

from actors.engine.collectives import Layout
from placement.nodes import Node
from placement.resources import PlacementError
from placement.worker_group import MIN_CPU, plan_worker_group, worker_bundle

GPU = worker_bundle(gpus=1)


def nodes(*gpus: int, cpus: float = 16) -> list[Node]:
    return [Node(f"n{i}", f"10.0.0.{i}", {"CPU": cpus, "GPU": g}) for i, g in enumerate(gpus)]


def test_worker_bundle():
    assert worker_bundle() == {"CPU": MIN_CPU}  # Ray refuses an empty bundle
    assert worker_bundle(cpus=0.5) == {"CPU": 0.5}
    assert worker_bundle(gpus=1) == {"CPU": 0.0, "GPU": 1.0}
    assert worker_bundle(cpus=2, gpus=1) == {"CPU": 2.0, "GPU": 1.0}


@pytest.mark.parametrize("tp,spp,kvp", [(1, 1, 1), (2, 3, 2), (2, 1, 2), (1, 3, 1)])
def test_cpu_only_node_holds_any_small_layout_in_one_group(tp, spp, kvp):
    """What the CPU tests run: workers reserving nothing, all on the one node."""
    plan = plan_worker_group(tp, spp, kvp, worker_bundle(), [Node("n0", "127.0.0.1", {"CPU": 2})])
    assert len(plan.groups) == 1
    (group,) = plan.groups
    assert group.strategy == "STRICT_PACK"
    assert group.bundles == tuple({"CPU": MIN_CPU} for _ in range(tp * spp * kvp))
    assert [plan.slot(*c) for c in Layout(tp, spp, kvp).coords()] == [
        (0, i) for i in range(tp * spp * kvp)
    ]


@pytest.mark.parametrize("tp,spp,kvp", [(1, 1, 1), (2, 2, 2), (3, 2, 1), (1, 1, 4)])
def test_world_rank_agrees_with_the_executor_layout(tp, spp, kvp):
    plan = plan_worker_group(tp, spp, kvp, GPU, nodes(8, 8, 8))
    layout = Layout(tp, spp, kvp)
    for coords in layout.coords():
        assert plan.world_rank(*coords) == layout.world_rank(*coords)


def test_gpu_layout_that_fits_one_node_is_one_group_even_with_more_nodes():
    plan = plan_worker_group(2, 2, 2, GPU, nodes(8, 8))
    assert len(plan.groups) == 1 and len(plan.groups[0].bundles) == 8


def test_layout_larger_than_a_node_spreads_whole_stages_over_nodes():
    """tp=4 x spp=4 on nodes of 8 GPUs: two stages per node, each TP group on one node."""
    plan = plan_worker_group(4, 4, 1, GPU, nodes(8, 8))
    assert [len(g.bundles) for g in plan.groups] == [8, 8]
    assert all(g.strategy == "STRICT_PACK" for g in plan.groups)
    for stage in range(4):
        groups = {plan.slot(t, stage, 0)[0] for t in range(4)}
        assert groups == {stage // 2}  # a TP group never straddles nodes
    assert plan.slot(0, 2, 0) == (1, 0) and plan.slot(3, 3, 0) == (1, 7)


def test_every_bundle_is_used_exactly_once():
    plan = plan_worker_group(2, 3, 2, GPU, nodes(4, 4, 2, 2))
    used = sorted(plan.slot(*c) for c in Layout(2, 3, 2).coords())
    assert used == sorted(
        (g, b) for g, spec in enumerate(plan.groups) for b in range(len(spec.bundles))
    )


def test_largest_node_first_and_partial_tp_groups_never_split():
    """Nodes of 3, 5 and 2 GPUs at tp=2 hold 1, 2 and 1 TP groups (the odd GPUs idle):
    groups are sized largest node first."""
    plan = plan_worker_group(2, 4, 1, GPU, nodes(3, 5, 2))
    assert [len(g.bundles) for g in plan.groups] == [4, 2, 2]


def test_tp_group_larger_than_any_node_is_refused_with_what_to_change():
    with pytest.raises(PlacementError, match=r"tp=8 .*largest node holds 4: lower tp to at most 4"):
        plan_worker_group(8, 1, 1, GPU, nodes(4, 4))


def test_layout_larger_than_the_cluster_is_refused_with_what_to_change():
    with pytest.raises(
        PlacementError, match=r"4 TP groups .* hold 2 such groups: lower spp or kvp"
    ):
        plan_worker_group(4, 2, 2, GPU, nodes(4, 4))


def test_gpu_layout_on_a_cpu_only_cluster_is_refused():
    cpu_only = [Node("n0", "a", {"CPU": 64}), Node("n1", "b", {"CPU": 64})]
    with pytest.raises(PlacementError, match="largest node holds 0"):
        plan_worker_group(1, 1, 1, GPU, cpu_only)


def test_gpu_less_head_node_holds_no_gpu_worker():
    cluster = [Node("head", "a", {"CPU": 8})] + nodes(2)
    plan = plan_worker_group(2, 1, 1, GPU, cluster)
    assert [len(g.bundles) for g in plan.groups] == [2]


def test_cpu_reservations_bound_the_layout():
    """Two CPUs per worker on two 4-CPU nodes: two workers per node."""
    cluster = [Node(f"n{i}", "a", {"CPU": 4}) for i in range(2)]
    plan = plan_worker_group(2, 2, 1, worker_bundle(cpus=2), cluster)
    assert [g.bundles for g in plan.groups] == [({"CPU": 2.0},) * 2] * 2
    with pytest.raises(PlacementError):
        plan_worker_group(1, 5, 1, worker_bundle(cpus=2), cluster)


def test_an_empty_cluster_is_refused():
    with pytest.raises(PlacementError, match="no live node"):
        plan_worker_group(1, 1, 1, GPU, [])


def test_a_region_resource_keeps_the_workers_on_the_nodes_that_carry_it():
    """A region's node resource in the bundle: nodes without it hold no worker, so the plan
    uses only the region's nodes, and refuses when they are too small."""
    pin = {"region-eu": 0.01}
    assert worker_bundle(extra=pin) == {"CPU": MIN_CPU, "region-eu": 0.01}
    assert worker_bundle(cpus=1, extra=pin) == {"CPU": 1.0, "region-eu": 0.01}
    cluster = [
        Node("us0", "10.0.0.1", {"CPU": 64}),  # the largest node, in another region
        Node("eu0", "10.0.0.2", {"CPU": 4, "region-eu": 1}),
        Node("eu1", "10.0.0.3", {"CPU": 4, "region-eu": 1}),
    ]
    plan = plan_worker_group(2, 3, 1, worker_bundle(cpus=1, extra=pin), cluster)
    # 3 TP groups of 2 one-CPU workers: two on one eu node, the third on the other
    assert [len(g.bundles) for g in plan.groups] == [4, 2]
    assert all(b["region-eu"] == 0.01 for g in plan.groups for b in g.bundles)
    unpinned = plan_worker_group(2, 3, 1, worker_bundle(cpus=1), cluster)
    assert [len(g.bundles) for g in unpinned.groups] == [6]  # all on the large us node
    with pytest.raises(PlacementError, match="do not fit"):
        plan_worker_group(2, 5, 1, worker_bundle(cpus=1, extra=pin), cluster)
