"""A prefill/decode-disaggregated deployment on Ray, driven by Mooncake's Conductor.

    cluster = PDCluster(PDClusterConfig(
        model_dir, engine=EngineConfig(...), prefill=PDSideConfig(count=1),
        store=StoreConfig(dram_bytes=..., ssd_bytes=..., ssd_dir=...),
        conductor=ConductorOptions(ttft_slo=..., tbt_slo=..., admission="early")))
    outs = cluster.generate(prompt_token_ids=[[...], ...], sampling_params=params)
    rid = cluster.submit(token_ids, params)   # raises RequestRejected (429) on overload
    cluster.waiting(rid) / cluster.refusal(rid)   # waiting for decode room / refused since
    cluster.poll(timeout) -> list[StreamDelta]; cluster.output(rid); cluster.shutdown()

Every prefill and decode replica runs its own loop in its own actor (``ReplicaSet`` starts
and replaces them); nothing here steps them. The Conductor (this object) places requests
and reacts to what the replicas report: ``poll`` waits on one outstanding long poll per
replica (``report``) and applies the events that arrived (prefill done or failed, tokens,
finished requests, measured steps, cache events, stats), and a replica whose poll fails is
dead.

Per request: the Conductor (``policies.conductor``) picks the prefill instance with the
lowest estimated TTFT (queue + prefill time, the cached prefix being what the instance's
own prefix cache and the KV store on its node hold) and the decode instance with the
lowest predicted TBT among those with room for the request's lifetime KV, or rejects it
(``actors.disagg.cluster_placement``; with ``scheduler="dualpath"`` DualPath's rules choose
instead). The decode replica reserves the blocks, the prefill replica computes the prompt while
streaming each layer's KV into them through the transfer layer (never through Ray), and
once its last prefill step returned it tells the decode replica to admit the request with
its first token (directly), which joins the decode batch at that replica's next step.
Control messages (ids, block ids, endpoints, tokens) are all Ray carries. A request
submitted with a ``ReturnRoute`` (a Serve ingress's, ``actors.engine.direct_return``)
streams nothing through here: its decode replica writes its tokens to that ingress, and
its report carries only the request's end (``relayed_tokens`` counts the tokens that did
come through the Conductor). Each attempt at a
request has its own key (``<request id>#<attempt>``, bound in the ``RequestTable``), so what
a replica reports about an attempt that was given up is dropped.

Store and replication (``actors.disagg.store_view``): each prefill replica writes new blocks to,
and counts as its own, a home shard on its node; prefixes the Conductor wants on the chosen
instance (``transfer_from``, ``replicate_blocks``) are copied there before its prefill.

With ``fit_costs`` (default) the Conductor's estimates are refitted (``CostFitter``) from
the steps and store loads this deployment measures, and decode steps measured under a
fitted model feed its TBT margin (``Conductor.observe_decode_step``). Replicas and
shards spread over the cluster's nodes (``placement.nodes``, ``actors.disagg.replica_set``).

A request that finds no decode room waits (``actors.disagg.decode_waits``: FIFO, bounded by
``decode_wait_s`` and ``decode_wait_max``) and is placed by a later ``poll`` once decode
blocks are free; past the bounds it is refused (``refusal``) with the 429 it would have got.

Faults (``actors.disagg.cluster_faults``): a dead store shard drops out of the map and
``refresh_store`` replaces it with an empty one; a dead prefill or decode replica is
replaced by a fresh actor and its requests run again from their prompt, never streaming a
token twice.

Superseded (a shared pool, ``config.pool``): another Conductor attached to the pool while
this one still runs (Serve starts a replacement while an unhealthy Conductor drains). The
replicas serve the new one only (``LoopedReplica.claim``); once a poll says so, this one
ends every request it holds (their callers replay them on the new Conductor), aborts their
attempts, and from then on places, polls, restarts and kills nothing of the pool.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import ray
import torch

from actors.disagg.cluster_config import PDClusterConfig
from actors.disagg.cluster_faults import Recovery
from actors.disagg.cluster_placement import RequestPlacement
from actors.disagg.conductor import RequestRejected, default_conductor
from actors.disagg.decode_waits import DecodeWaits
from actors.disagg.dualpath_placement import DualPathPlacer
from actors.disagg.elastic_pools import ElasticPools
from actors.disagg.messages import (
    CacheEvent,
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
    TokenGaps,
)
from actors.disagg.pd_request import PDRequest
from actors.disagg.read_paths import ReadPaths, storage_rates
from actors.disagg.replica_set import REPORT_WAIT_S, ReplicaSet, call_replica, plan_nodes
from actors.disagg.request_table import RequestTable
from actors.disagg.store_view import PDStore
from actors.engine.controller_builder import _num_blocks as pool_blocks
from actors.engine.direct_return import ReturnRoute
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_loop import Superseded
from actors.engine.request_builder import RequestBuilder
from actors.engine.request_limits import RequestLimits
from actors.engine.sampling import SamplingParams
from actors.kvstore.shard import KVStoreClient
from errors import EngineUnavailableError, InvalidRequestError
from models import load_tokenizer
from models.config import ModelConfig, read_model_config
from models.loader import expected_tensors
from models.weight_update import SharedWeights, checked_weights
from policies.conductor import Conductor, DecodeInstance, PrefillInstance
from policies.decode_wait import DecodeWaitQueue
from policies.dualpath import PREFILL_PATH
from policies.pd_costs import CostFitter
from policies.replica_stats import ReplicaStats
from policies.request import Request


class PDCluster:
    def __init__(self, config: PDClusterConfig) -> None:
        """Start the deployment ``config`` describes: store shards, then every prefill and
        decode replica (see the module doc)."""
        self.config = config
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.model_dir = config.model_folder()
        self.block_size = config.engine.block_size
        model = read_model_config(Path(self.model_dir))
        self.tokenizer = load_tokenizer(Path(self.model_dir))
        on_gpu = ray.cluster_resources().get("GPU", 0) >= 1
        self.block_bytes = config.kv_block_bytes(on_gpu)
        self.conductor = self._conductor()
        self.fitter = self._fitter()
        sides = config.prefill.link_budget, config.decode.link_budget
        rates = storage_rates(*sides, self.block_bytes)
        self.read_paths = ReadPaths(config.read_path, rates)
        self.path_counts = self.read_paths.counts  # requests read on each side
        self.dualpath: DualPathPlacer | None = None
        if config.scheduler == "dualpath":
            self.dualpath = DualPathPlacer(
                self.block_size, config.read_path, config.dualpath_thresholds
            )
        self.placement_plan = plan_nodes(config, on_gpu)
        store = config.store
        self.store = (
            PDStore(store, self.block_bytes, self.placement_plan, config.pool) if store else None
        )
        reads = self.read_paths.mode != PREFILL_PATH
        self.replicas = ReplicaSet(
            config, self.model_dir, self.placement_plan, self.store, on_gpu, reads
        )
        self.table = RequestTable()
        self.recovery = Recovery(
            self.table, self.replicas, self.read_paths, self.store, config.max_prefill_attempts
        )
        self.placing = RequestPlacement(
            self.table,
            self.replicas,
            self.recovery,
            self.conductor,
            self.store,
            self.read_paths,
            self.dualpath,
            self.block_size,
        )
        queue = DecodeWaitQueue(config.decode_wait_s, config.decode_wait_max)
        self.waits = DecodeWaits(
            queue, self.table, self.placing.place, self.conductor.min_retry_after
        )
        self.replicas.start_all()
        self.pools = ElasticPools(self.replicas, self.table, config.prefill, config.decode)
        self.limits = self._limits(model, config.engine.torch_dtype(on_gpu))
        self.builder = RequestBuilder(self.block_size, self.limits)
        self.superseded = False  # another Conductor claimed the pool's replicas
        self.relayed_tokens = 0  # tokens decode replicas reported here (unrouted requests)
        # the last poll's gaps between tokens of requests routed to their ingress
        self.token_gaps: list[float] = []

    # -- set-up -----------------------------------------------------------------------------
    def _conductor(self) -> Conductor:
        given = self.config.conductor
        return given if isinstance(given, Conductor) else default_conductor(self.block_bytes, given)

    def _fitter(self) -> CostFitter | None:
        """Refits the Conductor's estimates from measured steps (``fit_costs``)."""
        if not self.config.fit_costs:
            return None
        engine = self.config.engine
        return CostFitter(self.block_bytes, chunk_size=engine.chunk_size or engine.token_budget)

    def _limits(self, model: ModelConfig, dtype: torch.dtype) -> RequestLimits:
        """One request may hold at most what the smallest decode pool holds, and what a
        prefill replica's pool holds (its prompt is prefilled there whole; a side's
        ``kv_cache_memory`` may make that pool the smaller one)."""
        prefill = self.replicas.prefill_engine
        max_len = prefill.context_len(model.max_position_embeddings)
        prefill_blocks = pool_blocks(prefill, model, dtype, max_len)
        smallest = min([prefill_blocks] + [v.total_blocks for v in self.decode_views.values()])
        return RequestLimits(
            model.vocab_size,
            self.config.engine.context_len(model.max_position_embeddings),
            smallest * self.block_size,
        )

    # -- the replicas and the store, as tests and the engine read them ------------------------
    @property
    def prefills(self) -> dict[str, Any]:
        return self.replicas.prefills

    @property
    def decodes(self) -> dict[str, Any]:
        return self.replicas.decodes

    @property
    def prefill_views(self) -> dict[str, PrefillInstance]:
        return self.replicas.prefill_views

    @property
    def decode_views(self) -> dict[str, DecodeInstance]:
        return self.replicas.decode_views

    @property
    def prefill_reports(self) -> dict[str, PrefillStats]:
        return self.replicas.prefill_reports

    @property
    def shards(self) -> dict[str, Any]:
        return self.store.shards if self.store else {}

    @property
    def store_client(self) -> KVStoreClient | None:
        return self.store.client if self.store else None

    @property
    def num_prefill_restarts(self) -> int:
        return self.recovery.num_prefill_restarts

    @property
    def num_decode_restarts(self) -> int:
        return self.recovery.num_decode_restarts

    @property
    def replicated_blocks(self) -> int:
        """Blocks copied into a chosen instance's home shard."""
        return self.placing.replicated_blocks

    def home_shard(self, pid: str) -> str | None:
        return self.replicas.home_shard(pid)

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

    def submit_request(self, request: Request, route: ReturnRoute | None = None) -> str:
        """Place a request (Conductor-scheduled, KV reserved on decode, prefill queued), or
        queue it for decode room (``waiting``); raises RequestRejected when the SLOs
        cannot be met now or the wait queue is full. ``route``: its decode replica sends
        its tokens and end there, not through ``poll``."""
        if request.block_size != self.block_size:
            raise ValueError(f"the request was hashed in blocks of {request.block_size}")
        self._check_owner()
        if self.replicas.sleep_level is not None:
            raise InvalidRequestError("the cluster is asleep; call wake_up() first")
        request = RequestBuilder.at_weight_version(request, self.weight_version)
        req = PDRequest(request, route=route)
        self.table.add(req)  # a replica death while placing queues it again
        try:
            self.waits.submit(req)
        except RequestRejected:
            self.table.remove(request.request_id)
            raise
        return request.request_id

    def waiting(self, request_id: str) -> bool:
        """Accepted and waiting for decode room (not yet placed)."""
        return self.waits.waiting(request_id)

    def refusal(self, request_id: str) -> RequestRejected | None:
        """The 429 of a request that waited past the bounds, or was refused when its turn
        came (e.g. by the SLOs); it has ended without tokens. None: not refused."""
        return self.waits.refused.get(request_id)

    def placement(self, request_id: str) -> tuple[str | None, str | None]:
        """(prefill id, decode id) the Conductor chose for a request not yet released."""
        req = self.table[request_id]
        return req.prefill_id, req.decode_id

    def has_unfinished(self) -> bool:
        return self.table.has_unfinished()

    def output(self, request_id: str) -> RequestOutput | None:
        return self.table[request_id].output

    def token_times(self, request_id: str) -> list[float]:
        """When the decode side produced each token streamed so far (``time.monotonic``)."""
        return list(self.table[request_id].token_times)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued for a retry, in prefill, or decoding); its
        output keeps the tokens streamed so far, finish reason ``"abort"``. Unknown or
        finished requests are left alone."""
        req = self.table.get(request_id)
        if req is None or req.output is not None:
            return
        self.table.cancel_retry(request_id)
        self.waits.cancel(request_id)
        self._stop_attempt(req)
        req.end()

    def _stop_attempt(self, req: PDRequest) -> None:
        """Abort the live attempt on its replicas (each frees what it holds for it)."""
        key = req.key
        if key is None:
            return
        if req.prefill_id is not None and req.in_prefill:
            call_replica(self.prefills[req.prefill_id].abort, key)  # queued before later calls
        if req.decode_id is not None:
            call_replica(self.decodes[req.decode_id].abort, key)
        self.table.unbind(key)
        self.read_paths.done(key)
        req.drop_attempt()

    def release(self, request_id: str) -> RequestOutput:
        out = self.table[request_id].output
        if out is None:
            raise ValueError(f"request {request_id!r} has not finished")
        self.table.remove(request_id)
        self.waits.forget(request_id)
        return out

    # -- reacting to the replicas -----------------------------------------------------------
    def poll(self, timeout: float = REPORT_WAIT_S) -> list[StreamDelta]:
        """Wait up to ``timeout`` s for replica reports, apply every one that arrived, place
        requests waiting for a retry; returns the tokens streamed meanwhile (and keeps the
        routed requests' gaps between tokens in ``token_gaps`` until the next poll)."""
        self.token_gaps = []
        if self.superseded:
            return []
        polls = self.replicas.polls
        refs = list(polls)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        deltas: list[StreamDelta] = []
        for ref in ready:
            rid, handle = polls.pop(ref)
            try:
                report = ray.get(ref)
            except Superseded:  # alive, and another Conductor's now
                self.superseded = True
                continue
            except Exception:  # the actor died, or its loop failed
                self.recovery.replica_died(rid, handle)
                continue
            self.replicas.watch(rid, handle)
            deltas += self._apply(report)
        if self.superseded:
            self._leave_pool()
            return deltas
        self._retry_pending()
        self.waits.place_waiting()
        self.pools.step(time.monotonic())
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
            elif isinstance(e, TokenGaps):
                self.token_gaps += e.gaps
            elif isinstance(e, Finished):
                self._on_finished(e)
            elif isinstance(e, PrefillDone):
                self._on_prefill_done(e)
            elif isinstance(e, PrefillFailed):
                self.recovery.prefill_failed(e)
            elif isinstance(e, ReservationLost):
                self.recovery.reservation_lost(e)
            elif isinstance(e, CacheEvent):
                cached = self.replicas.local_cached[rid]
                (cached.add if e.stored else cached.discard)(e.block_hash)
            elif fitter is None:
                continue
            elif isinstance(e, PrefillStep):
                fitter.add_prefill_step(e.chunks, e.seconds)
            elif isinstance(e, StoreLoad):
                fitter.add_transfer(e.blocks, e.seconds)
            elif isinstance(e, DecodeStep):
                fitter.add_decode_step(e.batch, e.blocks, e.seconds)
                if fitter.num_fits["decode"]:  # against a fitted model, not the guess
                    self.conductor.observe_decode_step(e.batch, e.blocks, e.seconds)
        self.replicas.apply_stats(rid, report.stats)
        if report.leaving:
            self.pools.leave(rid, time.monotonic())
        return deltas

    def _leave_pool(self) -> None:
        """Superseded: end every request here with the tokens streamed so far (finish reason
        ``"abort"``: its caller replays it), abort its attempt, poll no replica again."""
        for req in self.table:
            self.abort(req.request_id)
        self.replicas.polls.clear()

    def _owns_replicas(self) -> bool:
        """Whether no live replica was claimed by another Conductor."""
        for handle in self.replicas.all_handles():
            try:
                ray.get(handle.report.remote(0.0, self.replicas.owner))
            except Superseded:
                return False
            except Exception:  # dead, or its loop failed: stopped here all the same
                continue
        return True

    def _check_owner(self) -> None:
        if self.superseded:
            raise EngineUnavailableError(
                "another Conductor serves this pool now; retry the request"
            )

    def _retry_pending(self) -> None:
        """Place the requests waiting to run again, in order; one turned away waits on."""
        for req in self.table.take_retries():
            try:
                self.placing.place(req)
            except RequestRejected:
                self.table.retry_later(req)

    def _on_prefill_done(self, e: PrefillDone) -> None:
        self.read_paths.done(e.key)
        req = self.table.attempt(e.key)
        if req is not None:
            req.in_prefill = False
            req.cached_tokens = e.cached_tokens

    def _on_tokens(self, e: TokenDelta) -> StreamDelta | None:
        self.relayed_tokens += len(e.delta.token_ids)
        req = self.table.attempt(e.key)
        return req.stream(e.delta, e.time) if req is not None else None

    def _on_finished(self, e: Finished) -> None:
        req = self.table.unbind(e.key)
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
        turns away now (or that waited past the bounds) are held back and placed as running
        ones finish. ``sampling_params``:
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
        prompts_ = [list(p) for p in prompt_token_ids]
        backlog = deque(range(len(prompts_)))  # prompt indices, in order
        ids: dict[int, str] = {}
        while backlog or self.has_unfinished():
            while backlog:
                i = backlog[0]
                try:
                    ids[i] = self.submit(prompts_[i], per_prompt[i], salt=salt)
                except RequestRejected:
                    if not self.has_unfinished():
                        raise
                    break
                backlog.popleft()
            self.poll()
            refused = sorted(i for i, rid in ids.items() if self.refusal(rid) is not None)
            for i in reversed(refused):  # waited past the bounds: held back again, in order
                self.release(ids.pop(i))
                backlog.appendleft(i)
        return [self.release(ids[i]) for i in range(len(prompts_))]

    # -- weights ----------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """Weight updates applied since start."""
        return len(self.replicas.weight_updates)

    def update_weights(self, weights: Any) -> None:
        """Load new weights into every prefill and decode replica, with no request in
        flight (``generate`` returns with none): checked here (InvalidRequestError, nothing
        changed), put in the object store once. Requests submitted after it hash their
        blocks with the new version, so no prefix cached, stored or streamed under the old
        weights is used again."""
        self._check_owner()
        if self.has_unfinished():
            raise RuntimeError("requests are in flight; update the weights between calls")
        tensors = checked_weights(expected_tensors(self.model_dir), weights)
        self.replicas.update_weights(ray.put(SharedWeights.of(tensors)))

    def sleep(self, level: int = 1) -> int:
        """Free every replica's KV cache (level 1), and its weights too (level 2), with no
        request in flight; ``submit`` refuses until ``wake_up``. A decode replica's cache
        keeps its shared-memory address (its pages are freed), so prefill workers reach it
        after the wake. The KV store's shards keep their blocks (keyed by weight version,
        so valid after the wake). Returns the bytes freed."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}")
        self._check_owner()
        if self.has_unfinished():
            raise RuntimeError("requests are in flight; sleep between calls")
        return self.replicas.sleep(level)

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed: the weights as last updated, empty KV caches."""
        self._check_owner()
        self.replicas.wake_up()

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
            num_waiting=self.table.num_waiting() + len(self.waits.queue),
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
        held = set().union(*self.replicas.local_cached.values())
        return held | self.store.all_blocks() if self.store else held

    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; dead shards are replaced by empty
        ones (``Recovery.refresh_store``); returns their ids."""
        return [] if self.superseded else self.recovery.refresh_store()

    def shutdown(self) -> None:
        """Stop every replica and shard; a superseded Conductor (found so now, if it has
        not polled since) leaves them to the pool's new one."""
        if self.config.pool is not None and not self.superseded:
            self.superseded = not self._owns_replicas()
        if self.superseded:
            return
        starting = [h for h, _ in self.replicas.starting.values()]
        for handle in [*self.replicas.all_handles(), *starting]:
            call_replica(handle.shutdown)
            ray.kill(handle)
        if self.store is not None:
            self.store.close()
