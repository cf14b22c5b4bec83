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
live attempt key (``_by_key`` does not name it).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import ray

from actors.disagg.conductor import RequestRejected
from actors.disagg.messages import PrefillFailed, ReservationLost
from actors.disagg.pd_request import PDRequest
from actors.disagg.store_view import DEAD

if TYPE_CHECKING:
    from actors.disagg.cluster import PDCluster


def call_replica(method: Any, *args: Any) -> bool:
    """Call a replica's actor method and wait for it; False when the replica is gone (its
    death is handled when its long poll fails)."""
    try:
        ray.get(method.remote(*args))
    except DEAD:
        return False
    return True


class Recovery:
    """Fault handling of one ``PDCluster`` (it owns the replicas and the requests)."""

    def __init__(self, cluster: PDCluster) -> None:
        self.cluster = cluster

    # -- events the replicas report ----------------------------------------------------------
    def prefill_failed(self, e: PrefillFailed) -> None:
        """Its stream broke: the decode side is gone (its poll fails too and places its
        requests again) or unreachable (free its side, run the request again)."""
        c = self.cluster
        c.read_paths.done(e.key)
        req = c._by_key.get(e.key)
        if req is None or req.decode_id is None:
            return
        req.in_prefill = False
        if call_replica(c.decodes[req.decode_id].cancel, e.key):
            self.requeue(req)

    def reservation_lost(self, e: ReservationLost) -> None:
        """The decode side already freed it: stop the prefill, run the request again."""
        c = self.cluster
        req = c._by_key.get(e.key)
        if req is None:
            return
        if req.in_prefill and req.prefill_id is not None:
            call_replica(c.prefills[req.prefill_id].abort, e.key)
        self.requeue(req)

    # -- running a request again ----------------------------------------------------------------
    def requeue(self, req: PDRequest) -> None:
        """Place a request again from its prompt (aborted after ``max_prefill_attempts``)."""
        c = self.cluster
        if req.key is not None:
            c._by_key.pop(req.key, None)
        req.drop_attempt()
        if req.attempts >= c.max_prefill_attempts:
            req.end(text=False)
        else:
            c._retry.append(req.request_id)

    def retry_pending(self) -> None:
        """Place the requests waiting to run again, in order; one turned away waits on."""
        c = self.cluster
        for _ in range(len(c._retry)):
            rid = c._retry.popleft()
            req = c._reqs.get(rid)
            if req is None or req.output is not None:
                continue
            try:
                c.placing.place(req)
            except RequestRejected:
                c._retry.append(rid)

    # -- dead replicas ------------------------------------------------------------------------
    def replica_died(self, rid: str, handle: Any) -> None:
        c = self.cluster
        if rid in c.prefills and c.prefills[rid] is handle:
            self.prefill_died(rid)
        elif rid in c.decodes and c.decodes[rid] is handle:
            self.decode_died(rid)

    def decode_died(self, did: str) -> None:
        """Replace the replica; every request bound to it runs again from its prompt (those
        still in prefill are stopped there first)."""
        c = self.cluster
        lost = [r for r in c._reqs.values() if r.decode_id == did and r.output is None]
        for req in lost:
            if req.in_prefill and req.prefill_id is not None and req.key is not None:
                call_replica(c.prefills[req.prefill_id].abort, req.key)
        self.forget(c.decodes[did])
        c.num_decode_restarts += 1
        c._start_decode(did)
        for req in lost:
            self.requeue(req)

    def prefill_died(self, pid: str) -> None:
        """Cancel the decode reservations of its requests, replace it, place them again."""
        c = self.cluster
        lost = [r for r in c._reqs.values() if r.prefill_id == pid and r.in_prefill]
        for req in lost:
            assert req.decode_id is not None and req.key is not None
            call_replica(c.decodes[req.decode_id].cancel, req.key)
        self.forget(c.prefills[pid])
        c.num_prefill_restarts += 1
        c._start_prefill(pid)
        for req in lost:
            self.requeue(req)

    def forget(self, handle: Any) -> None:
        """Stop watching a replica and kill its actor (if it still runs)."""
        c = self.cluster
        for ref in [r for r, (_, h) in c._polls.items() if h is handle]:
            del c._polls[ref]
        try:
            ray.kill(handle)
        except DEAD:
            pass

    # -- store shards ---------------------------------------------------------------------------
    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; returns shards found dead, each
        replaced at once by an empty shard under its id that every prefill replica is told
        of (the dead one's blocks are recomputed by whoever needs them)."""
        c = self.cluster
        if c.store is None:
            return []
        c.store.refresh()
        dead = [sid for sid in c.store.shards if sid not in c.store.live()]
        for sid in dead:  # found dead now, or earlier by a failed read or write
            handle = c.store.restart(sid)
            for replica in [*c.prefills.values(), *c.decodes.values()]:
                with contextlib.suppress(*DEAD):  # a dead one is replaced with the live set
                    ray.get(replica.add_shard.remote(sid, handle))
        return dead
