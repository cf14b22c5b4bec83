"""Which node of the Ray cluster each actor of a deployment runs on.

    nodes = NodePlacement()                 # the cluster's live nodes, in a stable order
    nodes.assign("p0", 0); nodes.assign("d0", 1)   # index modulo the node count
    nodes.options(actor_cls, "d0").remote(...)     # pinned to its node
    nodes.tcp_host("d0")                    # where it serves TCP: the node's address

A first start is pinned hard; a replacement (``restart=True``) may go elsewhere when its
node is gone. On a one-node cluster TCP stays on loopback.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def alive_nodes() -> list[tuple[str, str]]:
    """(node id, address) of the Ray cluster's live nodes, in a stable order."""
    return sorted((n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"])


class NodePlacement:
    def __init__(self, nodes: list[tuple[str, str]] | None = None) -> None:
        self.nodes = nodes if nodes is not None else alive_nodes()
        if not self.nodes:
            raise RuntimeError("the Ray cluster has no live node")
        self._index: dict[str, int] = {}

    def assign(self, key: str, index: int) -> None:
        self._index[key] = index % len(self.nodes)

    def node_id(self, key: str) -> str:
        return self.nodes[self._index[key]][0]

    def apart(self, key: str, others: list[str]) -> bool:
        """Whether any of ``others`` is on another node than ``key``."""
        return any(self._index[o] != self._index[key] for o in others)

    def options(self, cls: Any, key: str, restart: bool = False) -> Any:
        strategy = NodeAffinitySchedulingStrategy(self.node_id(key), soft=restart)
        return cls.options(scheduling_strategy=strategy)

    def tcp_host(self, key: str) -> str:
        return self.nodes[self._index[key]][1] if len(self.nodes) > 1 else "127.0.0.1"
