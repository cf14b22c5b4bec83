"""A prefill/decode-disaggregated deployment on Ray, driven by Mooncake's Conductor.

    cluster = PDCluster(model_dir, num_prefill=1, num_decode=1,
                        store=StoreConfig(dram_bytes=..., ssd_bytes=..., ssd_dir=...),
                        conductor_options=dict(ttft_slo=..., tbt_slo=..., admission="early"),
                        **controller_options)
    outs = cluster.generate(prompt_token_ids=[[...], ...], sampling_params=params)
    rid = cluster.submit(token_ids, params)   # raises RequestRejected (429) on overload
    cluster.poll(timeout) -> list[StreamDelta]; cluster.output(rid); cluster.shutdown()

Every prefill and decode replica runs its own loop in its own actor; nothing here steps
them. The Conductor (this object) places requests and reacts to what the replicas report:
``poll`` waits on one outstanding long poll per replica (``report``) and applies the
events that arrived (prefill done or failed, tokens, finished requests, measured steps,
cache events, stats), and a replica whose poll fails is dead.

Per request: the Conductor (``policies.conductor``) picks the prefill instance with the
lowest estimated TTFT (queue + prefill time, the cached prefix being what the instance's
own prefix cache and the KV store on its node hold) and the decode instance with the
lowest predicted TBT among those with room for the request's lifetime KV, or rejects it
(``actors.disagg.cluster_placement``; with ``scheduler="dualpath"`` DualPath's rules choose
instead). The decode replica reserves the blocks, the prefill replica computes the prompt while
streaming each layer's KV into them through the transfer layer (never through Ray), and
once its last prefill step returned it tells the decode replica to admit the request with
its first token (directly), which joins the decode batch at that replica's next step.
Control messages (ids, block ids, endpoints, tokens) are all Ray carries. Each attempt at a
request has its own key (``<request id>#<attempt>``), so what a replica reports about an
attempt that was given up is dropped.

Store and replication (``actors.disagg.store_view``): each prefill replica writes new blocks to,
and counts as its own, a home shard on its node; prefixes the Conductor wants on the chosen
instance (``transfer_from``, ``replicate_blocks``) are copied there before its prefill.

With ``fit_costs`` (default) the Conductor's estimates are refitted (``CostFitter``) from
the steps and store loads this deployment measures. Replicas and shards spread over the
cluster's nodes (``placement.nodes``).

Faults (``actors.disagg.cluster_faults``): a dead store shard drops out of the map and
``refresh_store`` replaces it with an empty one; a dead prefill or decode replica is
replaced by a fresh actor and its requests run again from their prompt, never streaming a
token twice.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import ray

from actors.disagg.cluster_faults import Recovery, call_replica
from actors.disagg.cluster_placement import RequestPlacement
from actors.disagg.conductor import ConductorOptions, RequestRejected, default_conductor
from actors.disagg.decode import DecodeReplica
from actors.disagg.dualpath_placement import SCHEDULERS, DualPathPlacer
from actors.disagg.messages import (
    CacheEvent,
    DecodeStats,
    DecodeStep,
    Finished,
    PrefillDone,
    PrefillFailed,
    PrefillStats,
    PrefillStep,
    Report,
    ReservationLost,
    StoreLoad,
    TokenDelta,
)
from actors.disagg.pd_request import PDRequest
from actors.disagg.prefill import PrefillReplica
from actors.disagg.read_paths import ReadPaths
from actors.disagg.store_view import PDStore, StoreConfig
from actors.engine.config import EngineConfig
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_loop import split_cores
from actors.engine.request_builder import RequestBuilder
from actors.engine.request_limits import RequestLimits
from actors.engine.sampling import SamplingParams
from actors.kvstore.shard import KVStoreClient
from actors.ray_nodes import alive_nodes, pinned
from kernels.kv_cache import kv_cache_bytes_per_block
from models import load_tokenizer, tiny_model_dir
from models.config import read_model_config
from placement.nodes import Node, NodePlacement, ReplicaSpec, nodes_carrying
from policies.conductor import (
    Conductor,
    DecodeInstance,
    PrefillInstance,
)
from policies.dualpath import PREFILL_PATH
from policies.pd_costs import CostFitter
from policies.replica_stats import ReplicaStats
from policies.request import Request

REPORT_WAIT_S = 0.25  # a replica's long poll returns at the latest after this long


class PDCluster:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        num_prefill: int = 1,
        num_decode: int = 1,
        *,
        store: StoreConfig | None = None,
        conductor: Conductor | None = None,
        conductor_options: dict[str, Any] | None = None,
        fit_costs: bool = True,
        max_prefill_attempts: int = 3,
        pin_cores: bool = False,
        prefill_layout: dict[str, int] | None = None,
        decode_layout: dict[str, int] | None = None,
        read_path: str = PREFILL_PATH,
        scheduler: str = "mooncake",
        dualpath_thresholds: tuple[int, int] | None = None,
        prefill_replica_options: dict[str, Any] | None = None,
        decode_replica_options: dict[str, Any] | None = None,
        node_resources: dict[str, float] | None = None,
        **controller_options: Any,
    ) -> None:
        """``pin_cores``: on a one-node cluster, bind prefill and decode replicas to
        disjoint cores with one torch thread each (``split_cores``). ``prefill_layout`` /
        ``decode_layout``: ``tp`` and ``spp`` of each prefill / decode replica (over
        ``controller_options``); the two sides may differ. ``read_path`` (DualPath, with a
        store): where a stored prefix is read, ``"prefill"`` (storage -> the prefill
        replica), ``"decode"`` (storage -> the decode replica -> the prefill replica, layer
        by layer) or ``"dual"`` (per request, the side with the shorter read queue).
        ``scheduler``: ``"mooncake"`` (the Conductor's TTFT/TBT choice and admission) or
        ``"dualpath"`` (DualPath's rules, ``actors.disagg.dualpath_placement``: prefill
        replica by read queue and unfinished tokens, decode replica by the Z rule, read
        side by the shorter read queue in ``"dual"`` mode); ``dualpath_thresholds``: its
        (alpha, beta) in tokens, fixed (default: from the fitted cost model).
        ``prefill_replica_options`` / ``decode_replica_options``: more keyword arguments of
        the replica classes (``link_budget``, ``record_loads``)."""
        # a region's node resource: every actor of this cluster (replicas, their workers,
        # store shards) runs only on nodes that carry it, and its replicas reserve it
        self.node_resources = dict(node_resources or {})
        if self.node_resources:
            pinned_workers = controller_options.get("worker_resources") or {}
            controller_options["worker_resources"] = {**pinned_workers, **self.node_resources}
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("need at least one prefill and one decode replica")
        self.read_paths = ReadPaths(read_path)
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
        if read_path != PREFILL_PATH and store is None:
            raise ValueError(
                f"read_path={read_path!r} reads a KV store: give store=StoreConfig(...)"
            )
        self._prefill_extra = dict(prefill_replica_options or {})
        self._decode_extra = dict(decode_replica_options or {})
        self.path_counts = self.read_paths.counts  # requests read on each side
        self.model_dir = str(model_dir) if model_dir is not None else str(tiny_model_dir("dense"))
        config = EngineConfig.from_options(**controller_options)  # names a bad option
        if config.cpu_cores is not None:
            raise ValueError(
                "cpu_cores pins a colocated replica's engine thread; prefill and decode "
                "replicas do not take it yet: leave it unset for a disaggregated deployment"
            )
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.block_size = config.block_size
        self.dualpath: DualPathPlacer | None = None
        if scheduler == "dualpath":
            self.dualpath = DualPathPlacer(self.block_size, read_path, dualpath_thresholds)
        cfg = read_model_config(Path(self.model_dir))
        self.tokenizer = load_tokenizer(Path(self.model_dir))
        on_gpu = ray.cluster_resources().get("GPU", 0) >= 1
        self.block_bytes = kv_cache_bytes_per_block(
            cfg.num_hidden_layers,
            self.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            config.torch_dtype(on_gpu),
        )
        if conductor is not None and conductor_options:
            raise ValueError("give a conductor or conductor_options, not both")
        self.conductor = conductor or default_conductor(
            self.block_bytes, ConductorOptions(**(conductor_options or {}))
        )
        self.fitter: CostFitter | None = None
        if fit_costs:
            chunk = config.chunk_size or config.token_budget
            self.fitter = CostFitter(self.block_bytes, chunk_size=chunk)
        self.max_prefill_attempts = max_prefill_attempts
        # On a GPU cluster each prefill and decode worker holds one GPU (a one-worker
        # replica's worker runs in the replica actor, which then holds it); on CPU nothing
        # is reserved (the machine's cores are shared). Threaded actors: the Conductor's
        # long poll waits in one thread while other calls are served.
        self._prefill_options = {**controller_options, **(prefill_layout or {})}
        self._decode_options = {**controller_options, **(decode_layout or {})}
        worker = {"GPU": 1.0} if on_gpu else {}

        def workers(options: dict[str, Any]) -> int:
            return int(options.get("tp", 1)) * int(options.get("spp", 1))

        def actor_class(cls: type, options: dict[str, Any]) -> Any:
            gpus = worker.get("GPU", 0) if workers(options) == 1 else 0
            remote: Any = ray.remote  # its overloads do not name max_concurrency
            return remote(
                num_cpus=0,
                num_gpus=gpus,
                resources=self.node_resources,
                max_restarts=0,
                max_concurrency=4,
            )(cls)

        # Replicas and shards spread over the cluster's nodes (``placement.nodes``): with
        # several nodes prefill and decode run apart and stream KV over TCP.
        self.placement_plan = NodePlacement(self._nodes())
        self._prefill_ids = [f"p{i}" for i in range(num_prefill)]
        pw, dw = workers(self._prefill_options), workers(self._decode_options)
        self.placement_plan.place(
            [ReplicaSpec(p, "prefill", pw, worker) for p in self._prefill_ids]
            + [ReplicaSpec(f"d{j}", "decode", dw, worker) for j in range(num_decode)]
        )
        one_node = len(self.placement_plan.nodes) == 1
        self._cores = split_cores(num_prefill, num_decode) if pin_cores and one_node else {}
        self.store = PDStore(store, self.block_bytes, self.placement_plan) if store else None
        self.shards: dict[str, Any] = self.store.shards if self.store else {}
        self.store_client: KVStoreClient | None = self.store.client if self.store else None

        self._prefill_cls = actor_class(PrefillReplica, self._prefill_options)
        self._decode_cls = actor_class(DecodeReplica, self._decode_options)
        self.prefills: dict[str, Any] = {}
        self.prefill_views: dict[str, PrefillInstance] = {}
        self.prefill_reports: dict[str, PrefillStats] = {}
        self._local_cached: dict[str, set[int]] = {}
        self._prefill_nodes: dict[str, str] = {}
        self._polls: dict[Any, tuple[str, Any]] = {}  # poll ref -> (replica id, handle)
        self.recovery = Recovery(self)  # fault handling (``actors.disagg.cluster_faults``)
        self.placing = RequestPlacement(self)  # ``actors.disagg.cluster_placement``
        for pid in self._prefill_ids:
            self._start_prefill(pid)
        self.decodes: dict[str, Any] = {}
        self.decode_views: dict[str, DecodeInstance] = {}
        for j in range(num_decode):
            self._start_decode(f"d{j}")
        # One request may hold at most what the smallest decode pool holds.
        smallest = min(v.total_blocks for v in self.decode_views.values())
        self.limits = RequestLimits(
            cfg.vocab_size,
            config.context_len(cfg.max_position_embeddings),
            smallest * self.block_size,
        )
        self.builder = RequestBuilder(self.block_size, self.limits)
        self._reqs: dict[str, PDRequest] = {}
        self._by_key: dict[str, PDRequest] = {}
        self._retry: deque[str] = deque()
        self.num_prefill_restarts = 0
        self.num_decode_restarts = 0
        self.replicated_blocks = 0  # blocks copied into a chosen instance's home shard

    # -- set-up -----------------------------------------------------------------------------
    def _pinning(self, rid: str) -> dict[str, Any]:
        cores = self._cores.get(rid)
        return {"cpus": cores, "threads": len(cores)} if cores else {}

    def _start_prefill(self, pid: str) -> None:
        live = self.store.live() if self.store else {}
        handle = self._pinned(self._prefill_cls, pid, restart=pid in self.prefills).remote(
            pid,
            self.model_dir,
            live,
            **self._pinning(pid),
            **self._prefill_extra,
            **self._prefill_options,
        )
        self.prefills[pid] = handle
        self.prefill_views[pid] = PrefillInstance(pid)
        self._local_cached[pid] = set()
        self._prefill_nodes[pid] = ray.get(handle.node.remote())
        self._watch(pid, handle)

    def _start_decode(self, did: str) -> None:
        plan = self.placement_plan
        handle = self._pinned(self._decode_cls, did, restart=did in self.decodes).remote(
            did,
            self.model_dir,
            serve_tcp=plan.apart(did, self._prefill_ids),  # prefill elsewhere: over TCP
            tcp_host=plan.tcp_host(did),
            store_shards=self._decode_shards(),
            write_back=bool(self.store and self.store.cfg.write_back),
            **self._pinning(did),
            **self._decode_extra,
            **self._decode_options,
        )
        self.decodes[did] = handle
        self.decode_views[did] = DecodeInstance(did)
        report = ray.get(handle.report.remote(0.0))
        self._apply_stats(did, report.stats)
        self._watch(did, handle)

    def _decode_shards(self) -> dict[str, Any] | None:
        """The store shards a decode replica uses: to write back, or to read prefixes."""
        reads = self.read_paths.mode != PREFILL_PATH
        if self.store is None or not (self.store.cfg.write_back or reads):
            return None
        return self.store.live()

    def _nodes(self) -> list[Node]:
        """The live nodes this cluster's actors may use (a region's, when pinned)."""
        return nodes_carrying(alive_nodes(), self.node_resources)

    def _pinned(self, cls: Any, rid: str, restart: bool) -> Any:
        """``cls`` pinned to ``rid``'s node: hard at first, soft for a replacement (which
        moves off a node that is gone)."""
        if restart:
            return pinned(cls, self.placement_plan.replace(rid, self._nodes()), soft=True)
        return pinned(cls, self.placement_plan.node_id(rid))

    def _watch(self, rid: str, handle: Any) -> None:
        """Keep one long poll outstanding on a live replica."""
        self._polls[handle.report.remote(REPORT_WAIT_S)] = (rid, handle)

    def home_shard(self, pid: str) -> str | None:
        """The live store shard prefill replica ``pid`` writes to and counts as its own:
        one on its node (the node's prefill replicas spread over its shards), else any."""
        if self.store is None:
            return None
        node = self._prefill_nodes[pid]
        peers = sorted(p for p in self.prefills if self._prefill_nodes[p] == node)
        return self.store.home_shard(node, peers.index(pid))

    # -- requests ---------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and place a request (``submit_request``); returns its id."""
        request = self.builder.build(
            prompt_token_ids, params, salt=salt, request_id=request_id, arrival_time=arrival_time
        )
        return self.submit_request(request)

    def submit_request(self, request: Request) -> str:
        """Place a request (Conductor-scheduled, KV reserved on decode, prefill queued);
        raises RequestRejected when the SLOs cannot be met now."""
        if request.block_size != self.block_size:
            raise ValueError(f"the request was hashed in blocks of {request.block_size}")
        if request.request_id in self._reqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        req = PDRequest(request)
        self._reqs[request.request_id] = req  # a replica death while placing requeues it
        try:
            self.placing.place(req)
        except RequestRejected:
            del self._reqs[request.request_id]
            raise
        return request.request_id

    def placement(self, request_id: str) -> tuple[str | None, str | None]:
        """(prefill id, decode id) the Conductor chose for a request not yet released."""
        req = self._reqs[request_id]
        return req.prefill_id, req.decode_id

    def has_unfinished(self) -> bool:
        return any(r.output is None for r in self._reqs.values())

    def output(self, request_id: str) -> RequestOutput | None:
        return self._reqs[request_id].output

    def token_times(self, request_id: str) -> list[float]:
        """When the decode side produced each token streamed so far (``time.monotonic``)."""
        return list(self._reqs[request_id].token_times)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued for a retry, in prefill, or decoding); its
        output keeps the tokens streamed so far, finish reason ``"abort"``. Unknown or
        finished requests are left alone."""
        req = self._reqs.get(request_id)
        if req is None or req.output is not None:
            return
        if request_id in self._retry:
            self._retry.remove(request_id)
        self._stop_attempt(req)
        req.end()

    def _stop_attempt(self, req: PDRequest) -> None:
        """Abort the live attempt on its replicas (each frees what it holds for it)."""
        key = req.key
        if key is None:
            return
        for rid, handles in ((req.prefill_id, self.prefills), (req.decode_id, self.decodes)):
            if rid is None or (handles is self.prefills and not req.in_prefill):
                continue
            call_replica(handles[rid].abort, key)  # queued before any later call
        self._by_key.pop(key, None)
        self.read_paths.done(key)
        req.drop_attempt()

    def release(self, request_id: str) -> RequestOutput:
        out = self._reqs[request_id].output
        if out is None:
            raise ValueError(f"request {request_id!r} has not finished")
        del self._reqs[request_id]
        return out

    # -- reacting to the replicas -----------------------------------------------------------
    def poll(self, timeout: float = REPORT_WAIT_S) -> list[StreamDelta]:
        """Wait up to ``timeout`` s for replica reports, apply every one that arrived, place
        requests waiting for a retry; returns the tokens streamed meanwhile."""
        refs = list(self._polls)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        deltas: list[StreamDelta] = []
        for ref in ready:
            rid, handle = self._polls.pop(ref)
            try:
                report = ray.get(ref)
            except Exception:  # the actor died, or its loop failed
                self.recovery.replica_died(rid, handle)
                continue
            self._watch(rid, handle)
            deltas += self._apply(report)
        self.recovery.retry_pending()
        if self.fitter is not None:
            self.fitter.refit(self.conductor)
        return deltas

    def _apply(self, report: Report) -> list[StreamDelta]:
        rid = report.replica_id
        deltas: list[StreamDelta] = []
        fitter = self.fitter
        for e in report.events:
            if isinstance(e, TokenDelta):
                d = self._on_tokens(e)
                if d is not None:
                    deltas.append(d)
            elif isinstance(e, Finished):
                self._on_finished(e)
            elif isinstance(e, PrefillDone):
                self._on_prefill_done(e)
            elif isinstance(e, PrefillFailed):
                self.recovery.prefill_failed(e)
            elif isinstance(e, ReservationLost):
                self.recovery.reservation_lost(e)
            elif isinstance(e, CacheEvent):
                cached = self._local_cached[rid]
                (cached.add if e.stored else cached.discard)(e.block_hash)
            elif fitter is None:
                continue
            elif isinstance(e, PrefillStep):
                fitter.add_prefill_step(e.chunks, e.seconds)
            elif isinstance(e, StoreLoad):
                fitter.add_transfer(e.blocks, e.seconds)
            elif isinstance(e, DecodeStep):
                fitter.add_decode_step(e.batch, e.blocks, e.seconds)
        self._apply_stats(rid, report.stats)
        return deltas

    def _apply_stats(self, rid: str, stats: PrefillStats | DecodeStats) -> None:
        if isinstance(stats, PrefillStats):
            self.prefill_reports[rid] = stats
            self.prefill_views[rid].queued_tokens = stats.queued_tokens
            return
        view = self.decode_views[rid]
        view.num_running = stats.num_running
        view.used_blocks = stats.used_blocks
        view.pending = stats.pending
        view.pending_blocks = stats.pending_blocks
        view.total_blocks = stats.total_blocks

    def _on_prefill_done(self, e: PrefillDone) -> None:
        self.read_paths.done(e.key)
        req = self._by_key.get(e.key)
        if req is not None:
            req.in_prefill = False
            req.cached_tokens = e.cached_tokens

    def _on_tokens(self, e: TokenDelta) -> StreamDelta | None:
        req = self._by_key.get(e.key)
        return req.stream(e.delta, e.time) if req is not None else None

    def _on_finished(self, e: Finished) -> None:
        req = self._by_key.pop(e.key, None)
        if req is not None:
            req.finish(e.output)

    # -- batch API --------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Requests the Conductor
        turns away now are held back and placed as running ones finish. ``sampling_params``:
        one for all prompts, or one per prompt."""
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("give prompts or prompt_token_ids")
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            prompt_token_ids = [self.tokenizer.encode(t) for t in texts]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompt_token_ids):
                raise ValueError("give one sampling params per prompt")
            per_prompt = sampling_params
        else:
            per_prompt = [sampling_params or SamplingParams()] * len(prompt_token_ids)
        backlog = deque(zip((list(p) for p in prompt_token_ids), per_prompt, strict=True))
        ids: list[str] = []
        while backlog or self.has_unfinished():
            while backlog:
                try:
                    ids.append(self.submit(backlog[0][0], backlog[0][1], salt=salt))
                except RequestRejected:
                    if not self.has_unfinished():
                        raise
                    break
                backlog.popleft()
            self.poll()
        return [self.release(rid) for rid in ids]

    # -- observation and faults -------------------------------------------------------------
    def check_blocks(self) -> dict[str, int]:
        """Blocks in use per replica after each pool's integrity check (all 0 when idle)."""
        handles = {**self.prefills, **self.decodes}
        refs = [h.check_blocks.remote() for h in handles.values()]
        return dict(zip(handles, ray.get(refs), strict=True))

    def prefill_stats(self) -> dict[str, PrefillStats]:
        """Each prefill replica's state as of now (asked, not the last report)."""
        refs = [h.report_stats.remote() for h in self.prefills.values()]
        return dict(zip(self.prefills, ray.get(refs), strict=True))

    def stats(self, cache_hit_ratio: float = 0.0) -> ReplicaStats:
        """Pool-wide counters from the Conductor's views (a router's or a dashboard's)."""
        decodes = list(self.decode_views.values())
        total = sum(d.total_blocks for d in decodes)
        free = sum(d.total_blocks - d.used_blocks - d.pending_blocks for d in decodes)
        return ReplicaStats(
            num_running=sum(d.num_running for d in decodes),
            num_waiting=sum(r.in_prefill for r in self._reqs.values()) + len(self._retry),
            queued_prefill_tokens=sum(p.queued_tokens for p in self.prefill_views.values()),
            free_blocks=free,
            total_blocks=total,
            kv_usage=1.0 - free / total if total else 0.0,
            cache_hit_ratio=cache_hit_ratio,
            time=time.time(),
        )

    def cached_hashes(self) -> set[int]:
        """Block hashes a new request could reuse: any prefill replica's prefix cache, or
        any live store shard."""
        held = set().union(*self._local_cached.values())
        return held | self.store.all_blocks() if self.store else held

    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; dead shards are replaced by empty
        ones (``Recovery.refresh_store``); returns their ids."""
        return self.recovery.refresh_store()

    def shutdown(self) -> None:
        for handle in [*self.prefills.values(), *self.decodes.values()]:
            call_replica(handle.shutdown)
            ray.kill(handle)
        if self.store is not None:
            self.store.close()
