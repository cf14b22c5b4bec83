"""The Conductor's fault handling for ``PDCluster``: what happens when a replica, a stream
or a store shard fails, and how the requests it held run again.

- A dead prefill replica: its requests' decode reservations are cancelled, it is replaced
  by a fresh actor, and its requests are placed again from their prompt.
- A dead decode replica: its requests still in prefill are stopped there, it is replaced,
  and every request bound to it runs again from its prompt (seeded sampling draws the
  same tokens; tokens already streamed are never streamed twice, ``PDRequest``).
- A broken KV stream (``PrefillFailed``) or a reservation the decode side already freed
  (``ReservationLost``): the other side lets go and the request runs again.
- A dead store shard drops out of the map (its blocks are recomputed) and ``refresh_store``
  replaces it with an empty one that every replica is told of.

A request runs again at most ``max_prefill_attempts`` times in all, then ends without
text. Invariant: a request waiting to run again holds nothing on any replica and has no
live attempt key (``RequestTable.attempt`` does not name it). ``Recovery`` reads and
changes the cluster's requests only through its ``RequestTable`` and its replicas only
through its ``ReplicaSet``; placing a request again is the cluster's (``retry_later``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from actors.disagg.messages import PrefillFailed, ReservationLost
from actors.disagg.pd_request import PDRequest
from actors.disagg.read_paths import ReadPaths
from actors.disagg.replica_set import ReplicaSet, call_replica
from actors.disagg.request_table import RequestTable
from actors.disagg.store_view import DEAD, PDStore


class Recovery:
    """Fault handling of one ``PDCluster``'s requests and replicas."""

    def __init__(
        self,
        table: RequestTable,
        replicas: ReplicaSet,
        read_paths: ReadPaths,
        store: PDStore | None,
        max_prefill_attempts: int,
    ) -> None:
        self.table, self.replicas, self.read_paths = table, replicas, read_paths
        self.store = store
        self.max_prefill_attempts = max_prefill_attempts
        self.num_prefill_restarts = 0
        self.num_decode_restarts = 0

    # -- events the replicas report ----------------------------------------------------------
    def prefill_failed(self, e: PrefillFailed) -> None:
        """Its stream broke: the decode side is gone (its poll fails too and places its
        requests again) or unreachable (free its side, run the request again)."""
        self.read_paths.done(e.key)
        req = self.table.attempt(e.key)
        if req is None or req.decode_id is None:
            return
        req.in_prefill = False
        if call_replica(self.replicas.decodes[req.decode_id].cancel, e.key):
            self.requeue(req)

    def reservation_lost(self, e: ReservationLost) -> None:
        """The decode side already freed it: stop the prefill, run the request again."""
        req = self.table.attempt(e.key)
        if req is None:
            return
        if req.in_prefill and req.prefill_id is not None:
            call_replica(self.replicas.prefills[req.prefill_id].abort, e.key)
        self.requeue(req)

    # -- running a request again ----------------------------------------------------------------
    def requeue(self, req: PDRequest) -> None:
        """Queue a request to be placed again from its prompt (ended without text after
        ``max_prefill_attempts``)."""
        if req.key is not None:
            self.table.unbind(req.key)
        req.drop_attempt()
        if req.attempts >= self.max_prefill_attempts:
            req.end(text=False)
        else:
            self.table.retry_later(req)

    # -- dead replicas ------------------------------------------------------------------------
    def replica_died(self, rid: str, handle: Any) -> None:
        r = self.replicas
        if rid in r.prefills and r.prefills[rid] is handle:
            self.prefill_died(rid)
        elif rid in r.decodes and r.decodes[rid] is handle:
            self.decode_died(rid)

    def decode_died(self, did: str) -> None:
        """Replace the replica; every request bound to it runs again from its prompt (those
        still in prefill are stopped there first)."""
        r = self.replicas
        lost = self.table.bound_to_decode(did)
        for req in lost:
            if req.in_prefill and req.prefill_id is not None and req.key is not None:
                call_replica(r.prefills[req.prefill_id].abort, req.key)
        r.forget(r.decodes[did])
        self.num_decode_restarts += 1
        r.start(did)
        for req in lost:
            self.requeue(req)

    def prefill_died(self, pid: str) -> None:
        """Cancel the decode reservations of its requests, replace it, place them again."""
        r = self.replicas
        lost = self.table.in_prefill_on(pid)
        for req in lost:
            assert req.decode_id is not None and req.key is not None
            call_replica(r.decodes[req.decode_id].cancel, req.key)
        r.forget(r.prefills[pid])
        self.num_prefill_restarts += 1
        r.start(pid)
        for req in lost:
            self.requeue(req)

    # -- store shards ---------------------------------------------------------------------------
    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; returns shards found dead, each
        replaced at once by an empty shard under its id that every replica is told of (the
        dead one's blocks are recomputed by whoever needs them)."""
        store = self.store
        if store is None:
            return []
        store.refresh()
        dead = [sid for sid in store.shards if sid not in store.live()]
        for sid in dead:  # found dead now, or earlier by a failed read or write
            handle = store.restart(sid)
            for replica in self.replicas.all_handles():
                with contextlib.suppress(*DEAD):  # a dead one is replaced with the live set
                    ray.get(replica.add_shard.remote(sid, handle))
        return dead
