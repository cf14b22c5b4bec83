"""The global router of the Serve app: a router deployment plus a pinning RequestRouter.

Why a router deployment (holding ``RouterState``) and not the decision inside a Ray Serve
custom ``RequestRouter``:

- A ``RequestRouter`` lives inside every ``DeploymentHandle``: each ingress replica (and
  every other caller) would hold its own diverging view, and each would need every
  replica's block events. One router deployment holds the one view.
- Serve feeds a ``RequestRouter`` only ``record_routing_stats`` snapshots polled by the
  controller (latest wins, 0.5-1.5 s stale). Block stored/evicted events are deltas: a
  snapshot channel would drop some. Replicas instead push their events to the router in
  order (each push awaited before the next), so its cached sets stay exact.
- The router applies its own decision at once (``RouterState.route`` records the routed
  request's blocks and queued tokens on the chosen replica), so back-to-back requests with
  one prefix go to one replica before any event arrives.

The ingress asks ``RouterDeployment.route`` for a ranking of replica ids (one actor call,
~ms), then calls the replica deployment with that ranking in its message (``messages.py``,
``ReplicaCall.ranking``); the replica deployment's ``RankedRequestRouter`` (the custom Serve
``RequestRouter``) only pins the request to the ranking's first replica that has capacity,
falling back down the ranking and then to any replica. The replica that accepts a request
names itself; when that is not the ranking's first (or none accepted it), the ingress tells
the router at once (``moved``), so the view records each request where it runs.

All router methods that touch ``RouterState`` are ``async`` without ``await``: each runs
whole on the router's event loop, so ``RouterState`` is never touched by two calls at once.
The weight-update methods await, but only on the weight log (``weight_updates.py``), which
the router owns for the whole app.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ray import serve
from ray.serve import context as serve_context
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.engine.heap_freeze import freeze_startup_heap
from actors.engine.thread_priority import run_process_at_normal_priority
from actors.serving.messages import ReplicaCall
from actors.serving.metrics import MetricsSnapshot, ReplicaSample, RouterMetrics
from actors.serving.router_state import RouterState
from actors.serving.weight_updates import (
    RemoteLogStore,
    WeightLogStore,
    WeightUpdate,
    WeightUpdateLog,
)
from policies.replica_stats import ReplicaStats
from policies.routing import RouteRequest
from policies.standby import StandbyPool

log = logging.getLogger(__name__)

# A replica silent this long (5 of its idle heartbeats) is dropped from the view: a killed
# replica leaves /health and the rankings this soon (a live one that was only slow comes
# back with its next report, which resyncs it).
REPLICA_TIMEOUT_S = 10.0
MAX_DEPARTED = 4096  # ids of replicas that left, remembered so a late report is ignored


class RouterDeployment:
    """State: the routing view (``RouterState``) and each replica's latest stats/metrics."""

    def __init__(
        self,
        policy: str,
        block_size: int,
        options: dict[str, Any] | None = None,
        model: str | None = None,
        active_replicas: dict[str, int] | None = None,
        weight_store: WeightLogStore | None = None,
    ):
        """``model``: the app's model folder (None: the built-in tiny one), whose tensors a
        weight update must fit. ``active_replicas``: group -> replicas that take requests,
        for the groups that run warm standby replicas beyond them (``policies.standby``);
        a standby is kept out of the routing view until it replaces an active replica.
        ``weight_store``: where the weight log is kept across router restarts (default:
        under Serve the app's detached ``RemoteLogStore``, else in process)."""
        run_process_at_normal_priority()  # nice 0, as RAY_worker_niceness=0 (thread_priority)
        freeze_startup_heap()  # no full collection walks the imports: no pause of ~0.2 s
        self.state = RouterState(policy, block_size=block_size, **(options or {}))
        self.block_size = block_size
        self.groups: dict[str, str] = {}  # replica id -> group name
        self.last_seen: dict[str, float] = {}
        self.snapshots: dict[str, ReplicaSample] = {}  # each replica's latest, for /metrics
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, outcome) -> count
        self.departed: dict[str, None] = {}  # replicas that left (insertion-ordered, bounded)
        self.pool = StandbyPool(dict(active_replicas or {}))
        self.standby_samples: dict[str, ReplicaSample] = {}  # each standby's latest report
        self.promoted: set[str] = set()  # standbys made active whose whole set is not in yet
        self.recovering: set[str] = set()  # out of the view while their workers restart
        store: WeightLogStore | RemoteLogStore | None = weight_store
        replica = serve_context._get_internal_replica_context()
        if store is None and replica is not None:  # a Serve replica: the app's own store
            store = RemoteLogStore(replica.app_name, model)
        self.weights = WeightUpdateLog(model, self._live_ids, store)

    def __del__(self) -> None:
        """Serve stops the router gracefully (a redeploy, or the app deleted): the weight
        log's store goes with the app (``RemoteLogStore.release``)."""
        store = getattr(getattr(self, "weights", None), "store", None)
        if isinstance(store, RemoteLogStore):
            store.release()

    async def route(self, request: RouteRequest) -> list[tuple[str, str]]:
        """(replica id, group) pairs, best first. Records the decision in the view."""
        self._expire(time.time())
        ranking = self.state.route(request) if self.groups else []
        pairs = [(rid, self.groups[rid]) for rid in ranking if rid in self.groups]
        self.decisions[(self.state.policy_name, "routed" if pairs else "no_replica")] += 1
        return pairs

    async def moved(self, request: RouteRequest, routed_to: str, runs_on: str | None) -> None:
        """The ingress saw ``request`` accepted by ``runs_on``, not by its ranking's first
        (``RankedRequestRouter`` passed over a full replica), or by none (None: refused, or
        its start failed): record it where it runs, or nowhere."""
        outcome = "moved" if runs_on is not None else "not_run"
        if runs_on is not None and self.pool.is_standby(runs_on):
            runs_on = None  # Serve overflowed onto a standby, which the view does not hold
        self.state.moved(request, routed_to, runs_on)
        self.decisions[(self.state.policy_name, outcome)] += 1

    async def prefix_lengths(self, block_hashes: list[int]) -> dict[str, int]:
        """Each live replica's cached prefix of ``block_hashes`` in blocks, from the exact
        index its block events keep (a region balancer's local view)."""
        self._expire(time.time())
        view = self.state.view
        lengths = view.prefix_blocks(RouteRequest("", block_hashes, 0))
        return {v.replica_id: n for v, n in zip(view.replicas, lengths, strict=True)}

    async def report(
        self,
        replica_id: str,
        group: str,
        stats: ReplicaStats,
        metrics: MetricsSnapshot,
        events: list[tuple[str, int]],
        resync: list[int] | None,
        first: bool,
        recovering: bool = False,
    ) -> bool:
        """Apply one replica push. Returns True when the router needs the replica's whole
        cached set (it does not know this replica's history: a router restart).

        Membership: a replica's first report adds it to the view (a replica Serve just
        started); one that ``leave``s, or stays silent for ``REPLICA_TIMEOUT_S`` (it died),
        is dropped. A report from a replica that left (a push in flight as it left) is
        ignored, so it cannot come back. A standby's reports keep only its latest sample;
        once promoted, its next report is asked for its whole cached set.

        ``recovering``: the replica is bringing a lost worker group up again. When its group
        has a spare, the replica leaves the view meanwhile (the spare takes its place) and
        rejoins, as a spare if the group is full, with its first report after recovering
        (its cache is empty then: it is asked for its whole set)."""
        if replica_id in self.departed:
            return False
        if recovering and (replica_id in self.recovering or self.pool.has_spare(group)):
            if replica_id in self.groups and not self.pool.is_standby(replica_id):
                self._drop(replica_id)
            if replica_id not in self.groups:
                self.recovering.add(replica_id)
                return False
        self.recovering.discard(replica_id)
        known = replica_id in self.groups
        if not known:
            self.groups[replica_id] = group
            if self.pool.join(replica_id, group):
                self.state.add_replica(replica_id, total_blocks=stats.total_blocks)
        self.last_seen[replica_id] = time.time()
        if self.pool.is_standby(replica_id):
            self.standby_samples[replica_id] = ReplicaSample(group, stats, metrics)
            return False
        if replica_id in self.promoted and resync is None:
            self.promoted.discard(replica_id)
            self.state.on_stats(replica_id, stats)
            return True
        self.promoted.discard(replica_id)
        if resync is not None:
            self.state.resync(replica_id, resync)  # the whole set; ``events`` come after it
        self.state.on_events(replica_id, events)
        self.state.on_stats(replica_id, stats)
        self.snapshots[replica_id] = ReplicaSample(group, stats, metrics)
        return not known and not first and resync is None

    async def leave(self, replica_id: str) -> None:
        """A replica stops (Serve scaled its group down, or the app shuts down): forget it
        at once rather than after ``REPLICA_TIMEOUT_S``. Serve has already stopped sending it
        requests and it has finished what it held."""
        self._drop(replica_id)
        self.departed[replica_id] = None
        while len(self.departed) > MAX_DEPARTED:
            del self.departed[next(iter(self.departed))]

    async def removed(self, replica_ids: list[str]) -> None:
        """Serve no longer runs these replicas (its controller found them dead, or is
        stopping them): drop them now, not after ``REPLICA_TIMEOUT_S`` of silence, so a
        standby takes a dead replica's place at once. Sent by ``RankedRequestRouter``."""
        for rid in replica_ids:
            self.departed[rid] = None
            self._drop(rid)
        while len(self.departed) > MAX_DEPARTED:
            del self.departed[next(iter(self.departed))]

    async def snapshot(self) -> dict[str, ReplicaSample]:
        """The latest sample of each active replica (standbys: ``standby``)."""
        self._expire(time.time())
        return dict(self.snapshots)

    async def standby(self) -> list[str]:
        """The warm standby replicas, not routed to until one replaces an active replica."""
        self._expire(time.time())
        return self.pool.standby_ids()

    async def metrics(self) -> RouterMetrics:
        """What ``/metrics`` renders: each live replica's latest sample, and the decisions."""
        self._expire(time.time())
        return RouterMetrics(dict(self.snapshots), dict(self.decisions))

    # -- weight updates (``weight_updates.py``): the one ordered log of the app -------------
    async def update_weights(self, source: Any, abort_in_flight: bool = False) -> int:
        """Check ``source``, log it as the next weight version and return that version once
        every live replica loaded it (the only router method that awaits: routing goes on)."""
        return await self.weights.update(source, abort_in_flight)

    async def next_weight_version(self, after: int, timeout_s: float = 10.0) -> int:
        """The weight version, as soon as it is above ``after`` (a long poll)."""
        return await self.weights.next_version(after, timeout_s)

    async def weight_updates(self, after: int) -> list[WeightUpdate]:
        """The updates after version ``after``, oldest first (their refs stay refs)."""
        return self.weights.since(after)

    async def weights_loaded(self, replica_id: str, version: int, error: str | None) -> None:
        await self.weights.on_loaded(replica_id, version, error)

    async def set_sleep(self, level: int | None) -> int:
        """Every replica sleeps at ``level`` (None: wakes); the bytes freed, once all did."""
        return await self.weights.set_sleep(level)

    async def next_app_state(
        self, version: int, changes: int, timeout_s: float = 10.0
    ) -> tuple[int, int, int | None]:
        """A replica's long poll: ``(weight version, sleep changes, sleep level)``."""
        return await self.weights.next_state(version, changes, timeout_s)

    async def slept(self, replica_id: str, changes: int, freed: int, error: str | None) -> None:
        await self.weights.on_slept(replica_id, changes, freed, error)

    def _live_ids(self) -> set[str]:
        self._expire(time.time())
        return set(self.groups)

    def _expire(self, now: float) -> None:
        for rid, seen in list(self.last_seen.items()):
            if now - seen > REPLICA_TIMEOUT_S:
                self._drop(rid)

    def _drop(self, replica_id: str) -> None:
        if replica_id in self.groups and not self.pool.is_standby(replica_id):
            self.state.remove_replica(replica_id)
        promoted = self.pool.leave(replica_id)
        self.groups.pop(replica_id, None)
        self.last_seen.pop(replica_id, None)
        self.snapshots.pop(replica_id, None)
        self.standby_samples.pop(replica_id, None)
        self.promoted.discard(replica_id)
        self.recovering.discard(replica_id)
        self.weights.forget(replica_id)
        if promoted is not None:  # a warm standby takes the place at once
            sample = self.standby_samples.pop(promoted)
            self.state.add_replica(promoted, total_blocks=sample.stats.total_blocks)
            self.state.on_stats(promoted, sample.stats)
            self.snapshots[promoted] = sample
            self.promoted.add(promoted)


