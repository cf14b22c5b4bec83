"""A prefill/decode-disaggregated deployment on Ray, driven by Mooncake's Conductor.

    cluster = PDCluster(model_dir, num_prefill=1, num_decode=1,
                        store=StoreConfig(dram_bytes=..., ssd_bytes=..., ssd_dir=...),
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

Faults: a store shard that died drops out of every client's map and its blocks read as
misses (recomputed). A prefill replica that died has the decode reservations of its
requests cancelled (no leaked blocks); it is replaced by a fresh actor and its requests are
scheduled again.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.kv_store_shard import KVStoreClient, kv_store_shard_actor
from actors.outputs import RequestOutput, StreamDelta
from actors.pd_decode import DecodeReplica
from actors.pd_prefill import PrefillReplica
from actors.sampling import SamplingParams
from errors import MeridianError
from kernels.kv_cache import kv_cache_bytes_per_block
from models import load_tokenizer, tiny_model_dir
from models.config import read_model_config
from policies.conductor import (
    Conductor,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
    apply_decision,
)
from policies.pd_costs import LinearDecodeTBT, LinearPrefillTime, transfer_time_fn
from store.hashing import chained_block_hashes

DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


class RequestRejected(MeridianError):
    """The deployment cannot meet its latency objectives for this request now; retry after
    ``retry_after`` seconds (HTTP 429 with Retry-After)."""

    http_status = 429

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(
            f"overloaded ({reason}): the deployment cannot serve this request within its "
            f"latency objectives now; retry after {retry_after:.1f} s"
        )
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class StoreConfig:
    """KV store shards of the deployment (one per node; ``num_shards`` on this node)."""

    dram_bytes: int = 64 << 20
    ssd_bytes: int = 0
    ssd_dir: str | None = None  # a folder per shard is made under it
    num_shards: int = 1


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


def default_conductor(block_bytes: int, admission: str = "none") -> Conductor:
    """Generous SLOs and CPU-scale estimates; pass a Conductor with fitted regressions
    (``policies.pd_costs``) and real SLOs to admit by them."""
    return Conductor(
        prefill_time=LinearPrefillTime(base=2e-3, per_new_token=2e-4, per_cached_token=1e-6),
        decode_tbt=LinearDecodeTBT(base=5e-3, per_request=1e-4, per_block=1e-6),
        transfer_time=transfer_time_fn(block_bytes, bytes_per_second=4e9),
        ttft_slo=60.0,
        tbt_slo=10.0,
        admission=admission,
    )


class PDCluster:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        num_prefill: int = 1,
        num_decode: int = 1,
        *,
        store: StoreConfig | None = None,
        conductor: Conductor | None = None,
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
        self.conductor = conductor or default_conductor(self.block_bytes)
        self.max_prefill_attempts = max_prefill_attempts
        self.shards: dict[str, Any] = {}
        self.store_client: KVStoreClient | None = None
        if store is not None:
            self._start_store(store)
        self._prefill_cls = ray.remote(num_cpus=0, max_restarts=0)(PrefillReplica)
        decode_cls = ray.remote(num_cpus=0, max_restarts=0)(DecodeReplica)
        self.prefills: dict[str, Any] = {}
        self.prefill_views: dict[str, PrefillInstance] = {}
        self._local_cached: dict[str, set[int]] = {}
        for i in range(num_prefill):
            self._start_prefill(f"p{i}")
        self.decodes: dict[str, Any] = {
            f"d{i}": decode_cls.remote(f"d{i}", self.model_dir, **controller_options)
            for i in range(num_decode)
        }
        self.decode_views = {d: DecodeInstance(d) for d in self.decodes}
        for d, stats in zip(
            self.decodes, ray.get([h.stats.remote() for h in self.decodes.values()]), strict=True
        ):
            self._update_decode(d, stats)
        ray.get([h.ping.remote() for h in self.prefills.values()])
        self._reqs: dict[str, _Req] = {}
        self._in_prefill: dict[str, set[str]] = {p: set() for p in self.prefills}
        self._retry: deque[str] = deque()
        self._ids = 0
        self._seeds = random.Random()
        self.num_prefill_restarts = 0

    # -- set-up -----------------------------------------------------------------------------
    def _start_store(self, cfg: StoreConfig) -> None:
        shard_cls = kv_store_shard_actor()
        for i in range(cfg.num_shards):
            ssd_dir = None
            if cfg.ssd_bytes > 0:
                if cfg.ssd_dir is None:
                    raise ValueError("StoreConfig.ssd_bytes > 0 needs ssd_dir")
                folder = Path(cfg.ssd_dir) / f"shard-{i}"
                folder.mkdir(parents=True, exist_ok=True)
                ssd_dir = str(folder)
            self.shards[f"s{i}"] = shard_cls.remote(
                f"s{i}", self.block_bytes, cfg.dram_bytes, cfg.ssd_bytes, ssd_dir
            )
        self.store_client = KVStoreClient("pd-conductor")
        for sid, handle in self.shards.items():
            self.store_client.add_shard(sid, handle)

    def _start_prefill(self, pid: str) -> None:
        live = self._live_shards()
        self.prefills[pid] = self._prefill_cls.remote(pid, self.model_dir, live, **self.options)
        self.prefill_views[pid] = PrefillInstance(pid)
        self._local_cached[pid] = set()

    def _live_shards(self) -> dict[str, Any]:
        if self.store_client is None:
            return {}
        return {s: h for s, h in self.shards.items() if s in self.store_client.handles}

    # -- requests ---------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        salt: str | None = None,
    ) -> str:
        """Place a request (validated, Conductor-scheduled, KV reserved on decode, prefill
        queued); raises RequestRejected when the SLOs cannot be met now."""
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
        store_held: set[int] = set()
        if self.store_client is not None:
            self.store_client.refresh()
            for sid in self.store_client.directory.shards:
                store_held |= self.store_client.directory.blocks_of(sid)
        prefills = []
        for pid, view in self.prefill_views.items():
            view.cached = self._local_cached[pid] | store_held
            prefills.append(view)
        decodes = list(self.decode_views.values())
        decision = self.conductor.schedule(creq, prefills, decodes, now)
        if not decision.accepted:
            raise RequestRejected(decision.reason, decision.retry_after or 1.0)
        assert decision.prefill_id is not None and decision.decode_id is not None
        decode = self.decodes[decision.decode_id]
        dest = ray.get(
            decode.reserve.remote(req.request_id, req.tokens, req.params, req.seed, req.salt)
        )
        self._update_decode(decision.decode_id, ray.get(decode.stats.remote()))
        if dest is None:  # the view was stale: the instance has no room now
            raise RequestRejected("decode_full", self.conductor.min_retry_after)
        apply_decision(decision, creq, prefills, decodes, now)
        req.prefill_id, req.decode_id = decision.prefill_id, decision.decode_id
        req.attempts += 1
        self._in_prefill[decision.prefill_id].add(req.request_id)
        self.prefills[decision.prefill_id].prefill.remote(
            req.request_id, req.tokens, req.params, req.seed, dest, req.salt
        )

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
        calls: list[tuple[str, str, Any]] = []
        for pid, rids in self._in_prefill.items():
            if rids:
                calls.append(("p", pid, self.prefills[pid].step.remote()))
        busy = {r.decode_id for r in self._reqs.values() if r.output is None and r.decode_id}
        for did in busy:
            if did is not None:
                calls.append(("d", did, self.decodes[did].step.remote()))
        deltas: list[StreamDelta] = []
        for kind, iid, ref in calls:
            try:
                report = ray.get(ref)
            except DEAD:
                if kind == "p":
                    self._prefill_died(iid)
                    continue
                raise
            if kind == "p":
                self._on_prefill(iid, report)
            else:
                deltas += self._on_decode(iid, report)
        self._retry_pending()
        return deltas

    def _on_prefill(self, pid: str, report: dict[str, Any]) -> None:
        self._update_prefill(pid, report["stats"])
        for rid, first_token, cached in report["done"]:
            self._in_prefill[pid].discard(rid)
            req = self._reqs[rid]
            req.cached_tokens = cached
            assert req.decode_id is not None
            decode = self.decodes[req.decode_id]
            self._on_decode(req.decode_id, ray.get(decode.admit.remote(rid, first_token)))
        for rid, _why in report["failed"]:  # its decode replica is gone
            self._in_prefill[pid].discard(rid)
            req = self._reqs[rid]
            req.output = RequestOutput(rid, req.tokens, [], "", True, "abort")

    def _on_decode(self, did: str, report: dict[str, Any]) -> list[StreamDelta]:
        self._update_decode(did, report["stats"])
        for out in report["finished"]:
            req = self._reqs.get(out.request_id)
            if req is not None:
                req.output = out
        for d in report["deltas"]:
            req = self._reqs.get(d.request_id)
            if req is not None:
                req.deltas.append(d)
        deltas: list[StreamDelta] = report["deltas"]
        return deltas

    def _prefill_died(self, pid: str) -> None:
        """Cancel the decode reservations of its requests, replace it, schedule them again."""
        lost = sorted(self._in_prefill.pop(pid, set()))
        for rid in lost:
            req = self._reqs[rid]
            assert req.decode_id is not None
            decode = self.decodes[req.decode_id]
            ray.get(decode.cancel.remote(rid))
            self._update_decode(req.decode_id, ray.get(decode.stats.remote()))
            req.prefill_id = req.decode_id = None
        self.num_prefill_restarts += 1
        self._start_prefill(pid)
        self._in_prefill[pid] = set()
        for rid in lost:
            req = self._reqs[rid]
            if req.attempts >= self.max_prefill_attempts:
                req.output = RequestOutput(rid, req.tokens, [], "", True, "abort")
            else:
                self._retry.append(rid)

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
        if self.store_client is not None:
            for sid in self.store_client.directory.shards:
                held |= self.store_client.directory.blocks_of(sid)
        return held

    def refresh_store(self) -> list[str]:
        """Apply shard events to the Conductor's map; returns shards found dead."""
        return self.store_client.refresh() if self.store_client is not None else []

    def shutdown(self) -> None:
        for handle in [*self.prefills.values(), *self.decodes.values()]:
            try:
                ray.get(handle.shutdown.remote())
            except DEAD:
                pass
            ray.kill(handle)
        for handle in self.shards.values():
            try:
                ray.get(handle.close.remote())
            except DEAD:
                pass
            ray.kill(handle)
        if self.store_client is not None:
            self.store_client.close()
