"""A prefill replica of a disaggregated deployment (plain class; ``PDCluster`` makes it a
threaded Ray actor).

It runs its own loop (``ReplicaLoop``) over a ``ReplicaController`` whose requests stop
after their first token: each computes its prompt (chunked like any prefill, reusing a
cached prefix), streams every layer's KV into the blocks its decode replica reserved (the
worker's step hook, ``PrefillHook``) and samples the first token. Once a request's last
step returned, all its KV has arrived: the replica tells the decode replica to admit it
(directly, not through the Conductor) and reports ``PrefillDone`` to the Conductor.

Around that, the KV store:

- when a request arrives, the longest prefix the store holds beyond what this replica's
  own prefix cache has is pinned in its shard (from DRAM, or promoted from SSD), given free
  cache blocks published in the local prefix cache (so the scheduler's ordinary prefix
  match picks them up) and loaded into them layer by layer while the prefill runs
  (``LayerLoader``: layer ``l`` of every step waits for layer ``l`` of every started load,
  so the read of layer ``l + 1`` overlaps the compute of layer ``l``); the request queues
  at once. The load holds its blocks until it is done. A load that fails (the shard died)
  unpublishes its blocks and every request that may have read them starts again, reading
  from another holder or recomputing; a dead shard reads as a miss;
- after the step that completes a prompt, its full blocks that no shard holds yet are
  written to the store shard the Conductor chose (a dead shard drops out of the map);
  with ``params.kv_retention_s > 0`` they are then retained for that long
  (``store.retention``; the decode replica retains the whole chain again at the turn's end).

A one-worker prefill replica writes into a decode cache on the same device (a GPU, or the
CPU with ``kv_route="ipc"`` on the decode side) device to device (``kv_ipc_route``): each
request's destination is stamped with the weight version it computes, and the receipts of
its writes go to the decode replica with its admission.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import ray

from actors.disagg.fault_injection import ExitAfterLayers
from actors.disagg.kv_ipc_route import prefill_route
from actors.disagg.kv_routes import piece_ranges
from actors.disagg.kv_stream import KVDestination, LayerStreamer, StreamingWorkers
from actors.disagg.layer_loader import LayerLoad, LayerLoader
from actors.disagg.looped_replica import LoopedReplica, run_actor_process_at_normal_priority
from actors.disagg.messages import (
    CacheEvent,
    PrefillDone,
    PrefillFailed,
    PrefillStats,
    PrefillStep,
    PrefillTask,
    StoreLoad,
)
from actors.disagg.prefill_hook import PrefillHook
from actors.disagg.stage_caches import StageCaches
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.replica_loop import ReplicaLoop
from actors.engine.step_plan import StepPlan
from actors.engine.worker_hooks import KVCaches, PrivateKVCache, WorkerHooks
from actors.kvstore.shard import KVStoreClient, current_node_id
from models import tiny_model_dir
from models.config import read_model_config
from policies.dualpath import DECODE_PATH, PREFILL_PATH
from store.kv_cache_ipc import KVWriteDone
from store.kv_store_errors import KVStoreError
from store.transfer import LocalMemory, TransferEngine
from store.transfer.links import BudgetedTransfer, LinkBudget, NodeLinks


class PrefillReplica(LoopedReplica):
    def __init__(
        self,
        replica_id: str,
        model_dir: str | None,
        config: EngineConfig,
        store_shards: dict[str, Any] | None = None,
        cpus: list[int] | None = None,
        threads: int | None = None,
        link_budget: LinkBudget | None = None,
        record_loads: bool = False,
        store_placement: str = "local",
        kv_route: str = "auto",
    ) -> None:
        """``kv_route``: "auto" writes a request's KV device to device into a decode
        cache that offers an export this worker can open (same device and sharding), else
        through the transfer layer; "ipc" fails a request whose decode cache it cannot
        write that way; "transfer" always uses the transfer layer. A replica of more than
        one worker streams through the transfer layer.
        ``store_placement``: which shard each prefix is written to
        (``policies.shard_choice``). ``config``'s ``tp`` / ``spp`` spread the replica over
        worker actors, each streaming the layers and heads it holds (Mooncake's chunked
        pipeline parallelism for long prefills is ``spp`` here). With the KV store,
        ``tp`` = 1: a multi-stage replica maps its stages' caches (``StageCaches``), loads
        a stored prefix before the step that reads it and writes each finished prompt's
        blocks back.
        ``link_budget``: store reads pay this replica's emulated storage link (on one
        machine each replica stands for its own node). ``record_loads``: keep the load /
        compute timeline (``load_timeline``)."""
        run_actor_process_at_normal_priority()
        self.replica_id = replica_id
        self.node_id = current_node_id()
        if config.kvp != 1:
            raise ValueError(
                "a prefill replica streams each request from one KV rank: set kvp=1 "
                "(KV-parallel prefill replicas are not supported)"
            )
        self.block_size = config.block_size
        self.cache = PrivateKVCache()
        self.engine = TransferEngine(f"prefill-{replica_id}", self.node_id)
        folder = Path(model_dir) if model_dir is not None else tiny_model_dir("dense")
        model = read_model_config(folder)
        num_kv_heads = model.num_key_value_heads
        heads = (0, num_kv_heads)
        self.links = NodeLinks(link_budget) if link_budget is not None else None
        storage_link = self.links.storage(replica_id) if self.links is not None else None
        compute_link = self.links.compute(replica_id) if self.links is not None else None
        # the KV stream to decode replicas and relayed reads share the compute link
        stream = BudgetedTransfer(self.engine, compute_link)
        staged = config.tp * config.spp > 1
        self.route = prefill_route(
            kv_route, staged, config.device, self.node_id, (0, model.num_hidden_layers), heads
        )
        self.streamer = LayerStreamer(stream, self.block_size, heads, heads, self.route)
        self.loader = LayerLoader(record=record_loads)
        self.load_engine = TransferEngine(f"prefill-{replica_id}-loads", self.node_id)
        self.storage = BudgetedTransfer(self.load_engine, storage_link)
        self.compute = BudgetedTransfer(self.load_engine, compute_link)
        self.hook = PrefillHook(self.streamer, self._after_step, self.loader)
        hooks: WorkerHooks | StreamingWorkers = WorkerHooks(self.cache, self.hook)
        # stages in other processes: the store goes through their mapped caches
        self.staged = staged
        if self.staged:
            if store_shards and config.tp != 1:
                raise ValueError(
                    "the KV store reads and writes a prefill replica's whole layers: with a "
                    "store, prefill replicas run tp=1 (spp, chunked pipeline parallelism, "
                    "may be more)"
                )
            layers = model.num_hidden_layers if store_shards else 0
            hooks = StreamingWorkers(replica_id, self.block_size, num_kv_heads, layers, link_budget)
        self.controller = ReplicaController.build(model_dir, config, worker_hooks=hooks)
        self.stages: StageCaches | None = None
        if self.staged and store_shards:
            self.stages = StageCaches(self.controller.executor.hook_info(), self.controller.dtype)
        # the only door to this replica's blocks (one KV rank: ``kvp=1`` above)
        self.kv = self.controller.one_rank_kv
        self.client: KVStoreClient | None = None
        if store_shards:
            self.client = KVStoreClient(
                f"prefill-{replica_id}", node_id=self.node_id, placement=store_placement
            )
            for shard_id, handle in store_shards.items():
                self.client.add_shard(shard_id, handle)
            self.client.write_link = storage_link  # store writes pay the storage link
        self._tasks: dict[str, PrefillTask] = {}
        self._failed: dict[str, str] = {}  # request key -> why its KV stream broke
        # request key -> receipts of its KV written device to device (handed on at admit)
        self._receipts: dict[str, list[KVWriteDone]] = {}
        self.loaded_blocks = 0  # blocks brought in from the store
        self.stored_blocks = 0  # blocks written to the store
        self.bytes_streamed = 0
        self.layers_streamed = 0
        self._step_end = 0.0  # when the last step's compute and stream ended
        self.stats = self._stats()
        self.loop = ReplicaLoop(
            self._iterate, f"prefill-{replica_id}", cpu_cores=cpus, torch_threads=threads
        )

    def node(self) -> str:
        return self.node_id

    @property
    def kv_caches(self) -> KVCaches:
        """The whole model's cache as this process sees it: the worker's own (one
        worker) or the stages' mapped segments."""
        return self.stages.kv_caches if self.stages is not None else self.cache.kv_caches

    # -- the Conductor (any thread: through the loop) ---------------------------------------
    @ray.method(enable_task_events=False)  # once per request: no record in the GCS
    def submit(self, task: PrefillTask) -> None:
        """Queue a request's prefill; its new full blocks go to ``task.store_shard``."""
        self.loop.post(lambda: self._start(task))

    def abort(self, key: str) -> None:
        self.loop.post(lambda: self._drop(key))

    def reset(self, owner: str) -> list[int]:
        """Conductor ``owner`` attaches (``actors.disagg.pool_actors``): drop every prefill
        the old one queued and ``claim`` the replica; returns the hashes this replica's
        prefix cache holds (kept: they are the pool's cache)."""

        def reset() -> list[int]:
            for key in list(self._tasks):
                self._drop(key)
            self.kv.drain_events()
            self.loop.claim(owner)
            return self.kv.cached_hashes()

        return list(self.loop.call(reset).result())

    def export_blocks(
        self, request_hashes: list[int], tokens: list[int], wanted: list[int], shard_id: str
    ) -> int:
        """Write the blocks of a prompt whose hashes are in ``wanted`` from this replica's
        prefix cache to a store shard (replication); returns blocks written."""
        return int(
            self.loop.call(lambda: self._export(request_hashes, tokens, wanted, shard_id)).result()
        )

    def add_shard(self, shard_id: str, handle: Any) -> None:
        """Use a store shard started after this replica (a dead shard's replacement, under
        the dead one's id), on the loop thread that owns the store client."""
        client = self.client
        if client is None:
            return

        def add() -> None:
            assert client is not None
            if shard_id in client.handles:
                client.mark_dead(shard_id)  # the old one: this replica had not noticed yet
            client.add_shard(shard_id, handle)

        self.loop.call(add).result()

    def drop_local_cache(self) -> int:
        """Forget this replica's own cached prefixes (so a hit must come from the store)."""
        return int(self.loop.call(self.kv.evict_all_cached).result())

    def crash_after_layers(self, layers: int) -> None:
        """Fault injection for tests: the process exits after streaming ``layers`` more
        layers of KV (mid-stream)."""
        self.hook.faults = ExitAfterLayers(self.streamer.layers_sent + layers)

    def cached_block_bytes(self, hashes: list[int], tokens: list[int]) -> list[bytes]:
        """Every layer's K and V of the leading blocks of a prompt held in this replica's
        prefix cache, one ``bytes`` per block (tests compare the read paths)."""

        def read() -> list[bytes]:
            caches = self.kv_caches
            return [
                b"".join(t[block].numpy().tobytes() for kv in caches for t in kv)
                for block in self.kv.cached_prefix(hashes, tokens)
            ]

        return list(self.loop.call(read).result())

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes granted so far on this replica's emulated links (``NodeLinks.granted``;
        empty without a ``link_budget``)."""
        return self.links.granted(self.replica_id) if self.links is not None else {}

    def load_timeline(self) -> list[tuple[str, int, float]]:
        """``(event, layer, perf_counter time)`` of store loads and layer computes, when
        started with ``record_loads``."""
        return list(self.loader.timeline)

    # the decode side releases or replaces its caches too: drop the mappings of them
    def sleep(self, level: int) -> int:
        self.loop.call(self.streamer.drop_mappings).result()
        return super().sleep(level)

    def update_weights(self, weights: list[object], version: int) -> int:
        self.loop.call(self.streamer.drop_mappings).result()
        return super().update_weights(weights, version)

    def shutdown(self) -> None:
        self.loop.stop()
        self.controller.shutdown()
        self.loader.close()
        if self.stages is not None:
            self.stages.close()
        if self.client is not None:
            self.client.close()
        self.streamer.close()
        self.engine.close()
        self.load_engine.close()

    # -- the loop thread --------------------------------------------------------------------
    def _start(self, task: PrefillTask) -> None:
        req = task.request
        self._tasks[task.key] = task
        # the KV's weight version: a device-to-device write goes only into a cache of it
        dest = dataclasses.replace(
            self._start_load(task), weight_version=self.controller.weight_version
        )
        first = dataclasses.replace(req.params, max_tokens=1, stop=[])
        request = dataclasses.replace(req, request_id=task.key, params=first)
        self.controller.add_request(request, kv_dest=dest)

    def _drop(self, key: str) -> None:
        if key in self._tasks:
            self.controller.abort(key)
            self.controller.release(key)
            self._forget(key)

    def _forget(self, key: str) -> None:
        self._tasks.pop(key, None)
        self._failed.pop(key, None)
        self._receipts.pop(key, None)

    def _iterate(self) -> bool:
        c = self.controller
        ran = c.has_unfinished()
        if ran:
            self._step_end = 0.0
            if self.stages is not None:
                # stage workers cannot wait on a load layer by layer: every started load is
                # in before a step runs (a load's blocks are read by no step before it)
                self.loader.wait_all()
            # block tables before the step: one that finishes a prompt frees its blocks
            # (their KV stays intact until a later step allocates them)
            tables = {k: c.block_table(k) for k in self._tasks} if self.stages else {}
            start = time.perf_counter()
            deltas = c.step()
            end = self._step_end or time.perf_counter()
            restarted = self._reap_loads()  # before a request whose load failed finishes
            chunks: list[tuple[int, int]] = []
            for report in c.take_hook_reports():
                chunks = chunks or report.chunks
                self._failed.update(report.failed)
                for key, receipts in report.receipts.items():
                    self._receipts.setdefault(key, []).extend(receipts)
                self.bytes_streamed += report.bytes_sent
                self.layers_streamed += report.layers_sent
            # stats before the step's events: a report that takes a PrefillDone never
            # carries the queue from before it (the Conductor's view would stay stale)
            self.stats = self._stats()
            if chunks:
                self.loop.note(PrefillStep(chunks, end - start))
            for d in deltas:
                if d.finished and d.request_id not in restarted:
                    if self.stages is not None and d.request_id not in self._failed:
                        # every stage has written the prompt's KV
                        self._store_prompt(d.request_id, tables.get(d.request_id, []))
                    self._finished(d.request_id)
            for key, why in list(self._failed.items()):  # still running: stop it
                if key in self._tasks:
                    self._drop(key)
                    self.loop.emit(PrefillFailed(key, why))
        for kind, h in self.kv.drain_events():
            self.loop.emit(CacheEvent(kind == "stored", h))
        self.stats = self._stats()
        return ran

    def _finished(self, key: str) -> None:
        out = self.controller.release(key)
        task = self._tasks[key]
        why = self._failed.get(key)
        if why is None:
            # the first token's logprobs travel with it (None: not asked for)
            first_logprob = out.logprobs[0] if out.logprobs else None
            args = (key, out.token_ids[0], first_logprob, out.num_cached_tokens)
            receipts = tuple(self._receipts.get(key, ()))
            if receipts:  # written device to device: the decode side checks them first
                task.decode.admit(*args, receipts=receipts)
            else:
                task.decode.admit(*args)
            self.loop.emit(PrefillDone(key, out.token_ids[0], out.num_cached_tokens))
        else:
            self.loop.emit(PrefillFailed(key, why))
        self._forget(key)

    # -- the KV store -----------------------------------------------------------------------
    def _start_load(self, task: PrefillTask) -> KVDestination:
        """Start the per-layer load of the stored prefix beyond the local one, into blocks
        published for it (see the module doc); returns where the request's KV streams (on
        the decode path, past the blocks the decode replica loads itself)."""
        key, tokens, hashes = task.key, task.request.prompt_token_ids, task.request.block_hashes
        client, kv = self.client, self.kv
        usable = hashes[: (len(tokens) - 1) // self.block_size]  # the last token is computed
        held = kv.cached_prefix(usable, tokens)
        rest = usable[len(held) :]
        if client is None or not rest:
            return task.dest
        client.refresh()
        if not client.directory.holders(rest[0]):
            return task.dest
        if task.read_path == DECODE_PATH and task.relay is not None:
            return self._start_relay_load(task, held, usable)
        k = len(held)
        kv.hold(held)  # keep the local prefix from being evicted by the allocation
        try:
            want = min(len(rest), kv.num_free_blocks - k)
            pin = client.pin_prefix(key, rest[:want]) if want > 0 else None
            if pin is None:
                return task.dest
            # published now; ours (held) until the load is done
            blocks = kv.allocate_published(usable, tokens, k, len(pin.offsets))
        finally:
            kv.unhold(held)
        mine = rest[: len(blocks)]
        caches, storage = self.kv_caches, self.storage

        def read_layer(layer: int) -> int:
            local, ranges = KVStoreClient.layer_ranges(caches, layer, pin.offsets, blocks)
            return storage.read_ranges(pin.endpoint, local, ranges)

        self.loader.start(
            LayerLoad(
                key,
                len(caches),
                read_layer,
                on_done=lambda: self.loop.post(self._reap_loads_later),
                context=(pin, blocks, mine),
                blocks=frozenset(blocks),
            )
        )
        return task.dest

    def _start_relay_load(
        self, task: PrefillTask, held: list[int], usable: list[int]
    ) -> KVDestination:
        """DualPath's decode read path: the decode replica reads the stored prefix (blocks
        ``[0, m)``, Full Blocks) into the request's reserved blocks there; this replica
        reads blocks ``[k, m)`` beyond its own prefix from them layer by layer over the
        compute path while the prefill runs (layer ``l`` once the decode replica has read
        it, while it reads layer ``l + 1``), and streams only blocks from ``m`` on."""
        client, kv = self.client, self.kv
        assert client is not None
        tokens = task.request.prompt_token_ids
        _, m = client.directory.best_holder(usable)
        k = len(held)
        dest = task.dest
        m = min(m, len(dest.block_ids))
        kv.hold(held)
        try:
            n = min(m - k, kv.num_free_blocks - k)
            if n <= 0:
                return dest
            blocks = kv.allocate_published(usable, tokens, k, n)
        finally:
            kv.unhold(held)
        m = k + n
        mine = usable[k:m]
        # the decode replica yields once per layer read from the store (a streaming call)
        relayed = task.relay.load_prefix.remote(task.key, usable[:m], list(dest.block_ids[:m]))
        caches, compute, heads = self.kv_caches, self.compute, self.streamer.held
        relay_blocks = list(dest.block_ids[k:m])

        def read_layer(layer: int) -> int:
            got = ray.get(next(relayed))  # layer ``layer`` is in the decode replica's cache
            if got < m:
                raise KVStoreError(f"the decode replica loaded {got} of {m} blocks")
            kv = caches[layer]
            local = LocalMemory(kv[0], kv[1])
            piece = local.sizes[0] // kv[0].shape[0]
            moved = 0
            for target in dest.targets:
                ranges = piece_ranges(
                    target, layer, heads, heads, piece, local.starts[1], blocks, relay_blocks
                )
                if ranges:
                    moved += compute.read_ranges(target.endpoint, local, ranges)
            return moved

        self.loader.start(
            LayerLoad(
                task.key,
                len(caches),
                read_layer,
                on_done=lambda: self.loop.post(self._reap_loads_later),
                context=(None, blocks, mine),
                blocks=frozenset(blocks),
            )
        )
        return dataclasses.replace(dest, held_blocks=m)

    def _reap_loads_later(self) -> None:
        self._reap_loads()

    def _reap_loads(self) -> set[str]:
        """Finish the loads whose every layer is in (loop thread): unpin, hand their blocks
        to the prefix cache; a failed one's blocks are unpublished and every request that
        may have read them starts again. Returns the keys started again."""
        client, kv = self.client, self.kv
        restarted: set[str] = set()
        for load in self.loader.take_finished():
            pin, blocks, mine = load.context  # pin None: read from a decode replica
            if client is not None and pin is not None:
                client.unpin(pin)
            if load.error is None:
                self.loaded_blocks += len(blocks)
                self.loop.note(StoreLoad(len(blocks), load.seconds))
                kv.unhold(blocks)
                continue
            if client is not None and pin is not None:
                client.mark_dead(pin.shard_id)
            kv.unpublish(blocks)
            kv.unhold(blocks)
            bad = set(mine)
            for key, task in list(self._tasks.items()):
                if bad.intersection(task.request.block_hashes):
                    self._drop(key)
                    # again on the prefill path: streams the whole prompt (a dead relay's
                    # reservation fails the stream, and the Conductor places it again)
                    again = dataclasses.replace(task, read_path=PREFILL_PATH, relay=None)
                    self._start(again)
                    restarted.add(key)
        return restarted

    def _export(
        self, hashes: list[int], tokens: list[int], wanted: list[int], shard_id: str
    ) -> int:
        client = self.client
        if client is None or shard_id not in client.endpoints:
            return 0
        bs, want = self.block_size, set(wanted)
        picked: list[tuple[int, int, int | None]] = []  # (hash, block id, parent hash)
        for i, h in enumerate(hashes):
            if h not in want:
                continue
            block = self.kv.cached_block(h, tokens[i * bs : (i + 1) * bs])
            if block is not None:
                picked.append((h, block, hashes[i - 1] if i else None))
        if not picked:
            return 0
        try:
            stored = client.store_from_cache(
                shard_id,
                [h for h, _, _ in picked],
                self.kv_caches,
                [b for _, b, _ in picked],
                [p for _, _, p in picked],
            )
        except KVStoreError:
            client.mark_dead(shard_id)
            return 0
        self.stored_blocks += len(stored)
        return len(stored)

    def _after_step(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        """The step's compute and KV stream are done (timed here); write new blocks back."""
        self._step_end = time.perf_counter()
        self._store_new_blocks(plan, kv_caches)

    def _store_new_blocks(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        client = self.client
        if client is None:
            return
        for e in plan.entries:
            if e.sample is not None:  # the prompt is complete
                self._store_prompt(e.request_id, e.shards[0][2], kv_caches)

    def _store_prompt(self, key: str, table: list[int], kv_caches: KVCaches | None = None) -> None:
        """Write the full blocks of request ``key``'s prompt (block ids ``table``, token
        order) that no shard holds yet to its store shard."""
        client, task = self.client, self._tasks.get(key)
        if client is None or task is None:
            return
        caches = kv_caches if kv_caches is not None else self.kv_caches
        hashes = task.request.block_hashes
        blocks = table[: len(hashes)]
        todo = [i for i, h in enumerate(hashes) if not client.directory.holders(h)]
        if todo:  # to the Conductor's shard if live, else one on this node, else any
            self.stored_blocks += client.store_chain(
                hashes, caches, blocks, todo[0], task.store_shard, self.node_id
            )
        # sessions: the prompt's stored blocks are kept ahead of LRU (store.retention)
        client.retain(hashes, task.request.tenant, task.request.params.kv_retention_s)

    def _stats(self) -> PrefillStats:
        s = self.controller.scheduler
        return PrefillStats(
            queued_tokens=s.queued_prefill_tokens(),
            queued_requests=s.num_waiting + s.num_running,
            loaded_blocks=self.loaded_blocks,
            stored_blocks=self.stored_blocks,
            bytes_streamed=self.bytes_streamed,
            layers_streamed=self.layers_streamed,
            backends={
                **self.engine.chosen_backends(),
                **(self.route.backends() if self.route is not None else {}),
            },
            load_backends=self.load_engine.chosen_backends(),
            queued=tuple(
                (q.num_uncomputed_tokens, q.num_computed_tokens)
                for q in (*s.running, *s.waiting)
                if q.num_uncomputed_tokens > 0
            ),
        )
