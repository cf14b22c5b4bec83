"""A ``PDCluster`` as a ``ServingEngine`` (actors/serving/engine_loop.py), so a Serve replica
runs a prefill/decode-disaggregated deployment in the same ``EngineLoop`` as a colocated one.
Nothing here imports ``actors.serving``: the Serve replica builds the cluster's
``PDClusterConfig`` from its group (``actors.serving.pd_group``).

Placement (the Conductor) happens in ``add_request``, on the engine thread like every other
call into the cluster: a rejection is raised there as ``OverloadedError`` carrying the
Conductor's ``retry_after``, before the request is accepted, so it reaches the client as a
429 with Retry-After and never as an error inside a started stream. A request that finds no
decode room waits instead (``PDCluster.waiting``): its verdict is deferred (``waiting`` and
``refusal``, which ``EngineLoop`` asks after each step) until it is placed, or refused with
the same 429 once it waited past the bounds (``policies.decode_wait``).

Invariants:
- Every request added and not yet released ends with exactly one finished delta from
  ``step``: the decode replica's, or one made here when the cluster ended it without one
  (a routed request, whose tokens went to its ingress: its finish reason; or its prefill
  or decode replica failed: ``"abort"``, which ``EngineLoop`` reports as a retriable
  error).
- ``drain_cache_events`` returns the difference between consecutive snapshots of the
  hashes the cluster can reuse (prefill prefix caches and store shards), so the events
  since the last ``cached_block_hashes`` applied to it give the current set.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig
from actors.disagg.conductor import RequestRejected
from actors.disagg.messages import PDCounters, PrefillStats
from actors.engine.direct_return import ReturnRoute
from actors.engine.outputs import RequestOutput, StreamDelta
from policies.replica_stats import ReplicaStats
from policies.request import Request

POLL_WAIT_S = 0.05  # the engine thread applies new commands at least this often
STORE_REFRESH_S = 1.0  # under load, the store's map is brought up to date this often


def transfer_links(reports: list[PrefillStats]) -> tuple[tuple[str, str, int], ...]:
    """(path, backend, peers) from the prefill replicas' reports (``PDCounters``)."""
    links: Counter[tuple[str, str]] = Counter()
    for r in reports:
        links.update(("prefill->decode", b) for b in r.backends.values())
        links.update(("store->prefill", b) for b in r.load_backends.values())
    return tuple((path, backend, n) for (path, backend), n in sorted(links.items()))


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
    def for_config(cls, config: PDClusterConfig) -> PDEngine:
        """Start the cluster ``config`` describes (built by the Serve replica from its
        group, ``actors.serving.pd_group``)."""
        return cls(PDCluster(config))

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> str:
        """Place the request now (Conductor); raises OverloadedError with the Conductor's
        ``retry_after`` when it rejects it (``RequestRejected`` is one: a 429)."""
        rid = self.cluster.submit_request(request)
        self._live.add(rid)
        return rid

    def add_routed(self, request: Request, route: ReturnRoute) -> str:
        """``add_request``, with the request's tokens and ``Done`` sent by its decode
        replica straight to ``route`` (its ingress): ``step`` then gives only its finished
        delta, without tokens."""
        rid = self.cluster.submit_request(request, route)
        self._live.add(rid)
        return rid

    def waiting(self, request_id: str) -> bool:
        """Added, verdict deferred: it waits for decode room."""
        return self.cluster.waiting(request_id)

    def refusal(self, request_id: str) -> RequestRejected | None:
        """The 429 of an added request refused after waiting (it holds nothing)."""
        return self.cluster.refusal(request_id)

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
            if out is not None and self.cluster.refusal(rid) is None:  # ended by a failure
                self._live.discard(rid)
                deltas.append(StreamDelta(rid, [], "", True, out.finish_reason or "abort"))
        return deltas

    def abort(self, request_id: str) -> None:
        self._live.discard(request_id)
        self.cluster.abort(request_id)

    def release(self, request_id: str) -> RequestOutput:
        refused = self.cluster.refusal(request_id) is not None
        out = self.cluster.release(request_id)
        if refused:  # never ran: no prompt to count
            return out
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

    def update_weights(self, weights: Any, version: int) -> None:
        """Load ``weights`` into every prefill and decode replica as weight version
        ``version`` (holding no request). The cluster numbers versions itself, one per
        update from 0 at its start, so ``version`` must be the next one."""
        if version != self.cluster.weight_version + 1:
            raise RuntimeError(
                f"the P/D cluster is at weight version {self.cluster.weight_version}; it "
                f"cannot load update {version} next"
            )
        self.cluster.update_weights(weights)

    def sleep(self, level: int) -> int:
        """Every replica of the cluster frees its KV cache (and weights: ``PDCluster.sleep``)."""
        return self.cluster.sleep(level)

    def wake_up(self) -> None:
        self.cluster.wake_up()

    def shutdown(self) -> None:
        for rid in list(self._live):
            self.abort(rid)
        self.cluster.shutdown()

    # -- what the router and the dashboard read ---------------------------------------------
    def serving_stats(self) -> ReplicaStats:
        hit = self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
        return self.cluster.stats(cache_hit_ratio=hit)

    def last_token_gaps(self) -> list[float]:
        """The gaps between tokens (seconds) that the decode replicas measured for the
        requests whose tokens they wrote straight to an ingress, reported in the last
        ``step``; the engine loop's inter-token-latency histogram counts them."""
        return self.cluster.token_gaps

    def pd_counters(self) -> PDCounters:
        """Transfer and store counters for ``/metrics``, from the prefill replicas' last
        reports and the cluster's own."""
        reports = list(self.cluster.prefill_reports.values())
        store = self.cluster.store
        tiers = store.tier_counts() if store is not None else {}
        kept = store.retention_counts() if store is not None else {}
        pools = self.cluster.pools
        return PDCounters(
            kv_transfer_bytes=sum(r.bytes_streamed for r in reports),
            kv_transfer_layers=sum(r.layers_streamed for r in reports),
            store_loaded_blocks=sum(r.loaded_blocks for r in reports),
            store_stored_blocks=sum(r.stored_blocks for r in reports),
            store_replicated_blocks=self.cluster.replicated_blocks,
            prefill_restarts=self.cluster.num_prefill_restarts,
            decode_restarts=self.cluster.num_decode_restarts,
            relayed_tokens=self.cluster.relayed_tokens,
            store_dram_hit_blocks=tiers.get("dram_hit_blocks", 0),
            store_ssd_hit_blocks=tiers.get("ssd_hit_blocks", 0),
            store_miss_blocks=tiers.get("miss_blocks", 0),
            store_retained_blocks=kept.get("retained_blocks", 0),
            store_retention_hit_blocks=kept.get("retention_hit_blocks", 0),
            store_expired_retentions=kept.get("expired_retentions", 0),
            decode_waits=self.cluster.waits.num_waited,
            decode_wait_seconds=self.cluster.waits.seconds_waited,
            pool_replicas=tuple(pools.sizes().items()),
            pool_needs=tuple((p, d.signal, d.need) for p, d in pools.decisions().items()),
            transfer_links=transfer_links(reports),
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
