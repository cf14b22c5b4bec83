"""The Ray adapter of node placement, against a stand-in ``ray.nodes()``. No Ray started."""

from __future__ import annotations

from actors import ray_nodes  # noqa: E402
from placement.nodes import Node  # noqa: E402


def test_alive_nodes_reads_plain_records(monkeypatch):
    table = [
        {
            "NodeID": "b",
            "Alive": True,
            "NodeManagerAddress": "10.0.0.2",
            "Resources": {"CPU": 8.0, "GPU": 2.0, "node:10.0.0.2": 1.0},
            "Labels": {"zone": "x"},
        },
        {"NodeID": "c", "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {}},
        {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2}},
    ]
    monkeypatch.setattr(ray_nodes.ray, "nodes", lambda: table)
    assert ray_nodes.alive_nodes() == [
        Node("a", "10.0.0.1", {"CPU": 2.0}, {}),
        Node("b", "10.0.0.2", {"CPU": 8.0, "GPU": 2.0}, {"zone": "x"}),
    ]


def test_pinned_sets_node_affinity():
    class Remote:
        @staticmethod
        def options(**kwargs):
            return kwargs["scheduling_strategy"]

    node_id = "ab" * 28  # a Ray node id is 56 hex digits
    strategy = ray_nodes.pinned(Remote, node_id, soft=True)
    assert strategy.node_id == node_id and strategy.soft
    assert not ray_nodes.pinned(Remote, node_id).soft
