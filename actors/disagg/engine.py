"""A ``PDCluster`` as a ``ServingEngine`` (actors/serving/engine_loop.py), so a Serve replica runs a
prefill/decode-disaggregated deployment in the same ``EngineLoop`` as a colocated one.

Placement (the Conductor) happens in ``add_request``, on the engine thread like every other
call into the cluster: a rejection is raised there as ``OverloadedError`` carrying the
Conductor's ``retry_after``, before the request is accepted, so it reaches the client as a
429 with Retry-After and never as an error inside a started stream.

Invariants:
- Every request added and not yet released ends with exactly one finished delta from
  ``step``: the decode replica's, or one made here when the cluster ended it without one
  (its prefill or decode replica failed: finish reason ``"abort"``, which ``EngineLoop``
  reports as a retriable error).
- ``drain_cache_events`` returns the difference between consecutive snapshots of the
  hashes the cluster can reuse (prefill prefix caches and store shards), so the events
  since the last ``cached_block_hashes`` applied to it give the current set.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.config import ConductorSectionConfig, ReplicaGroupConfig
from actors.serving.engine_section import engine_options
from actors.serving.metrics import PDCounters
from policies.replica_stats import ReplicaStats
from policies.request import Request

POLL_WAIT_S = 0.05  # the engine thread applies new commands at least this often
STORE_REFRESH_S = 1.0  # under load, the store's map is brought up to date this often


class PDEngine:
    def __init__(self, cluster: PDCluster) -> None:
        self.cluster = cluster
        self.limits = cluster.limits
        self.block_size = cluster.block_size
        self._live: set[str] = set()  # added, no finished delta yet
        self._cached: set[int] = set()  # the snapshot the last drain reported
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._store_refreshed = time.monotonic()

    @classmethod
    def for_group(
        cls,
        model: str | None,
        group: ReplicaGroupConfig,
        replica_id: str,
        node_resources: dict[str, float] | None = None,
    ) -> PDEngine:
        """The cluster of one Serve replica of a disaggregated group (``cluster_args``)."""
        return cls(PDCluster(**cluster_args(model, group, replica_id, node_resources)))

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> str:
        """Place the request now (Conductor); raises OverloadedError with the Conductor's
        ``retry_after`` when it rejects it (``RequestRejected`` is one: a 429)."""
        rid = self.cluster.submit_request(request)
        self._live.add(rid)
        return rid

    def step(self) -> list[StreamDelta]:
        """React to the replicas: waits up to ``POLL_WAIT_S`` for their reports. Every
        ``STORE_REFRESH_S`` also the store shards' events (a dead shard is replaced)."""
        deltas = self.cluster.poll(POLL_WAIT_S)
        now = time.monotonic()
        if now - self._store_refreshed > STORE_REFRESH_S:
            self._store_refreshed = now
            self.cluster.refresh_store()
        for d in deltas:
            if d.finished:
                self._live.discard(d.request_id)
        for rid in list(self._live):
            out = self.cluster.output(rid)
            if out is not None:  # ended by a failure, without a delta
                self._live.discard(rid)
                deltas.append(StreamDelta(rid, [], "", True, out.finish_reason or "abort"))
        return deltas

    def abort(self, request_id: str) -> None:
        self._live.discard(request_id)
        self.cluster.abort(request_id)

    def release(self, request_id: str) -> RequestOutput:
        out = self.cluster.release(request_id)
        self._prompt_tokens += len(out.prompt_token_ids)
        self._cached_tokens += out.num_cached_tokens
        return out

    def has_unfinished(self) -> bool:
        return self.cluster.has_unfinished()

    def on_idle(self) -> None:
        """Apply what the replicas and the store shards reported meanwhile (cache events,
        evictions included) to the Conductor's map."""
        self.cluster.poll(0)
        self.cluster.refresh_store()

    def shutdown(self) -> None:
        for rid in list(self._live):
            self.abort(rid)
        self.cluster.shutdown()

    # -- what the router and the dashboard read ---------------------------------------------
    def serving_stats(self) -> ReplicaStats:
        hit = self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
        return self.cluster.stats(cache_hit_ratio=hit)

    def pd_counters(self) -> PDCounters:
        """Transfer and store counters for ``/metrics``, from the prefill replicas' last
        reports and the cluster's own."""
        reports = list(self.cluster.prefill_reports.values())
        store = self.cluster.store
        tiers = store.tier_counts() if store is not None else {}
        return PDCounters(
            kv_transfer_bytes=sum(r.bytes_streamed for r in reports),
            kv_transfer_layers=sum(r.layers_streamed for r in reports),
            store_loaded_blocks=sum(r.loaded_blocks for r in reports),
            store_stored_blocks=sum(r.stored_blocks for r in reports),
            store_replicated_blocks=self.cluster.replicated_blocks,
            prefill_restarts=self.cluster.num_prefill_restarts,
            decode_restarts=self.cluster.num_decode_restarts,
            store_dram_hit_blocks=tiers.get("dram_hit_blocks", 0),
            store_ssd_hit_blocks=tiers.get("ssd_hit_blocks", 0),
            store_miss_blocks=tiers.get("miss_blocks", 0),
        )

    def cached_block_hashes(self) -> list[int]:
        return sorted(self._cached)

    def drain_cache_events(self) -> list[tuple[str, int]]:
        now = self.cluster.cached_hashes()
        events = [("evicted", h) for h in self._cached - now]
        events += [("stored", h) for h in now - self._cached]
        self._cached = now
        return events

    def check_blocks(self) -> dict[str, int]:
        return self.cluster.check_blocks()


def cluster_args(
    model: str | None,
    group: ReplicaGroupConfig,
    replica_id: str,
    node_resources: dict[str, float] | None = None,
) -> dict[str, Any]:
    """``PDCluster``'s arguments for one Serve replica of a disaggregated group; its store's
    SSD files go to ``<store.ssd_dir>/<replica_id>`` so replicas on one node never share a
    folder. The store section's ``read_path`` and ``write_back`` and the conductor
    section's ``scheduler`` (DualPath) pass through; ``node_resources`` (a region's node
    resource) pins every actor of the cluster to the nodes that carry it."""
    assert group.num_prefill is not None and group.num_decode is not None
    store = None
    read_path = "prefill"
    if group.store is not None:
        s = group.store
        ssd_dir = str(Path(s.ssd_dir) / replica_id) if s.ssd_dir else None
        store = StoreConfig(s.dram_bytes, s.ssd_bytes, ssd_dir, s.num_shards, s.write_back)
        read_path = s.read_path
    conductor = group.conductor or ConductorSectionConfig()
    return dict(
        model_dir=model,
        num_prefill=group.num_prefill,
        num_decode=group.num_decode,
        store=store,
        conductor_options=conductor.model_dump(exclude={"fit_costs", "scheduler"}),
        fit_costs=conductor.fit_costs,
        read_path=read_path,
        scheduler=conductor.scheduler,
        prefill_layout=group.prefill.options() if group.prefill else None,
        decode_layout=group.decode.options() if group.decode else None,
        node_resources=node_resources,
        **engine_options(group.engine),
    )
