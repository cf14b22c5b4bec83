"""Placement groups for one replica's ``tp x spp x kvp`` workers: pure, over plain data.

    plan = plan_worker_group(tp=2, spp=2, kvp=1, bundle=worker_bundle(cpus=1, gpus=1),
                             nodes=nodes)
    for group in plan.groups:            # create in this order, each ready before the next
        placement_group(list(group.bundles), strategy=group.strategy)
    plan.slot(tp_rank, stage, kvp_rank)  # (group index, bundle index) of that worker

Workers are numbered as ``actors.engine.collectives.Layout`` numbers them, world rank
``(kvp_rank * spp + stage) * tp + tp_rank``, so a TP group (one stage of one KVP rank) is
``tp`` consecutive ranks, and one TP group after another runs the stages of KVP rank 0,
then those of KVP rank 1, and so on.

Strategy. A TP group all-reduces every layer, so it always shares one node. Whole TP groups
fill nodes in world-rank order, the largest node first, and every node used gets its own
``STRICT_PACK`` placement group: a layout that fits one node is one placement group on one
node (the usual case, and the only one on a one-node cluster); a larger one spreads whole
pipeline stages (then KVP ranks) over nodes, so only stage-to-stage activations and the
KVP all-gather cross nodes. A TP group no node can hold, or a layout the cluster's nodes
cannot hold in all, raises ``PlacementError`` saying what to change. Fit is checked
against the nodes' total resources; what other actors hold now only delays the
placement groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from placement.nodes import Node
from placement.resources import PlacementError, Resources, capacity, describe

# Ray refuses an empty bundle: a worker that reserves nothing takes this sliver of a CPU.
MIN_CPU = 0.001


def worker_bundle(
    cpus: float = 0.0, gpus: int = 0, extra: dict[str, float] | None = None
) -> dict[str, float]:
    """What one worker reserves: ``cpus`` CPUs (``MIN_CPU`` if it reserves no CPU or GPU),
    ``gpus`` GPUs, and ``extra`` custom resources (a region's node resource: only nodes
    carrying it can hold the worker, so the plan and Ray put it on those)."""
    bundle = {"CPU": float(cpus)} | ({"GPU": float(gpus)} if gpus else {})
    if not any(bundle.values()):
        bundle = {"CPU": MIN_CPU}
    return bundle | {k: float(v) for k, v in (extra or {}).items()}


@dataclass(frozen=True)
class GroupSpec:
    """One placement group: its bundles (one per worker) and Ray strategy."""

    bundles: tuple[dict[str, float], ...]
    strategy: str = "STRICT_PACK"


@dataclass(frozen=True)
class WorkerGroupPlan:
    tp: int
    spp: int
    kvp: int
    groups: tuple[GroupSpec, ...]
    slots: tuple[tuple[int, int], ...]  # by world rank: (group index, bundle index)

    def world_rank(self, tp_rank: int, stage: int, kvp_rank: int) -> int:
        return (kvp_rank * self.spp + stage) * self.tp + tp_rank

    def slot(self, tp_rank: int, stage: int, kvp_rank: int) -> tuple[int, int]:
        """(group index, bundle index) of the worker at these coordinates."""
        return self.slots[self.world_rank(tp_rank, stage, kvp_rank)]


def plan_worker_group(
    tp: int, spp: int, kvp: int, bundle: Resources, nodes: Sequence[Node]
) -> WorkerGroupPlan:
    """The placement groups for a ``tp x spp x kvp`` layout of workers that each reserve
    ``bundle``, on a cluster of ``nodes`` (see the module's docstring for the rule)."""
    layout = f"layout tp={tp} spp={spp} kvp={kvp}"
    if not nodes:
        raise PlacementError(f"{layout}: the cluster has no live node")
    # TP groups each node holds, largest first; the sort is stable, so ties keep node order.
    per_node = sorted((capacity(n.resources, bundle) // tp for n in nodes), reverse=True)
    need = spp * kvp  # TP groups in the layout
    if per_node[0] == 0:
        largest = max(capacity(n.resources, bundle) for n in nodes)
        raise PlacementError(
            f"{layout}: a TP group needs {tp} workers x {describe(bundle)} on one node, "
            f"the largest node holds {largest}: lower tp to at most {largest} (raise spp "
            "or kvp to keep the worker count) or add larger nodes"
        )
    if sum(per_node) < need:
        raise PlacementError(
            f"{layout}: {need} TP groups of {tp} workers x {describe(bundle)} do not fit "
            f"the cluster's {len(nodes)} nodes, which hold {sum(per_node)} such groups: "
            "lower spp or kvp, or add nodes"
        )
    groups: list[GroupSpec] = []
    slots: list[tuple[int, int]] = []
    placed = 0
    for held in per_node:
        take = min(held, need - placed)
        if take == 0:
            break
        size = take * tp
        groups.append(GroupSpec(tuple(dict(bundle) for _ in range(size))))
        slots.extend((len(groups) - 1, b) for b in range(size))
        placed += take
    return WorkerGroupPlan(tp, spp, kvp, tuple(groups), tuple(slots))
