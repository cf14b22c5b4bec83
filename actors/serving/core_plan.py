"""Which cores a colocated Serve replica's engine thread runs on when its group names none.

On a one-node Ray cluster, the app's colocated replicas split the node's cores into as many
disjoint runs as the config starts colocated replicas (``disjoint_cores``), in group order:
replica ``local_rank`` (Serve's rank of the replica on its node, within its deployment) of
a group takes run ``offset + local_rank``, ``offset`` counting the replicas of the groups
before it. Each pinned engine gets as many torch threads as cores.

Left to the OS (None): a group with ``pin_cores: false`` or ``engine.cpu_cores`` of its own;
a layout whose model does not run on the engine thread (tp, spp or kvp above 1, MoE
workers); an app with a disaggregated group (its P/D clusters split the node themselves);
a cluster of several nodes (where each node's share is not known here); fewer cores than
replicas; a replica past the started count (an autoscaled group's extra replicas).
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.engine.replica_loop import disjoint_cores
from actors.serving.config import ReplicaGroupConfig, ServeConfig


def core_slot(
    cfg: ServeConfig, group: ReplicaGroupConfig, local_rank: int
) -> tuple[int, int] | None:
    """(the run this replica takes, the number of runs), or None when it is not pinned."""
    if any(g.disaggregated for g in cfg.groups) or not group.pin_cores:
        return None
    e = group.engine
    if e.cpu_cores is not None or (e.tp, e.spp, e.kvp) != (1, 1, 1) or e.attention_workers:
        return None
    offset = 0
    for g in cfg.groups:
        if g.name == group.name:
            break
        offset += g.num_replicas
    if local_rank >= group.num_replicas or cfg.num_replicas < 2:
        return None  # one replica: the whole node is its own (pinning it gains nothing)
    return offset + local_rank, cfg.num_replicas


def replica_cores(
    cfg: ServeConfig,
    group: ReplicaGroupConfig,
    local_rank: int,
    num_nodes: int,
    cores: Sequence[int] | None = None,
) -> list[int] | None:
    """This replica's engine cores (``cores``: the node's, default this process's
    affinity), or None to leave the engine thread to the OS."""
    slot = core_slot(cfg, group, local_rank)
    if slot is None or num_nodes != 1:
        return None
    runs = disjoint_cores(slot[1], cores)
    return runs[slot[0]] if runs else None
