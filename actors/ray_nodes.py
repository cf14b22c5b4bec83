"""The Ray side of node placement: read the cluster's nodes as plain data, pin an actor.

``placement.nodes`` decides where things go from ``Node`` records; this module is the only
place that turns ``ray.nodes()`` into them and a decision into a scheduling strategy.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from placement.nodes import Node


def alive_nodes() -> list[Node]:
    """The Ray cluster's live nodes, by node id: address, total resources, labels."""
    return sorted(
        (
            Node(
                node_id=n["NodeID"],
                address=n["NodeManagerAddress"],
                resources={
                    r: float(v)
                    for r, v in (n.get("Resources") or {}).items()
                    if not r.startswith("node:")  # Ray's per-node marker resources
                },
                labels=dict(n.get("Labels") or {}),
            )
            for n in ray.nodes()
            if n["Alive"]
        ),
        key=lambda node: node.node_id,
    )


def pinned(cls: Any, node_id: str, soft: bool = False, **options: Any) -> Any:
    """``cls`` (a remote class) with its actors pinned to ``node_id``; ``soft`` lets Ray
    start one elsewhere when that node is gone (for replacements). ``options``: Ray's other
    actor options (a ``name``, ...)."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=soft)
    return cls.options(scheduling_strategy=strategy, **options)
