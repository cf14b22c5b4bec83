"""A prefill/decode-disaggregated deployment on Ray, driven by Mooncake's Conductor.

    cluster = PDCluster(model_dir, num_prefill=1, num_decode=1,
                        store=StoreConfig(dram_bytes=..., ssd_bytes=..., ssd_dir=...),
                        conductor_options=dict(ttft_slo=..., tbt_slo=..., admission="early"),
                        **controller_options)
    outs = cluster.generate(prompt_token_ids=[[...], ...], sampling_params=params)
    rid = cluster.submit(token_ids, params)   # raises RequestRejected (429) on overload
    cluster.step() -> list[StreamDelta]; cluster.output(rid); cluster.shutdown()

Per request: the Conductor (``policies.conductor``) picks the prefill instance with the
lowest estimated TTFT (queue + prefill time, the cached prefix being what the instance's
own prefix cache and the KV store on its node hold) and the decode instance with the
lowest predicted TBT among those with room for the request's lifetime KV, or rejects it.
The decode replica reserves the blocks, the prefill replica computes the prompt while
streaming each layer's KV into them through the transfer layer (never through Ray), and
once its last prefill step returned the request is admitted to the decode batch with its
first token. Control messages (ids, block ids, endpoints, tokens) are all Ray carries.

Store and replication (``actors.disagg.store_view``): each prefill replica writes new blocks to,
and counts as its own, a home shard on its node; prefixes the Conductor wants on the chosen
instance (``transfer_from``, ``replicate_blocks``) are copied there before its prefill.

With ``fit_costs`` (default) the Conductor's estimates are refitted (``CostFitter``) from
the steps and store loads this deployment measures. Replicas and shards spread over the
cluster's nodes (``placement.nodes``).

Faults: a dead store shard drops out of the map (its blocks are recomputed). A dead prefill
replica's decode reservations are cancelled; a dead decode replica's requests run again
from their prompt, never streaming a token twice (seeded sampling draws the same tokens).
Either is replaced by a fresh actor and its requests are placed again.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.disagg.conductor import RequestRejected, default_conductor
from actors.disagg.decode import DecodeReplica
from actors.disagg.prefill import PrefillReplica
from actors.disagg.store_view import DEAD, PDStore, StoreConfig
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.sampling import SamplingParams
from actors.kvstore.shard import KVStoreClient
from kernels.kv_cache import kv_cache_bytes_per_block
from models import load_tokenizer, tiny_model_dir
from models.config import read_model_config
from placement.nodes import NodePlacement
from policies.conductor import (
    Conductor,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
    apply_decision,
)
from policies.pd_costs import CostFitter
from store.hashing import chained_block_hashes


@dataclass
class _Req:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    seed: int
    salt: str | None
    prefill_id: str | None = None
    decode_id: str | None = None
    attempts: int = 0
    deltas: list[StreamDelta] = field(default_factory=list)
    output: RequestOutput | None = None
    loaded_blocks: int = 0
    cached_tokens: int = 0
    emitted: int = 0  # tokens streamed to the caller over every attempt
    arrival_time: float = 0.0  # this process's monotonic clock, like the two below
    first_token_time: float | None = None
    replayed: int = 0  # tokens this attempt produced (a re-run replays emitted ones)


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
        **controller_options: Any,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("need at least one prefill and one decode replica")
        self.model_dir = str(model_dir) if model_dir is not None else str(tiny_model_dir("dense"))
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.options = controller_options
        self.block_size = int(controller_options.get("block_size", 16))
        cfg = read_model_config(Path(self.model_dir))
        self.tokenizer = load_tokenizer(Path(self.model_dir))
        import torch

        dtype = controller_options.get("dtype") or torch.float32
        self.block_bytes = kv_cache_bytes_per_block(
            cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
        if conductor is not None and conductor_options:
            raise ValueError("give a conductor or conductor_options, not both")
        self.conductor = conductor or default_conductor(
            self.block_bytes, **(conductor_options or {})
        )
        chunk = controller_options.get("chunk_size") or controller_options.get("token_budget")
        self.fitter: CostFitter | None = None
        if fit_costs:
            self.fitter = CostFitter(self.block_bytes, chunk_size=int(chunk or 2048))
        self.max_prefill_attempts = max_prefill_attempts
        # Replicas and shards spread over the cluster's nodes: prefill replica i on node
        # i, decode replica j on node num_prefill + j (modulo the node count), so with
        # several nodes prefill and decode run apart and stream KV over TCP.
        self.placement_plan = NodePlacement()
        self._prefill_ids = [f"p{i}" for i in range(num_prefill)]
        for i, rid in enumerate(self._prefill_ids + [f"d{j}" for j in range(num_decode)]):
            self.placement_plan.assign(rid, i)
        self.store = PDStore(store, self.block_bytes, self.placement_plan) if store else None
        self.shards: dict[str, Any] = self.store.shards if self.store else {}
        self.store_client: KVStoreClient | None = self.store.client if self.store else None
        # On a GPU cluster each prefill and decode replica holds one GPU (its worker runs
        # there); on CPU they take no CPU reservation (the machine's cores are shared).
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        self._prefill_cls = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(PrefillReplica)
        self._decode_cls = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(DecodeReplica)
        self.prefills: dict[str, Any] = {}
        self.prefill_views: dict[str, PrefillInstance] = {}
        self._local_cached: dict[str, set[int]] = {}
        self._prefill_nodes: dict[str, str] = {}
        for i in range(num_prefill):
            self._start_prefill(f"p{i}")
        self.decodes: dict[str, Any] = {}
        self.decode_views: dict[str, DecodeInstance] = {}
        for i in range(num_decode):
            self._start_decode(f"d{i}")
        self._reqs: dict[str, _Req] = {}
        self._in_prefill: dict[str, set[str]] = {p: set() for p in self.prefills}
        self._retry: deque[str] = deque()
        self._ids = 0
        self._seeds = random.Random()
        self.num_prefill_restarts = 0
        self.num_decode_restarts = 0
        self.replicated_blocks = 0  # blocks copied into a chosen instance's home shard

    # -- set-up -----------------------------------------------------------------------------
    def _start_prefill(self, pid: str) -> None:
        live = self.store.live() if self.store else {}
        cls = self.placement_plan.options(self._prefill_cls, pid, restart=pid in self.prefills)
        handle = cls.remote(pid, self.model_dir, live, **self.options)
        self.prefills[pid] = handle
        self.prefill_views[pid] = PrefillInstance(pid)
        self._local_cached[pid] = set()
        self._prefill_nodes[pid] = ray.get(handle.node.remote())

    def _start_decode(self, did: str) -> None:
        plan = self.placement_plan
        handle = plan.options(self._decode_cls, did, restart=did in self.decodes).remote(
            did,
            self.model_dir,
            serve_tcp=plan.apart(did, self._prefill_ids),  # prefill elsewhere: over TCP
            tcp_host=plan.tcp_host(did),
            **self.options,
        )
        self.decodes[did] = handle
        self.decode_views[did] = DecodeInstance(did)
        self._update_decode(did, ray.get(handle.stats.remote()))

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
        """Place a request (validated, Conductor-scheduled, KV reserved on decode, prefill
        queued); raises RequestRejected when the SLOs cannot be met now. ``arrival_time``
        (``time.monotonic()``, default now) starts the output's TTFT."""
        tokens = list(prompt_token_ids)
        first_decode = next(iter(self.decodes.values()))
        ray.get(first_decode.validate.remote(tokens, params))
        if request_id is None:
            request_id = f"pd-{self._ids}"
            self._ids += 1
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = _Req(request_id, tokens, params, seed, salt)
        req.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._place(req)
        self._reqs[request_id] = req
        return request_id

    def _place(self, req: _Req) -> None:
        now = time.monotonic()
        creq = ConductorRequest(
            req.request_id,
            chained_block_hashes(req.tokens, self.block_size, req.salt),
            len(req.tokens),
            req.params.max_tokens,
            self.block_size,
        )
        if self.store is not None:
            self.store.refresh()
        prefills = []
        for pid, view in self.prefill_views.items():
            view.cached = self._local_cached[pid] | self._home_blocks(pid)
            prefills.append(view)
        decodes = list(self.decode_views.values())
        decision = self.conductor.schedule(creq, prefills, decodes, now)
        if not decision.accepted:
            raise RequestRejected(decision.reason, decision.retry_after or 1.0)
        pid, did = decision.prefill_id, decision.decode_id
        assert pid is not None and did is not None
        decode = self.decodes[did]
        try:
            dest = ray.get(
                decode.reserve.remote(req.request_id, req.tokens, req.params, req.seed, req.salt)
            )
            self._update_decode(did, ray.get(decode.stats.remote()))
        except DEAD:
            self._decode_died(did)
            raise RequestRejected("decode_restarting", self.conductor.min_retry_after) from None
        if dest is None:  # the view was stale: the instance has no room now
            raise RequestRejected("decode_full", self.conductor.min_retry_after)
        wanted = decision.replicate_blocks
        if decision.transfer_from is not None:  # this request reads the copied prefix
            mine = self.prefill_views[pid].cached
            wanted = [h for h in creq.block_hashes[: decision.cached_blocks] if h not in mine]
        source = decision.replicate_from or decision.transfer_from
        apply_decision(decision, creq, prefills, decodes, now)
        if wanted and source is not None:
            self._copy_blocks(req, wanted, source, pid)
        req.prefill_id, req.decode_id = pid, did
        req.attempts += 1
        req.replayed = 0
        self._in_prefill[pid].add(req.request_id)
        self.prefills[pid].prefill.remote(
            req.request_id, req.tokens, req.params, req.seed, dest, req.salt, self.home_shard(pid)
        )

    def _home_blocks(self, pid: str) -> set[int]:
        return self.store.blocks_of(self.home_shard(pid)) if self.store else set()

    def _copy_blocks(self, req: _Req, hashes: list[int], src_pid: str, dst_pid: str) -> None:
        """Copy blocks the Conductor wants on ``dst_pid`` into its home shard, from a shard
        (``src_pid``'s home first) or out of ``src_pid``'s own cache."""
        dst = self.home_shard(dst_pid)
        if self.store is None or dst is None:
            return  # no store: nowhere to copy to

        def export(rest: list[int]) -> int:
            try:
                n: int = ray.get(
                    self.prefills[src_pid].export_blocks.remote(req.tokens, req.salt, rest, dst)
                )
                return n
            except DEAD:
                return 0  # its death is handled at the next step

        home = self.home_shard(src_pid)
        self.replicated_blocks += self.store.copy_blocks(hashes, dst, home, export)

    def placement(self, request_id: str) -> tuple[str | None, str | None]:
        """(prefill id, decode id) the Conductor chose for a request not yet released."""
        req = self._reqs[request_id]
        return req.prefill_id, req.decode_id

    def has_unfinished(self) -> bool:
        return any(r.output is None for r in self._reqs.values())

    def output(self, request_id: str) -> RequestOutput | None:
        return self._reqs[request_id].output

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued for a retry, in prefill, or decoding); its
        output keeps the tokens streamed so far, finish reason ``"abort"``. Unknown or
        finished requests are left alone."""
        req = self._reqs.get(request_id)
        if req is None or req.output is not None:
            return
        if request_id in self._retry:
            self._retry.remove(request_id)
        if req.prefill_id is not None and request_id in self._in_prefill.get(req.prefill_id, ()):
            self._in_prefill[req.prefill_id].discard(request_id)
            try:
                ray.get(self.prefills[req.prefill_id].abort.remote(request_id))
            except DEAD:
                pass  # its death is handled at the next step
        if req.decode_id is not None:
            decode = self.decodes[req.decode_id]
            ray.get(decode.abort.remote(request_id))
            self._update_decode(req.decode_id, ray.get(decode.stats.remote()))
        tokens = [t for d in req.deltas for t in d.token_ids]
        text = "".join(d.text for d in req.deltas)
        req.output = RequestOutput(
            request_id, req.tokens, tokens, text, True, "abort", req.cached_tokens
        )

    def release(self, request_id: str) -> RequestOutput:
        out = self._reqs[request_id].output
        if out is None:
            raise ValueError(f"request {request_id!r} has not finished")
        del self._reqs[request_id]
        return out

    # -- one round --------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One step on every replica with work (in parallel); returns the decode deltas."""
        calls: list[tuple[str, str, Any, Any]] = []  # (kind, replica id, handle, ref)
        for pid, rids in self._in_prefill.items():
            if rids:
                handle = self.prefills[pid]
                calls.append(("p", pid, handle, handle.step.remote()))
        busy = {r.decode_id for r in self._reqs.values() if r.output is None and r.decode_id}
        for did in sorted(d for d in busy if d is not None):
            handle = self.decodes[did]
            calls.append(("d", did, handle, handle.step.remote()))
        deltas: list[StreamDelta] = []
        for kind, iid, handle, ref in calls:
            try:
                report = ray.get(ref)
            except DEAD:
                if kind == "p" and self.prefills.get(iid) is handle:
                    self._prefill_died(iid)
                elif kind == "d" and self.decodes.get(iid) is handle:  # not replaced yet
                    self._decode_died(iid)
                continue
            if kind == "p":
                deltas += self._on_prefill(iid, report)
            else:
                deltas += self._on_decode(iid, report)
        self._retry_pending()
        if self.fitter is not None:
            self.fitter.refit(self.conductor)
        return deltas

    def _on_prefill(self, pid: str, report: dict[str, Any]) -> list[StreamDelta]:
        self._update_prefill(pid, report["stats"])
        if self.fitter is not None:
            for chunks, seconds in report["costs"]["prefill_steps"]:
                self.fitter.add_prefill_step(chunks, seconds)
            for blocks, seconds in report["costs"]["transfers"]:
                self.fitter.add_transfer(blocks, seconds)
        deltas: list[StreamDelta] = []
        for rid, first_token, cached in report["done"]:
            if rid not in self._in_prefill[pid]:
                continue  # aborted, or placed again since
            self._in_prefill[pid].discard(rid)
            req = self._reqs[rid]
            req.cached_tokens = cached
            assert req.decode_id is not None
            did = req.decode_id
            try:
                admitted = ray.get(self.decodes[did].admit.remote(rid, first_token))
            except DEAD:
                self._decode_died(did)
                continue
            deltas += self._on_decode(did, admitted)
        for rid, _why in report["failed"]:  # its stream broke: the decode side is gone
            if rid not in self._in_prefill[pid]:
                continue
            req = self._reqs[rid]
            assert req.decode_id is not None
            if not self._alive(self.decodes[req.decode_id]):
                self._decode_died(req.decode_id)  # places this request again
            else:  # a broken transfer to a live replica: free its side, run it again
                self._in_prefill[pid].discard(rid)
                ray.get(self.decodes[req.decode_id].cancel.remote(rid))
                self._requeue(req)
        return deltas

    def _on_decode(self, did: str, report: dict[str, Any]) -> list[StreamDelta]:
        self._update_decode(did, report["stats"])
        if self.fitter is not None:
            for batch, blocks, seconds in report["costs"]["decode_steps"]:
                self.fitter.add_decode_step(batch, blocks, seconds)
        # A request placed elsewhere since (its replica was replaced) ignores this report.
        deltas: list[StreamDelta] = []
        for d in report["deltas"]:
            req = self._reqs.get(d.request_id)
            if req is None or req.decode_id != did:
                continue
            # A re-run replays the tokens already streamed: pass on only new ones.
            old = max(0, min(len(d.token_ids), req.emitted - req.replayed))
            req.replayed += len(d.token_ids)
            if old == len(d.token_ids) and not d.finished:
                continue
            if old:
                d = StreamDelta(d.request_id, d.token_ids[old:], "", d.finished, d.finish_reason)
            req.emitted += len(d.token_ids)
            if req.first_token_time is None and d.token_ids:
                req.first_token_time = time.monotonic()
            req.deltas.append(d)
            deltas.append(d)
        for out in report["finished"]:
            req = self._reqs.get(out.request_id)
            if req is not None and req.decode_id == did:
                # Times on this process's clock (the replicas' may differ), prefix reuse
                # as the prefill side saw it.
                out.num_cached_tokens = req.cached_tokens
                out.arrival_time, out.first_token_time = req.arrival_time, req.first_token_time
                out.finish_time = time.monotonic()
                req.output = out
        return deltas

    @staticmethod
    def _alive(handle: Any) -> bool:
        try:
            ray.get(handle.ping.remote())
        except DEAD:
            return False
        return True

    def _requeue(self, req: _Req) -> None:
        """Place a request again from its prompt (aborted after ``max_prefill_attempts``)."""
        req.prefill_id = req.decode_id = None
        if req.attempts >= self.max_prefill_attempts:
            tokens = [t for d in req.deltas for t in d.token_ids]
            req.output = RequestOutput(req.request_id, req.tokens, tokens, "", True, "abort")
        else:
            self._retry.append(req.request_id)

    def _decode_died(self, did: str) -> None:
        """Replace the replica; every request bound to it runs again from its prompt (those
        still in prefill are stopped there first)."""
        lost = [r for r in self._reqs.values() if r.decode_id == did and r.output is None]
        for req in lost:
            pid = req.prefill_id
            if pid is not None and req.request_id in self._in_prefill.get(pid, ()):
                self._in_prefill[pid].discard(req.request_id)
                try:
                    ray.get(self.prefills[pid].abort.remote(req.request_id))
                except DEAD:
                    pass  # its death is handled at its next step
        try:
            ray.kill(self.decodes[did])
        except DEAD:
            pass
        self.num_decode_restarts += 1
        self._start_decode(did)
        for req in lost:
            self._requeue(req)

    def _prefill_died(self, pid: str) -> None:
        """Cancel the decode reservations of its requests, replace it, schedule them again."""
        lost = sorted(self._in_prefill.pop(pid, set()))
        for rid in lost:
            req = self._reqs[rid]
            assert req.decode_id is not None
            decode = self.decodes[req.decode_id]
            try:
                ray.get(decode.cancel.remote(rid))
                self._update_decode(req.decode_id, ray.get(decode.stats.remote()))
            except DEAD:
                self._decode_died(req.decode_id)  # places its requests (this one) again
        self.num_prefill_restarts += 1
        self._start_prefill(pid)
        self._in_prefill[pid] = set()
        for rid in lost:
            req = self._reqs[rid]
            if req.decode_id is not None:  # not placed again by a decode restart above
                self._requeue(req)

    def _retry_pending(self) -> None:
        for _ in range(len(self._retry)):
            rid = self._retry.popleft()
            try:
                self._place(self._reqs[rid])
            except RequestRejected:
                self._retry.append(rid)

    def _update_prefill(self, pid: str, stats: dict[str, Any]) -> None:
        view = self.prefill_views[pid]
        view.queued_tokens = stats["queued_tokens"]
        cached = self._local_cached[pid]
        for kind, h in stats["pool_events"]:
            if kind == "stored":
                cached.add(h)
            else:
                cached.discard(h)

    def _update_decode(self, did: str, stats: dict[str, Any]) -> None:
        view = self.decode_views[did]
        view.num_running = stats["num_running"]
        view.used_blocks = stats["used_blocks"]
        view.pending = stats["pending"]
        view.pending_blocks = stats["pending_blocks"]
        view.total_blocks = stats["total_blocks"]

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
            self.step()
        return [self.release(rid) for rid in ids]

    # -- observation and faults -------------------------------------------------------------
    def check_blocks(self) -> dict[str, int]:
        """Blocks in use per replica after each pool's integrity check (all 0 when idle)."""
        handles = {**self.prefills, **self.decodes}
        refs = [h.check_blocks.remote() for h in handles.values()]
        return dict(zip(handles, ray.get(refs), strict=True))

    def prefill_stats(self) -> dict[str, dict[str, Any]]:
        refs = [h.stats.remote() for h in self.prefills.values()]
        return dict(zip(self.prefills, ray.get(refs), strict=True))

    def stats(self) -> dict[str, Any]:
        """Pool-wide counters from the Conductor's views (a router's or a dashboard's)."""
        decodes = list(self.decode_views.values())
        total = sum(d.total_blocks for d in decodes)
        free = sum(d.total_blocks - d.used_blocks - d.pending_blocks for d in decodes)
        return {
            "num_running": sum(d.num_running for d in decodes),
            "num_waiting": sum(len(r) for r in self._in_prefill.values()) + len(self._retry),
            "queued_prefill_tokens": sum(p.queued_tokens for p in self.prefill_views.values()),
            "free_blocks": free,
            "total_blocks": total,
            "kv_usage": 1.0 - free / total if total else 0.0,
        }

    def cached_hashes(self) -> set[int]:
        """Block hashes a new request could reuse: any prefill replica's prefix cache, or
        any live store shard."""
        held = set().union(*self._local_cached.values())
        return held | self.store.all_blocks() if self.store else held

    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; returns shards found dead."""
        return self.store.refresh() if self.store is not None else []

    def shutdown(self) -> None:
        for handle in [*self.prefills.values(), *self.decodes.values()]:
            try:
                ray.get(handle.shutdown.remote())
            except DEAD:
                pass
            ray.kill(handle)
        if self.store is not None:
            self.store.close()
