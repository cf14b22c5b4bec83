"""The prefill and decode replica actors of one ``PDCluster``, and how they are started.

``ReplicaSet`` owns, per replica id (``p<i>``, ``d<j>``): the actor handle, the Conductor's
view of it (``PrefillInstance`` / ``DecodeInstance``, updated from its reports), a prefill
replica's node and the block hashes its own prefix cache holds, and one outstanding long
poll (``report``) on every live replica. Each replica is claimed for this set's ``owner``
(one per Conductor) when it is registered; a poll raises ``Superseded`` once another
Conductor claimed the replica. ``start`` starts a replica under its id, or a
fresh actor in place of a dead one (``forget`` drops the old one first); a pool grows by
``begin_start`` / ``poll_starting`` (never waited on) and shrinks by ``draining`` a replica
(no new work) and then ``retire``-ing it.

Placement: replicas and store shards spread over the cluster's nodes (``placement.nodes``);
with several nodes prefill and decode run apart and stream KV over TCP. On a GPU cluster
each worker holds one GPU (a one-worker replica's worker runs in the replica actor, which
then holds it); on CPU nothing is reserved. Actors are threaded: the Conductor's long poll
waits in one thread while other calls are served.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import ray

from actors.disagg import pool_actors
from actors.disagg.cluster_config import PDClusterConfig
from actors.disagg.decode import DecodeReplica
from actors.disagg.messages import DecodeStats, PrefillStats
from actors.disagg.prefill import PrefillReplica
from actors.disagg.store_view import DEAD, PDStore
from actors.engine.config import EngineConfig
from actors.engine.replica_loop import split_cores
from actors.ray_nodes import alive_nodes, pinned
from placement.nodes import Node, NodePlacement, ReplicaSpec, nodes_carrying
from policies.conductor import DecodeInstance, PrefillInstance

REPORT_WAIT_S = 0.25  # a replica's long poll returns at the latest after this long


def call_replica(method: Any, *args: Any) -> bool:
    """Call a replica's actor method and wait for it; False when the replica is gone (its
    death is handled when its long poll fails)."""
    try:
        ray.get(method.remote(*args))
    except DEAD:
        return False
    return True


def plan_nodes(config: PDClusterConfig, on_gpu: bool) -> NodePlacement:
    """Each replica's node (prefill ``p<i>``, decode ``d<j>``) on the live nodes the
    cluster may use."""
    plan = NodePlacement(cluster_nodes(config))
    plan.place(
        [replica_spec(config, f"p{i}", on_gpu) for i in range(config.prefill.count)]
        + [replica_spec(config, f"d{j}", on_gpu) for j in range(config.decode.count)]
    )
    return plan


def replica_spec(config: PDClusterConfig, rid: str, on_gpu: bool) -> ReplicaSpec:
    """What replica ``rid`` (``p<i>`` prefill, ``d<j>`` decode) needs of its node."""
    worker = {"GPU": 1.0} if on_gpu else {}
    if rid[0] == "p":
        return ReplicaSpec(rid, "prefill", _workers(config.side_engine(config.prefill)), worker)
    return ReplicaSpec(rid, "decode", _workers(config.side_engine(config.decode)), worker)


def cluster_nodes(config: PDClusterConfig) -> list[Node]:
    """The live nodes the cluster's actors may use (a region's, when pinned)."""
    return nodes_carrying(alive_nodes(), config.node_resources)


def _workers(engine: EngineConfig) -> int:
    return engine.tp * engine.spp * engine.kvp


class ReplicaSet:
    def __init__(
        self,
        config: PDClusterConfig,
        model_dir: str,
        plan: NodePlacement,
        store: PDStore | None,
        on_gpu: bool,
        decode_reads_store: bool,
    ) -> None:
        """``decode_reads_store``: decode replicas read stored prefixes (DualPath's decode
        read path), so they get the store shards even without write-back."""
        self.config, self.model_dir, self.plan, self.store = config, model_dir, plan, store
        self.owner = uuid.uuid4().hex  # the Conductor its replicas serve (``claim``)
        self.prefill_engine = config.side_engine(config.prefill)
        self.decode_engine = config.side_engine(config.decode)
        self._prefill_cls = self._actor_class(PrefillReplica, self.prefill_engine, on_gpu)
        self._decode_cls = self._actor_class(DecodeReplica, self.decode_engine, on_gpu)
        self.prefill_ids = [f"p{i}" for i in range(config.prefill.count)]
        self.decode_ids = [f"d{j}" for j in range(config.decode.count)]
        one_node = len(plan.nodes) == 1
        self._cores = (
            split_cores(config.prefill.count, config.decode.count)
            if config.pin_cores and one_node
            else {}
        )
        self._decode_reads_store = decode_reads_store
        self._on_gpu = on_gpu
        self.prefills: dict[str, Any] = {}
        self.decodes: dict[str, Any] = {}
        self.prefill_views: dict[str, PrefillInstance] = {}
        self.decode_views: dict[str, DecodeInstance] = {}
        self.prefill_reports: dict[str, PrefillStats] = {}
        self.local_cached: dict[str, set[int]] = {}  # prefill id -> its prefix cache's hashes
        self.prefill_nodes: dict[str, str] = {}
        self.polls: dict[Any, tuple[str, Any]] = {}  # poll ref -> (replica id, handle)
        self.starting: dict[str, tuple[Any, Any]] = {}  # id -> (handle, its node() call)
        self.draining: set[str] = set()  # no new work placed on these; retired once idle
        self.failed_starts: list[str] = []  # ids whose ``begin_start`` actor died starting
        # every weight update (object refs), oldest first: update i is weight version i + 1
        self.weight_updates: list[Any] = []
        self.loaded: dict[str, int] = {}  # replica id -> the weight version it runs
        self.sleep_level: int | None = None  # every replica sleeps at it; None: awake

    def start_all(self) -> None:
        """Start every replica; in a shared pool (``config.pool``) first attach to the live
        replicas a previous Conductor left (``attach``), then start as many as each side
        lacks of its ``count``."""
        found = pool_actors.find(self.config.pool) if self.config.pool else {}
        for rid, handle in sorted(found.items()):
            if rid[0] in "pd":
                self.attach(rid, handle)
        sides = (
            (self.prefill_ids, self.prefills, self.config.prefill.count),
            (self.decode_ids, self.decodes, self.config.decode.count),
        )
        missing: list[str] = []
        for ids, running, count in sides:
            lacking = count - len(running)
            for rid in [x for x in ids if x not in running]:
                if lacking > 0:
                    missing.append(rid)
                    lacking -= 1
                else:  # the pool holds its count under other ids (it grew or was drained)
                    ids.remove(rid)
                    self.plan.remove(rid)
        self._start_together(missing, restart=False)

    def attach(self, rid: str, handle: Any) -> None:
        """Take over a live replica of the shared pool: it drops what the previous
        Conductor placed on it (those requests are replayed by their callers) and is
        claimed for this one (a previous Conductor still running is ``Superseded``); its
        prefix cache and its stats are read back."""
        node = ray.get(handle.node.remote())
        self.plan.record(rid, node, replica_spec(self.config, rid, self._on_gpu).needs)
        cached = ray.get(handle.reset.remote(self.owner))
        loaded = int(ray.get(handle.weight_version.remote()))  # not loaded again
        self._register(rid, handle, node, set(cached or ()), loaded)

    # -- starting, replacing, growing and shrinking -----------------------------------------
    def start(self, rid: str) -> None:
        """Start replica ``rid`` and wait until it runs (a fresh actor if one ran under
        that id: a replacement)."""
        self._start_together([rid], restart=rid in self.prefills or rid in self.decodes)

    def _start_together(self, rids: list[str], restart: bool) -> None:
        """Create every actor at once (a start is mostly its process importing and building
        its engine), wait until all run, then register each in order; if one fails, the
        others are killed and the error raised."""
        created = [(rid, self._create(rid, restart)) for rid in rids]
        try:
            nodes = ray.get([handle.node.remote() for _, handle in created])
        except BaseException:
            for _, handle in created:
                self.forget(handle)
            raise
        for (rid, handle), node in zip(created, nodes, strict=True):
            self._register(rid, handle, node, set())

    def begin_start(self, kind: str) -> str:
        """One more replica of ``kind`` (``"prefill"`` or ``"decode"``) under the first
        free id, placed on the node holding fewest of its kind; it joins the set once
        ``poll_starting`` finds it running (the Conductor never waits on a start)."""
        prefix = kind[0]
        taken = {*self.prefills, *self.decodes, *self.starting}
        rid = next(f"{prefix}{i}" for i in itertools.count() if f"{prefix}{i}" not in taken)
        self.plan.add(replica_spec(self.config, rid, self._on_gpu))
        handle = self._create(rid, restart=False)
        self.starting[rid] = (handle, handle.node.remote())
        return rid

    def poll_starting(self) -> list[str]:
        """Replicas started by ``begin_start`` that now run, registered (a start that
        failed is dropped)."""
        joined = []
        for rid, (handle, ref) in list(self.starting.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del self.starting[rid]
            try:
                node = ray.get(ref)
            except DEAD:
                self.plan.remove(rid)
                self.failed_starts.append(rid)
                continue
            self._register(rid, handle, node, set())
            joined.append(rid)
        return joined

    def retire(self, rid: str) -> None:
        """Remove a drained replica (nothing is placed on it any more): shut it down and
        forget it."""
        handle = self.prefills.pop(rid, None) or self.decodes.pop(rid)
        call_replica(handle.shutdown)
        self.forget(handle)
        self.prefill_views.pop(rid, None)
        self.decode_views.pop(rid, None)
        self.prefill_reports.pop(rid, None)
        self.local_cached.pop(rid, None)
        self.prefill_nodes.pop(rid, None)
        self.loaded.pop(rid, None)
        self.draining.discard(rid)
        for ids in (self.prefill_ids, self.decode_ids):
            if rid in ids:
                ids.remove(rid)
        self.plan.remove(rid)

    def accepting(self, rid: str) -> bool:
        """Whether the Conductor may place new work on ``rid`` (not draining)."""
        return rid not in self.draining

    def _create(self, rid: str, restart: bool) -> Any:
        """The actor of replica ``rid`` (not waited for)."""
        if rid[0] == "p":
            side = self.config.prefill
            return self._pinned(self._prefill_cls, rid, restart).remote(
                rid,
                self.model_dir,
                self.prefill_engine,
                store_shards=self.store.live() if self.store else {},
                link_budget=side.link_budget,
                record_loads=side.record_loads,
                store_placement=self._store_placement(),
                **self._pinning(rid),
            )
        side = self.config.decode
        # prefill on another node (now, or once a pool grows there): KV over TCP
        serve_tcp = len(self.plan.nodes) > 1 or self.plan.apart(rid, self.prefill_ids)
        return self._pinned(self._decode_cls, rid, restart).remote(
            rid,
            self.model_dir,
            self.decode_engine,
            serve_tcp=serve_tcp,
            tcp_host=self.plan.tcp_host(rid),
            store_shards=self._decode_shards(),
            write_back=bool(self.store and self.store.cfg.write_back),
            link_budget=side.link_budget,
            record_loads=side.record_loads,
            store_placement=self._store_placement(),
            **self._pinning(rid),
        )

    def update_weights(self, ref: Any) -> None:
        """Every replica loads the checked weights in ``ref`` as the next weight version
        (none holds a request), but one that runs it already (attached from a previous
        Conductor, which loaded it); a replica started later loads every update at start."""
        version = len(self.weight_updates) + 1
        behind = {
            rid: h
            for rid, h in [*self.prefills.items(), *self.decodes.items()]
            if self.loaded.get(rid, 0) < version
        }
        ray.get([h.update_weights.remote([ref], version) for h in behind.values()])
        self.loaded.update(dict.fromkeys(behind, version))
        self.weight_updates.append(ref)

    def sleep(self, level: int) -> int:
        """Every replica frees its KV cache (and weights, level 2), holding no request; a
        replica started while asleep sleeps too. Returns the bytes freed by all."""
        handles = [*self.prefills.values(), *self.decodes.values()]
        freed = sum(ray.get([h.sleep.remote(level) for h in handles]))
        self.sleep_level = level
        return int(freed)

    def wake_up(self) -> None:
        handles = [*self.prefills.values(), *self.decodes.values()]
        ray.get([h.wake_up.remote() for h in handles])
        self.sleep_level = None

    def _store_placement(self) -> str:
        return self.store.cfg.placement if self.store else "local"

    def _register(
        self, rid: str, handle: Any, node: str, cached: set[int], loaded: int = 0
    ) -> None:
        """Count a running replica in: its view, its state as it reports it, its poll;
        ``loaded``: the weight version it runs (0: a fresh actor)."""
        if rid[0] == "p":
            self.prefills[rid] = handle
            self.prefill_views[rid] = PrefillInstance(rid)
            self.local_cached[rid] = cached
            self.prefill_nodes[rid] = node
            ids = self.prefill_ids
        else:
            self.decodes[rid] = handle
            self.decode_views[rid] = DecodeInstance(rid)
            ids = self.decode_ids
        if rid not in ids:
            ids.append(rid)
        self.loaded[rid] = loaded
        for version, ref in enumerate(self.weight_updates, start=1):  # started after them
            if version > self.loaded[rid]:
                ray.get(handle.update_weights.remote([ref], version))
                self.loaded[rid] = version
        if self.sleep_level is not None:
            ray.get(handle.sleep.remote(self.sleep_level))
        report = ray.get(handle.claim.remote(self.owner))
        self.apply_stats(rid, report.stats)
        self.watch(rid, handle)

    def watch(self, rid: str, handle: Any) -> None:
        """Keep one long poll outstanding on a live replica."""
        self.polls[handle.report.remote(REPORT_WAIT_S, self.owner)] = (rid, handle)

    def forget(self, handle: Any) -> None:
        """Stop watching a replica and kill its actor (if it still runs)."""
        for ref in [r for r, (_, h) in self.polls.items() if h is handle]:
            del self.polls[ref]
        try:
            ray.kill(handle)
        except DEAD:
            pass

    def all_handles(self) -> list[Any]:
        return [*self.prefills.values(), *self.decodes.values()]

    # -- what the replicas report -----------------------------------------------------------
    def apply_stats(self, rid: str, stats: PrefillStats | DecodeStats) -> None:
        if isinstance(stats, PrefillStats):
            self.prefill_reports[rid] = stats
            pview = self.prefill_views[rid]
            pview.queued_tokens = stats.queued_tokens
            pview.queued_requests = stats.queued_requests
            pview.queued = list(stats.queued)
            return
        view = self.decode_views[rid]
        view.num_running = stats.num_running
        view.used_blocks = stats.used_blocks
        view.pending = stats.pending
        view.pending_blocks = stats.pending_blocks
        view.total_blocks = stats.total_blocks
        view.remaining_tokens = list(stats.remaining)

    def home_shard(self, pid: str) -> str | None:
        """The live store shard prefill replica ``pid`` writes to and counts as its own:
        one on its node (the node's prefill replicas spread over its shards), else any."""
        if self.store is None:
            return None
        node = self.prefill_nodes[pid]
        peers = sorted(p for p in self.prefills if self.prefill_nodes[p] == node)
        return self.store.home_shard(node, peers.index(pid))

    # -- set-up -----------------------------------------------------------------------------
    def _actor_class(self, cls: type, engine: EngineConfig, on_gpu: bool) -> Any:
        gpus = 1.0 if on_gpu and _workers(engine) == 1 else 0
        remote: Any = ray.remote  # its overloads do not name max_concurrency
        return remote(
            num_cpus=0,
            num_gpus=gpus,
            resources=self.config.node_resources,
            max_restarts=0,
            max_concurrency=4,
        )(cls)

    def _pinning(self, rid: str) -> dict[str, Any]:
        """Replica ``rid``'s cores: its side's half (one grown later too), or none."""
        cores = self._cores.get(rid) or next(
            (c for k, c in sorted(self._cores.items()) if k[0] == rid[0]), None
        )
        return {"cpus": cores, "threads": len(cores)} if cores else {}

    def _decode_shards(self) -> dict[str, Any] | None:
        """The store shards a decode replica uses: to write back, or to read prefixes."""
        if self.store is None or not (self.store.cfg.write_back or self._decode_reads_store):
            return None
        return self.store.live()

    def _pinned(self, cls: Any, rid: str, restart: bool) -> Any:
        """``cls`` pinned to ``rid``'s node: hard at first, soft for a replacement (which
        moves off a node that is gone). Named ``pd-<rid>-<unique>`` so that a tool attached
        to the cluster finds it (``ray.util.list_named_actors``; bench/pd_profile.py), or in
        a shared pool detached under the pool's name (``pool_actors``)."""
        pool = self.config.pool
        if pool is not None:
            options = pool_actors.pool_actor_options(pool, rid)
        else:
            options = {"name": f"pd-{rid}-{uuid.uuid4().hex[:12]}"}
        if restart:
            node = self.plan.replace(rid, cluster_nodes(self.config))
            return pinned(cls, node, soft=True, **options)
        return pinned(cls, self.plan.node_id(rid), **options)
