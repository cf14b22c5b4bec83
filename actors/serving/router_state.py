"""The global router's state: a ``ClusterView`` of the replicas and one routing policy.

A plain class (no Ray needed to build or use it) that a router deployment, the Python API or
a test wraps. It holds no lock: the caller serializes calls (one event loop), and every call
is short (a decision is tens of microseconds with 16 replicas), so calling it inline does
not block that loop.

The clock is injected and must be the clock of the replicas' stats ``time`` field (wall
clock by default, as replicas stamp snapshots with ``time.time()``), so a stale snapshot can
be told apart from a decision made after it (see ``ClusterView.update_stats``).

Membership changes only through ``add_replica`` / ``remove_replica``: events or stats from
a replica the state does not know are dropped, so a late message from a removed replica
cannot bring it back into the ranking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from policies.cluster_view import ClusterView
from policies.replica_stats import ReplicaStats
from policies.routing import (
    RouteRequest,
    make_routing_policy,
    routing_name,
)


class RouterState:
    def __init__(
        self,
        policy: str = "prefix_aware",
        block_size: int = 16,
        *,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        pending_ttl: float = 5.0,
        **policy_options: Any,
    ) -> None:
        """``policy``: a name of ``policies.routing.ROUTING_POLICIES``; ``block_size``:
        tokens per block, the replicas' (their block hashes and events use it);
        ``policy_options`` go to the policy's constructor (e.g. ``max_imbalance=2048`` for
        ``prefix_aware``)."""
        self.policy_name = routing_name(policy)
        self.policy = make_routing_policy(policy, seed, **policy_options)
        self.view = ClusterView(block_size, pending_ttl=pending_ttl)
        self.clock = clock

    @property
    def block_size(self) -> int:
        return self.view.block_size

    # -- membership ------------------------------------------------------------------------
    def add_replica(self, replica_id: str, total_blocks: int = 1, region: str = "default") -> None:
        """Start routing to ``replica_id`` (a no-op if it is known)."""
        self.view.add_replica(replica_id, total_blocks=total_blocks, region=region)

    def remove_replica(self, replica_id: str) -> None:
        """Stop routing to ``replica_id`` and forget its cache (a no-op if unknown)."""
        self.view.remove_replica(replica_id)

    @property
    def replica_ids(self) -> list[str]:
        return [v.replica_id for v in self.view.replicas]

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self.view

    def __len__(self) -> int:
        return len(self.view)

    # -- inputs from replicas --------------------------------------------------------------
    def on_events(self, replica_id: str, events: Iterable[tuple[str, int]]) -> None:
        """Apply the replica's ``("stored" | "evicted", block hash)`` events in order.
        An unknown event kind raises ``ValueError``."""
        if replica_id in self.view:
            self.view.apply_events(replica_id, events)

    def on_stats(self, replica_id: str, stats: ReplicaStats) -> None:
        """Apply a stats snapshot (its ``time``: when it was taken, on this state's clock)."""
        if replica_id in self.view:
            self.view.update_stats(replica_id, stats, self.clock())

    def resync(self, replica_id: str, hashes: Iterable[int]) -> None:
        """Replace the replica's cached hashes wholesale (after lost events or a restart)."""
        if replica_id in self.view:
            self.view.reset_cached(replica_id, hashes)

    # -- decisions -------------------------------------------------------------------------
    def route(self, request: RouteRequest) -> list[str]:
        """Every known replica id, best first (empty without replicas). The first choice is
        recorded at once: its queue grows and it is taken to hold the request's blocks."""
        if len(self.view) == 0:
            return []
        return self.view.route(self.policy, request, self.clock())

    def moved(self, request: RouteRequest, routed_to: str, runs_on: str | None) -> None:
        """``request`` (routed to ``routed_to``, its ranking's first) runs on ``runs_on``, or
        nowhere (None: refused, or its start failed): the view moves its record of the
        decision there, or drops it (``ClusterView.on_moved``)."""
        if routed_to != runs_on:
            self.view.on_moved(request, routed_to, runs_on, self.clock())
