"""A colocated replica that shares its group's KV store: ``StoreEngine``, a
``ColocatedEngine`` whose prefix cache reaches past its own blocks into the app-wide store
shards every replica of the group uses (``actors.serving.store_shards``; a colocated
group's ``store`` section). A turn routed to another replica of the group then loads its
prefix instead of recomputing it.

- Loads. When a request arrives and the part of its prompt this replica's own prefix cache
  misses is held by a shard for at least ``min_load_tokens`` tokens (loading fewer is
  slower than computing them: ``bench/colocated_store.py``), fresh cache blocks are taken
  (held, published nowhere) and a background thread pins that run in its shard and reads
  every layer of it into them (one read through the transfer layer: the shard's shared
  memory on its node, TCP or NIXL from another). The request waits meanwhile, outside the
  scheduler; the other requests keep stepping. Once the read is in, the blocks are
  published in the prefix cache and the request is queued: the scheduler's ordinary prefix
  match attaches them and counts them as cached tokens. A read that fails (the shard died)
  frees the blocks unpublished and the request is queued as is: it recomputes. A request
  whose missing prefix another request is already loading waits for that load.
- Writes. After the step that completes a prompt, its full blocks from the first one the
  store's map does not hold are held and written by a second background thread to the
  shard ``placement`` picks (``policies.shard_choice``: the owner of the prompt's first
  block, or this replica's home shard); then each answer block, after the step that
  fills it, the same way, so a later turn finds the answer too. The hold ends when the
  write does (a request that finished meanwhile frees its blocks then). The first token
  is not delayed by it.
- Faults. A dead shard costs only cache: it drops out of the map and its blocks read as
  misses; writes go to another live shard, or nowhere; the replica starts it again, empty,
  under its name (``AppShards.revive``), from the writing thread.

Invariants: every block taken for a load or held for a write is released exactly once, on
the engine thread (``check_blocks`` waits for the reads and writes in flight, so it reads 0
when idle); a published block holds its KV; the tokens are those of the same replica
without a store. One worker only (tp = spp = kvp = 1, no MoE workers): the cache is this
process's tensors (``PrivateKVCache``). The store client's map and handles are touched only
on the engine thread; the writing thread has a client of its own, the reading thread a
transfer engine of its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.disagg.kv_ipc_route import cache_device
from actors.engine.config import EngineConfig
from actors.engine.controller_builder import ControllerParts, build_parts
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_controller import ReplicaController, _Request
from actors.engine.step_plan import StepResult
from actors.engine.worker_hooks import KVCaches, PrivateKVCache, WorkerHooks
from actors.kvstore.shard import KVStoreClient, current_node_id
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.store_shards import AppShards, ShardSpec, shard_tag
from errors import InvalidRequestError
from policies.replica_stats import ReplicaStats
from policies.request import Request
from policies.scheduler import ScheduledStep
from policies.sequence import FinishReason, Sequence
from store.block_pool import NoFreeBlocksError
from store.hashing import extend_block_hashes
from store.kv_block_layout import KVBlockLayout
from store.transfer import Endpoint, TransferEngine

POLL_S = 0.02  # with only reads or writes in flight, a step waits this long for one


@dataclass
class _Load:
    """One read of a stored run into fresh blocks, for the requests in ``waiters``."""

    hashes: list[int]  # the prompt's usable block hashes (its last token is computed)
    tokens: list[int]
    first: int  # index of the first block read (the ones before are in the local cache)
    blocks: list[int]  # held, unpublished, one per block read
    shard_id: str
    future: Future[int]  # blocks read (the shard may have evicted the tail since)
    epoch: int  # the worker generation whose cache it reads into
    waiters: list[str] = field(default_factory=list)


def store_engine(
    model: str | Path | None,
    config: EngineConfig,
    pool: str,
    replica_id: str,
    min_load_tokens: int,
    dram_bytes: int = 64 << 20,
    ssd_bytes: int = 0,
    ssd_dir: str | None = None,
    num_shards: int = 1,
    ttft_slo: float | None = None,
    placement: str = "key",
    tenant_retained_share: float = 1.0,
) -> StoreEngine:
    """A replica of a colocated group with a store: its engine, and the group's shards
    (``pool``: ``<app>/<group>``) started or attached (``AppShards``)."""
    check_store_layout(config)
    if cache_device(config.device).type != "cpu":
        raise ValueError(
            "a colocated replica's store loads and writes move its KV cache through host "
            "memory: with a store, its replicas run on the CPU (device: cpu)"
        )
    cache = PrivateKVCache()
    parts = build_parts(model, config, worker_hooks=WorkerHooks(kv_cache=cache))
    layout = KVBlockLayout.of(cache.kv_caches)
    tag = shard_tag(parts.model_dir.resolve(), layout)
    spec = ShardSpec(
        pool,
        layout.block_bytes,
        tag,
        dram_bytes,
        ssd_bytes,
        ssd_dir,
        num_shards,
        tenant_retained_share,
    )
    shards = AppShards(spec)
    return StoreEngine(parts, cache, shards, replica_id, min_load_tokens, ttft_slo, placement)


def check_store_layout(config: EngineConfig) -> None:
    """ValueError unless ``config`` is a layout a colocated store serves."""
    if (config.tp, config.spp, config.kvp) != (1, 1, 1) or config.attention_workers:
        raise ValueError(
            "a colocated replica reads and writes the KV store in its own process: it needs "
            "one worker (tp = spp = kvp = 1, no attention/expert workers)"
        )
    if not config.enable_prefix_caching:
        raise ValueError("the KV store loads into the prefix cache: enable_prefix_caching")


class StoreEngine(ColocatedEngine):
    def __init__(
        self,
        parts: ControllerParts,
        cache: PrivateKVCache,
        shards: AppShards,
        replica_id: str,
        min_load_tokens: int,
        ttft_slo: float | None = None,
        placement: str = "key",
    ) -> None:
        """``placement``: which shard each prompt is written to (``policies.shard_choice``;
        ``home``, one of this node's shards, is the writer's own under "local")."""
        check_store_layout(parts.engine_config)
        super().__init__(parts, ttft_slo)
        self.cache = cache  # the worker's tensors (new ones after a restart: read each time)
        self.shards = shards
        self.min_load_tokens = min_load_tokens
        self.node_id = current_node_id()
        self.client = KVStoreClient(f"colocated-{replica_id}", node_id=self.node_id)
        for sid, handle in shards.handles.items():
            self.client.add_shard(sid, handle)
        local = sorted(s for s in shards.handles if shards.node_of(s) == self.node_id)
        self.home = local[zlib.crc32(replica_id.encode()) % len(local)] if local else None
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="kv-store-read")
        self._read_engine = TransferEngine(f"colocated-{replica_id}-reads", self.node_id)
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="kv-store-write")
        self._writer = KVStoreClient(
            f"colocated-{replica_id}-writes", node_id=self.node_id, placement=placement
        )
        self._writes.submit(self._add_shards, dict(shards.handles)).result()
        self._loads: dict[int, _Load] = {}  # by the hash of its first block
        self._waiting: dict[str, tuple[_Request, int]] = {}  # request -> its load's key
        self._jobs: list[tuple[Future[Any], Callable[[Any], None]]] = []  # writes, revives
        self._reviving = False
        self._written: dict[str, int] = {}  # request -> its leading blocks handed to writes
        self._epoch = 0  # worker generations (a restart gives the cache new tensors)
        self._pins = itertools.count()
        self.loaded_blocks = 0
        self.stored_blocks = 0

    # -- requests (the engine thread) ---------------------------------------------------
    def add_request(self, request: Request, kv_dest: Any = None) -> str:
        rid = request.request_id
        if rid in self._waiting:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        r = self._new_request(request)
        request = r.request  # hashed at this replica's weight version
        if self.admission is not None:
            self._admit(request)
        load = self._start_load(request) if kv_dest is None else None
        if load is None:
            r.kv_dest = kv_dest
            self._requests[rid] = r
            self.scheduler.add(r.seq)
            return rid
        load.waiters.append(rid)
        self._waiting[rid] = (r, load.hashes[load.first])
        return rid

    def abort(self, request_id: str) -> None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            super().abort(request_id)
            return
        r, key = entry  # never scheduled: it ends here, holding no block
        load = self._loads.get(key)
        if load is not None:
            load.waiters.remove(request_id)
        r.seq.finish(FinishReason.ABORT, time.monotonic())
        self._requests[request_id] = r  # ``release`` hands back its (empty) output

    def release(self, request_id: str) -> RequestOutput:
        self._written.pop(request_id, None)
        return super().release(request_id)

    def has_unfinished(self) -> bool:
        return ReplicaController.has_unfinished(self) or bool(self._loads or self._jobs)

    def step(self) -> list[StreamDelta]:
        self._reap()
        if not ReplicaController.has_unfinished(self):  # only reads or writes in flight
            self._wait_io(POLL_S)
            self._reap()
            if not ReplicaController.has_unfinished(self):
                return []
        return super().step()

    def on_idle(self) -> None:
        self._reap()
        super().on_idle()

    def serving_stats(self) -> ReplicaStats:
        stats = super().serving_stats()
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + len(self._waiting))

    def check_blocks(self) -> dict[str, int]:
        """Blocks in use once the reads and writes in flight are done (0 when idle)."""
        self._wait_io(None)
        self._reap()
        return super().check_blocks()

    def shutdown(self) -> None:
        for rid in list(self._waiting):
            self.abort(rid)
        super().shutdown()
        self._reads.shutdown(wait=True)
        self._writes.shutdown(wait=True)
        self._reap()
        self._read_engine.close()
        self._writer.close()
        self.client.close()

    def _recover(self) -> None:
        super()._recover()
        self._epoch += 1  # reads under way land in the old tensors: never published

    # -- loads --------------------------------------------------------------------------
    def _start_load(self, request: Request) -> _Load | None:
        """Start reading the stored run of the prompt beyond the local prefix cache into
        fresh blocks, if it is at least ``min_load_tokens`` long (or join the load already
        reading it); None: the request is queued at once."""
        kv, bs, client = self.one_rank_kv, self.block_size, self.client
        tokens = request.prompt_token_ids
        usable = request.block_hashes[: (len(tokens) - 1) // bs]  # the last token is computed
        held = kv.cached_prefix(usable, tokens)
        rest = usable[len(held) :]
        if not rest or len(rest) * bs < self.min_load_tokens:
            return None
        if rest[0] in self._loads:
            return self._loads[rest[0]]
        self._refresh()
        shard, n = client.directory.best_holder(rest)
        n = min(n, kv.num_free_blocks - self._reserved_blocks())
        if shard is None or n <= 0 or n * bs < self.min_load_tokens:
            return None
        kv.hold(held)  # the allocation must not evict the local prefix
        try:
            blocks = kv.allocate_unpublished(n)
        except NoFreeBlocksError:
            return None
        finally:
            kv.unhold(held)
        pin_id = f"{request.request_id}#load{next(self._pins)}"
        handle, ep = client.handles[shard], client.endpoints[shard]
        caches = self.cache.kv_caches
        future = self._reads.submit(self._read, handle, ep, pin_id, rest[:n], caches, blocks)
        load = _Load(usable, tokens, len(held), blocks, shard, future, self._epoch)
        self._loads[rest[0]] = load
        return load

    def _reserved_blocks(self) -> int:
        """Blocks the running requests may still grow by (the scheduler keeps them free)."""
        kv = self.one_rank_kv
        need = 0
        for s in self.scheduler.running:
            final = kv.blocks_needed(s.num_prompt_tokens + s.max_tokens - 1)
            need += max(0, final - kv.blocks_needed(s.num_computed_tokens + s.num_inflight_tokens))
        return need

    def _read(
        self,
        handle: Any,
        ep: Endpoint,
        pin_id: str,
        hashes: list[int],
        caches: KVCaches,
        blocks: list[int],
    ) -> int:
        """(The reading thread.) Pin the run in its shard, read it into ``blocks``."""
        locs = ray.get(handle.acquire.remote(pin_id, hashes))
        try:
            offsets = [loc.offset for loc in locs]
            local, ranges = KVStoreClient.pin_ranges(caches, offsets, blocks[: len(locs)])
            self._read_engine.read_ranges(ep, local, ranges)
        finally:
            handle.release.remote(pin_id)
        return len(locs)

    def _finish_load(self, key: int, load: _Load) -> None:
        """A read ended: publish what it read, free the rest, queue its requests."""
        del self._loads[key]
        kv = self.one_rank_kv
        try:
            n = load.future.result()
        except Exception:  # the shard died (or its bytes did not arrive): recompute
            n = 0
            self.client.mark_dead(load.shard_id)
        if n and load.epoch == self._epoch:
            kv.publish(load.blocks[:n], load.hashes, load.tokens, load.first)
            self.loaded_blocks += n
        kv.unhold(load.blocks)  # published ones stay cached for the match; the rest free
        for rid in load.waiters:
            r, _ = self._waiting.pop(rid)
            self._requests[rid] = r
            self.scheduler.add(r.seq)

    # -- writes -------------------------------------------------------------------------
    def _postprocess(
        self,
        scheduled: ScheduledStep,
        result: StepResult,
        advanced: list[Sequence] | None = None,
    ) -> list[StreamDelta]:
        # before the step's end frees a finished request's blocks: they are held for writes
        for (seq, n), start in zip(scheduled.entries, scheduled.starts, strict=True):
            if start + n >= seq.num_prompt_tokens:  # the whole prompt's KV is computed
                self._write_full_blocks(seq, start + n)
        deltas = super()._postprocess(scheduled, result, advanced)
        for d in deltas:
            if d.finished and d.finish_reason != "abort":
                self._retain(d.request_id)
        return deltas

    def _retain(self, rid: str) -> None:
        """Sessions: a finished request asking for ``kv_retention_s`` has the blocks handed
        to writes (its prompt's and answer's) retained on every live shard, by the writing
        thread once its writes are in (``store.retention``)."""
        r = self._requests.get(rid)
        seconds = r.request.params.kv_retention_s if r is not None else 0.0
        if r is None or seconds <= 0 or not self._written.get(rid):
            return
        hashes = list(r.seq.block_hashes[: self._written[rid]])
        job = self._writes.submit(self._writer.retain, hashes, r.request.tenant, seconds)
        self._jobs.append((job, lambda _: None))

    def _write_full_blocks(self, seq: Sequence, computed: int) -> None:
        """Hand the request's full blocks (its first ``computed`` tokens have KV: the
        prompt, then each answer block as it fills) not handed over before, from the first
        the store's map lacks, to the writing thread, held until it is done."""
        rid, bs = seq.request_id, self.block_size
        written = self._written.get(rid, 0)
        if computed // bs <= written:
            return  # no block filled since the last write (most decode steps)
        table = self.one_rank_kv.block_table(rid)
        full = min(computed // bs, len(table))
        if full <= written:
            return
        self._written[rid] = full
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids[: full * bs], bs, seq.salt)
        hashes, blocks = hashes[:full], table[:full]
        holders = self.client.directory.holders
        start = next((i for i in range(written, full) if not holders(hashes[i])), None)
        if start is None:  # (the writing thread knows which shards are live)
            return
        hold, todo = blocks[start:], hashes[start:]
        self.one_rank_kv.hold(hold)
        job = self._writes.submit(self._write, hashes, self.cache.kv_caches, blocks, start)
        self._jobs.append((job, lambda out: self._wrote(hold, todo, out)))

    def _write(
        self, hashes: list[int], caches: KVCaches, blocks: list[int], start: int
    ) -> tuple[str | None, int]:
        """(The writing thread.) Returns (the shard now holding ``hashes[start:]``, None if
        none is live; blocks this write stored)."""
        w = self._writer
        stored = w.store_chain(hashes, caches, blocks, start, self.home, self.node_id)
        return w.pick_shard(self.home, self.node_id, hashes[0]), stored  # written to, if live

    def _wrote(
        self, hold: list[int], hashes: list[int], out: tuple[str | None, int] | None
    ) -> None:
        self.one_rank_kv.unhold(hold)
        if out is None:
            return
        shard, stored = out
        self.stored_blocks += stored
        if shard is not None and shard in self.client.endpoints:
            for h in hashes:  # stored now, or already there: no need to write it again
                self.client.directory.add(h, shard)

    # -- shards -------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Bring the store's map up to date; shards found dead (now or before) are started
        again from the writing thread."""
        self.client.refresh()
        missing = sorted(set(self.shards.handles) - set(self.client.handles))
        if missing and not self._reviving:
            self._reviving = True
            job = self._writes.submit(self._revive, missing)
            self._jobs.append((job, self._revived))

    def _add_shards(self, handles: dict[str, Any]) -> dict[str, Any]:
        """(The writing thread.) Use these shards for writes; returns those live."""
        live = {}
        for sid, handle in handles.items():
            if sid in self._writer.handles:
                self._writer.mark_dead(sid)  # an older actor under its name
            if self._writer.add_shard(sid, handle) is not None:
                live[sid] = handle
        return live

    def _revive(self, missing: list[str]) -> dict[str, Any]:
        return self._add_shards(self.shards.revive(missing))

    def _revived(self, handles: dict[str, Any] | None) -> None:
        self._reviving = False
        for sid, handle in (handles or {}).items():
            if sid in self.client.handles:
                self.client.mark_dead(sid)
            self.client.add_shard(sid, handle)

    # -- background work ----------------------------------------------------------------
    def _reap(self) -> None:
        """Finish, on the engine thread, every read and job that ended."""
        for key, load in list(self._loads.items()):
            if load.future.done():
                self._finish_load(key, load)
        jobs, self._jobs = self._jobs, []
        for job, then in jobs:
            if not job.done():
                self._jobs.append((job, then))
                continue
            try:
                out = job.result()
            except Exception:  # a store error the client did not absorb: only cache lost
                out = None
            then(out)

    def _wait_io(self, timeout: float | None) -> None:
        """Wait for one read or job to end (``timeout`` None: for all of them)."""
        futures = [x.future for x in self._loads.values()] + [j for j, _ in self._jobs]
        if not futures:
            return
        if timeout is None:
            concurrent.futures.wait(futures)
        else:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)