@contextlib.contextmanager
def fresh_serve_internal_request_id() -> Iterator[None]:
    """Give the handle calls made inside a fresh Serve internal request id.

    A ``RequestRouter`` that does not mix in FIFO (ours: it pins a request to its ranking)
    hands a chosen replica to the pending request with the *same internal request id*, and
    every handle call made while serving one request inherits that request's id. Two
    concurrent calls from one request (a batch of prompts) would share it: the first takes
    the match and the second's routing task spins forever without backoff (Ray 2.60). One
    id per call keeps each pending request matchable.

    The one place Meridian touches Serve's private request context: Ray Serve 2.60 has no
    public way to set a call's internal request id (``DeploymentHandle.options`` takes
    none). Running the call in an empty ``contextvars.Context`` would also get a fresh id,
    but would drop the rest of the request context (request id, route, app) too."""
    ctx = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex)
    var: Any = serve_context._serve_request_context  # typed as holding None upstream
    token = var.set(fresh)
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


class RankedRequestRouter(RequestRouter):
    """Serve ``RequestRouter`` of the replica deployments: follows the global router's
    ranking carried in the call's message (``ReplicaCall.ranking``: replica ids).

    Each ranked replica is its own tier, so Serve takes the first one below its
    ``max_ongoing_requests`` and falls back down the list; replicas missing from the
    ranking (new, or unknown to the router) form a last tier, so a request is never stuck
    on a stale ranking."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's controller changed the deployment's running replicas: besides routing
        over the new set, tell the global router which replicas left (found dead, or being
        stopped), so it stops ranking them (and promotes a standby) now instead of after
        their reports stop. An update that leaves no replica is not passed on (a group is
        never emptied on purpose while it serves)."""
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        gone = sorted(before - {r.replica_id.unique_id for r in replicas})
        if gone and replicas:
            self._tell_router(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A call to ``replica_id`` found its actor dead (often before the controller's
        next update says so)."""
        super().on_replica_actor_died(replica_id)
        self._tell_router([replica_id.unique_id])

    def _tell_router(self, gone: list[str]) -> None:
        """On its own thread: this runs on Serve's routing loop, where a handle call to
        another deployment is never sent."""

        def tell() -> None:
            try:
                router = serve.get_deployment_handle("Router", app_name=self.app_name)
                router.removed.remote(gone).result(timeout_s=30)
            except Exception:  # the router restarts: its reports' silence drops them too
                log.warning("could not tell the router that %s left", gone, exc_info=True)

        threading.Thread(target=tell, name="meridian-replicas-gone", daemon=True).start()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranking: tuple[str, ...] = ()
        if pending_request is not None and pending_request.args:
            msg = pending_request.args[0]
            if isinstance(msg, ReplicaCall):
                ranking = msg.ranking
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        tiers = [[by_id[rid]] for rid in dict.fromkeys(ranking) if rid in by_id]
        ranked = set(ranking)
        rest = [r for r in candidate_replicas if r.replica_id.unique_id not in ranked]
        if rest:
            tiers.append(rest)
        return tiers
