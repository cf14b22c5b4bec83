"""Warm standby replicas: which of a group's live replicas take requests.

A group with ``standby_replicas`` runs that many more replicas than its ``num_replicas``.
The first ``num_replicas`` to join are active; later ones wait, loaded and warm, as
standby. When an active replica leaves (it died, or Serve stopped it), the standby that
joined first becomes active at once, so the group serves at full strength again without
waiting for a process to start and a model to load; the replacement Serve starts joins as
the new standby.

Invariants: per group, ``len(active) <= wanted`` (a group without a wanted count keeps every
replica active); a replica is in at most one list; each list is in join order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StandbyPool:
    wanted: dict[str, int]  # group -> active replicas it wants; groups absent: all active
    active: dict[str, list[str]] = field(default_factory=dict)  # group -> ids, join order
    standby: dict[str, list[str]] = field(default_factory=dict)  # group -> ids, join order

    def join(self, replica_id: str, group: str) -> bool:
        """A new replica of ``group``: True when it is active, False when it waits."""
        active = self.active.setdefault(group, [])
        want = self.wanted.get(group)
        if want is None or len(active) < want:
            active.append(replica_id)
            return True
        self.standby.setdefault(group, []).append(replica_id)
        return False

    def leave(self, replica_id: str) -> str | None:
        """``replica_id`` is gone; returns the standby promoted in its place (None: it was a
        standby, unknown, or its group has no standby left)."""
        for ids in self.standby.values():
            if replica_id in ids:
                ids.remove(replica_id)
                return None
        for group, ids in self.active.items():
            if replica_id in ids:
                ids.remove(replica_id)
                waiting = self.standby.get(group, [])
                if waiting and len(ids) < self.wanted.get(group, len(ids) + 1):
                    promoted = waiting.pop(0)
                    ids.append(promoted)
                    return promoted
                return None
        return None

    def has_spare(self, group: str) -> bool:
        return bool(self.standby.get(group))

    def is_standby(self, replica_id: str) -> bool:
        return any(replica_id in ids for ids in self.standby.values())

    def standby_ids(self) -> list[str]:
        return [rid for ids in self.standby.values() for rid in ids]
