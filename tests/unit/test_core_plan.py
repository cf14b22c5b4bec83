"""Disjoint cores by default: a node's cores split into equal runs (``disjoint_cores``),
the Serve app's colocated replicas one run each on a one-node cluster (``core_plan``), and
every case where the engine thread is left to the OS."""

from __future__ import annotations

import pytest

from actors.engine.replica_loop import disjoint_cores
from actors.serving.config import ServeConfig
from actors.serving.core_plan import core_slot, replica_cores


@pytest.mark.parametrize(
    ("count", "cores", "runs"),
    [
        (1, [0, 1], [[0, 1]]),
        (2, [0, 1], [[0], [1]]),
        (2, [3, 1, 2, 0], [[0, 1], [2, 3]]),
        (2, [0, 1, 2], [[0, 1], [2]]),
        (3, list(range(8)), [[0, 1, 2], [3, 4, 5], [6, 7]]),
        (3, [0, 1], []),  # fewer cores than replicas: not split
        (0, [0, 1], []),
    ],
)
def test_disjoint_cores_split_a_node_into_equal_runs(count, cores, runs):
    got = disjoint_cores(count, cores)
    assert got == runs
    flat = [c for run in got for c in run]
    assert len(flat) == len(set(flat))  # disjoint


def test_disjoint_cores_default_to_this_process_affinity():
    runs = disjoint_cores(1)
    if not runs:
        pytest.skip("no affinity API")
    import os

    assert set(runs[0]) == os.sched_getaffinity(0)


def app(*groups: dict) -> ServeConfig:
    return ServeConfig(groups=list(groups))


def test_colocated_replicas_of_an_app_take_one_run_each_in_group_order():
    cfg = app({"name": "a", "num_replicas": 2}, {"name": "b", "num_replicas": 1})
    a, b = cfg.groups
    cores = list(range(6))
    got = [replica_cores(cfg, a, r, 1, cores) for r in range(2)]
    got.append(replica_cores(cfg, b, 0, 1, cores))
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert core_slot(cfg, b, 0) == (2, 3)


def test_the_default_two_replica_group_pins_one_core_each_on_two_cores():
    cfg = app({"name": "main"})  # num_replicas defaults to 2
    (g,) = cfg.groups
    assert g.pin_cores is True
    assert [replica_cores(cfg, g, r, 1, [0, 1]) for r in range(2)] == [[0], [1]]


@pytest.mark.parametrize(
    ("groups", "rank", "nodes", "why"),
    [
        ([{"name": "g", "pin_cores": False}], 0, 1, "turned off"),
        ([{"name": "g", "num_replicas": 1}], 0, 1, "one replica owns the node"),
        ([{"name": "g"}], 0, 2, "several nodes"),
        ([{"name": "g"}], 2, 1, "past the started replicas"),
        ([{"name": "g", "num_replicas": 3}], 0, 1, "fewer cores than replicas"),
        ([{"name": "g", "engine": {"tp": 2}}], 0, 1, "the model runs off the engine thread"),
        ([{"name": "g", "engine": {"cpu_cores": [0]}}], 0, 1, "its own cores"),
        (
            [{"name": "g"}, {"name": "pd", "num_prefill": 1, "num_decode": 1}],
            0,
            1,
            "a P/D cluster splits the node itself",
        ),
    ],
)
def test_the_engine_thread_is_left_to_the_os(groups, rank, nodes, why):
    cfg = app(*groups)
    assert replica_cores(cfg, cfg.groups[0], rank, nodes, [0, 1]) is None, why


def test_pin_cores_reaches_a_disaggregated_groups_cluster():
    from actors.serving.pd_group import pd_cluster_config

    for pin in (True, False):
        cfg = app({"name": "pd", "num_prefill": 1, "num_decode": 1, "pin_cores": pin})
        assert pd_cluster_config(None, cfg.groups[0], "r0").pin_cores is pin


def test_pin_cores_is_a_strict_bool():
    with pytest.raises(ValueError, match="pin_cores"):
        app({"name": "g", "pin_cores": "yes"})


def test_prefill_and_decode_replicas_are_pinned_by_default():
    from actors.disagg.cluster_config import PDClusterConfig

    assert PDClusterConfig().pin_cores is True
    assert PDClusterConfig(pin_cores=False).pin_cores is False
