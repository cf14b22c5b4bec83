"""Which node of the cluster each actor of a deployment runs on: pure, over plain data.

    plan = NodePlacement(nodes)          # the cluster's nodes (``Node``), as plain data
    plan.place([ReplicaSpec("p0", "prefill", worker={"GPU": 1}),
                ReplicaSpec("d0", "decode", worker={"GPU": 1})])
    plan.place_shards(1)                 # ["s0", "s1", ...]: one shard set per node
    plan.node_id("d0"); plan.apart("d0", ["p0"]); plan.tcp_host("d0")
    plan.replace("d0", alive)            # where a replacement goes; moves it if its node is gone
    nodes_carrying(nodes, {"region-us": 0.001})   # only a region's nodes

Rule: replicas go round robin over the nodes that can hold one of them, prefill replicas
first, then decode, then colocated: the k-th on eligible node ``k mod m``, or the next one
with room left if that node is full. On a cluster whose nodes all hold every replica
(CPU-only actors with no reservation, or enough GPUs), prefill replica i is on node i and
decode replica j on node ``num_prefill + j`` (modulo the node count), so with several nodes
prefill and decode run apart and stream KV over TCP. A GPU-less head node holds no GPU
replica. A deployment that does not fit raises ``PlacementError`` saying what to change.

A first start is pinned hard to its node; a replacement is pinned soft (the node may be
gone by the time it starts). On a one-node cluster TCP stays on loopback. Nothing here
imports Ray: ``actors.ray_nodes`` reads the cluster and pins actors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from placement.resources import PlacementError, Resources, describe, fits

Kind = Literal["prefill", "decode", "colocated"]

_KIND_ORDER: dict[str, int] = {"prefill": 0, "decode": 1, "colocated": 2}


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str  # where actors on it serve TCP
    resources: Resources = field(default_factory=dict)  # totals, not what is free now
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str
    kind: Kind
    num_workers: int = 1  # workers that run on the replica's node
    worker: Resources = field(default_factory=dict)  # what each worker reserves

    @property
    def needs(self) -> dict[str, float]:
        return {r: v * self.num_workers for r, v in self.worker.items() if v > 0}


def nodes_carrying(nodes: Sequence[Node], resources: Mapping[str, float]) -> list[Node]:
    """The nodes whose totals hold every one of ``resources`` (a region's node resource:
    the only nodes its actors may run on). Raises ``PlacementError`` naming the resource
    when no node carries it."""
    chosen = [n for n in nodes if fits(n.resources, resources)]
    if not chosen and nodes:
        raise PlacementError(
            f"no live node carries {describe(dict(resources))}; start the region's nodes "
            "with that resource (ray start --resources=...) or drop node_resource"
        )
    return chosen


class NodePlacement:
    def __init__(self, nodes: Sequence[Node]) -> None:
        if not nodes:
            raise PlacementError("the cluster has no live node")
        # Stable order (node id), so every planner over the same cluster agrees.
        self.nodes: list[Node] = sorted(nodes, key=lambda n: n.node_id)
        self._known: dict[str, Node] = {n.node_id: n for n in self.nodes}  # dead ones too
        self._where: dict[str, str] = {}  # key -> node id
        self._needs: dict[str, dict[str, float]] = {}  # key -> what it reserves there

    # -- deciding ---------------------------------------------------------------------------
    def place(self, replicas: Sequence[ReplicaSpec]) -> None:
        """Place ``replicas`` by the rule above (prefill, decode, colocated, each in order)."""
        ordered = sorted(replicas, key=lambda r: _KIND_ORDER[r.kind])
        for k, replica in enumerate(ordered):
            eligible = [n for n in self.nodes if fits(n.resources, replica.needs)]
            if not eligible:
                raise PlacementError(self._too_big(replica))
            start = k % len(eligible)
            for node in eligible[start:] + eligible[:start]:
                if fits(self._free(node), replica.needs):
                    self._put(replica.replica_id, node, replica.needs)
                    break
            else:
                raise PlacementError(self._no_room(ordered))

    def add(self, replica: ReplicaSpec) -> str:
        """Place one more replica (a pool that grows): on the node with room that holds
        the fewest replicas of its kind (ties: node order); returns that node's id."""
        room = [n for n in self.nodes if fits(self._free(n), replica.needs)]
        if not room:
            raise PlacementError(self._no_room([replica]))
        kind = replica.replica_id[:1]
        node = min(
            room,
            key=lambda n: sum(
                1 for k, w in self._where.items() if w == n.node_id and k[:1] == kind
            ),
        )
        self._put(replica.replica_id, node, replica.needs)
        return node.node_id

    def record(self, key: str, node_id: str, needs: Mapping[str, float]) -> None:
        """``key`` runs on ``node_id`` already (an actor found running): follow it."""
        node = self._known.get(node_id) or next(n for n in self.nodes if n.node_id == node_id)
        self._put(key, node, dict(needs))

    def remove(self, key: str) -> None:
        """``key`` left the deployment (a pool that shrinks): its room is free again."""
        self._where.pop(key, None)
        self._needs.pop(key, None)

    def place_shards(self, per_node: int) -> list[str]:
        """KV-store shard ids ``s0, s1, ...``: ``per_node`` on every node, node by node."""
        ids: list[str] = []
        for node in self.nodes:
            for _ in range(per_node):
                sid = f"s{len(ids)}"
                self._put(sid, node, {})
                ids.append(sid)
        return ids

    def replace(self, key: str, alive: Sequence[Node]) -> str:
        """The node a replacement for ``key`` starts on, given the live nodes now: its own
        node while that lives, else the live node that can hold it with the fewest actors
        placed (ties: node order), which ``key`` moves to (``node_id``, ``tcp_host`` and
        ``apart`` follow it). Pin it soft: that node too may be gone before it starts."""
        for node in alive:
            self._known.setdefault(node.node_id, node)
        self.nodes = sorted(alive, key=lambda n: n.node_id)
        if any(n.node_id == self._where[key] for n in self.nodes):
            return self._where[key]
        needs = self._needs[key]
        room = [n for n in self.nodes if fits(self._free(n), needs)]
        if not room:
            raise PlacementError(
                f"no live node has room for a replacement of {key} (needs {describe(needs)}); "
                "add a node or restart the deployment with fewer replicas"
            )
        load = {n.node_id: 0 for n in room}
        for node_id in self._where.values():
            if node_id in load:
                load[node_id] += 1
        best = min(room, key=lambda n: load[n.node_id])  # min keeps the first of ties
        self._put(key, best, needs)
        return best.node_id

    # -- reading ----------------------------------------------------------------------------
    def node_id(self, key: str) -> str:
        return self._where[key]

    def node(self, key: str) -> Node:
        return self._known[self._where[key]]

    def apart(self, key: str, others: Sequence[str]) -> bool:
        """Whether any of ``others`` is on another node than ``key`` (KV then goes over TCP)."""
        return any(self._where[o] != self._where[key] for o in others)

    def tcp_host(self, key: str) -> str:
        """The address ``key`` serves TCP on: its node's, or loopback on a one-node cluster."""
        return self.node(key).address if len(self.nodes) > 1 else "127.0.0.1"

    # -- bookkeeping ------------------------------------------------------------------------
    def _put(self, key: str, node: Node, needs: dict[str, float]) -> None:
        self._where[key] = node.node_id
        self._needs[key] = needs

    def _free(self, node: Node) -> dict[str, float]:
        """``node``'s resources less what the keys placed on it reserve."""
        free = dict(node.resources)
        for key, node_id in self._where.items():
            if node_id == node.node_id:
                for r, v in self._needs[key].items():
                    free[r] = free.get(r, 0.0) - v
        return free

    def _too_big(self, replica: ReplicaSpec) -> str:
        return (
            f"no node can hold {replica.kind} replica {replica.replica_id}: it needs "
            f"{describe(replica.needs)} ({replica.num_workers} workers x "
            f"{describe(replica.worker)}); the nodes hold "
            + ", ".join(describe(n.resources) for n in self.nodes)
            + ": give each replica fewer workers or add larger nodes"
        )

    def _no_room(self, replicas: Sequence[ReplicaSpec]) -> str:
        total: dict[str, float] = {}
        for replica in replicas:
            for r, v in replica.needs.items():
                total[r] = total.get(r, 0.0) + v
        held = {r: sum(n.resources.get(r, 0.0) for n in self.nodes) for r in total}
        return (
            f"the cluster has no room for {len(replicas)} replicas: they need "
            f"{describe(total)} in all, its nodes hold {describe(held)}: run fewer replicas "
            "or add nodes"
        )
