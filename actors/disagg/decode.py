"""A decode replica of a disaggregated deployment (plain class; ``PDCluster`` makes it a
threaded Ray actor).

It runs its own loop (``ReplicaLoop``): whenever requests are decoding it steps, whatever
the prefill side is doing. Its worker's paged KV cache lives in a shared-memory segment
(``SharedKVCache``, passed to the worker as its KV-cache provider), so a prefill replica
writes a request's KV straight into the blocks reserved for it here. A request goes:

    reserve(key, request) -> KVDestination | None   blocks for its whole life (Conductor)
    admit(key, first_token)                         from the prefill replica, once all of
                                                    the prompt's KV arrived: it joins the
                                                    batch at the next step
    cancel(key) / abort(key)                        its prefill died / the caller gave up

Reserving the whole life up front means a decoding request is never preempted here (the
Conductor only picks an instance with that much room).

On a GPU (or on the CPU with ``kv_route="ipc"``) each worker's cache is also exported to
prefill workers on the same device (``KVTarget.export``; ``kv_ipc_route``): they write it
device to device and ``admit`` carries their receipts, which are accepted against the
exports this replica holds now before the request joins the batch (a receipt of a cache
since released or replaced loses the reservation: ``ReservationLost``). The targets are
described again after whatever releases or replaces the caches (a sleep, a worker
restart) or changes what their KV means (a weight update), and every export is stamped
with the weight version the replica runs. Every token goes out as a
``TokenDelta`` stamped with the time it was produced, then a ``Finished`` with the output
(a request reserved with a ``ReturnRoute`` sends its tokens and ``Done`` to its ingress
instead, ``return_links``, and the Conductor gets its ``Finished`` only).

Write-back (DualPath): given ``store_shards``, after every step each block that became
full (its KV computed: prompt tail and generated tokens) is written to a store shard (one
on this node if any), so a later turn of the conversation finds its own previous answer
in the store. Blocks of the prompt the prefill replica stored are not written again. A
dead shard drops out; the block is then simply not stored.

Retention (sessions): when a request with ``params.kv_retention_s > 0`` finishes, its full
blocks (the whole chain with write-back, else the prompt's) are retained on every live
shard for that long as its tenant's (``store.retention``), so the session's next turn
after a tool pause still finds them in the store.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from actors.disagg.kv_ipc_route import cache_device, check_kv_route
from actors.disagg.kv_routes import KVTarget
from actors.disagg.kv_stream import KVDestination, SharedCacheWorkers
from actors.disagg.looped_replica import LoopedReplica, run_actor_process_at_normal_priority
from actors.disagg.messages import (
    DecodeStats,
    DecodeStep,
    Finished,
    ReservationLost,
    TokenDelta,
    TokenGaps,
)
from actors.disagg.return_links import ReturnLinks
from actors.engine.config import EngineConfig
from actors.engine.direct_return import ReturnRoute
from actors.engine.executor import LocalExecutor
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_controller import ReplicaController
from actors.engine.replica_loop import ReplicaLoop
from actors.engine.token_gaps import TokenGapClock
from actors.kvstore.shard import KVStoreClient
from models import tiny_model_dir
from models.config import read_model_config
from policies.request import Request
from store.kv_cache_ipc import KVHandleError, KVWriteDone, accept_receipt
from store.kv_store_errors import KVStoreError
from store.transfer.links import BudgetedTransfer, LinkBudget, NodeLinks

STEP_TIMES = 4096  # steps whose times ``step_times`` keeps (minutes of decoding)


class DecodeReplica(LoopedReplica):
    def __init__(
        self,
        replica_id: str,
        model_dir: str | None,
        config: EngineConfig,
        serve_tcp: bool = False,
        tcp_host: str = "127.0.0.1",
        cpus: list[int] | None = None,
        threads: int | None = None,
        store_shards: dict[str, Any] | None = None,
        write_back: bool = True,
        link_budget: LinkBudget | None = None,
        record_loads: bool = False,
        store_placement: str = "local",
        kv_route: str = "auto",
    ) -> None:
        """``kv_route``: how prefill workers reach its cache. "auto": device to device on
        a GPU (the only way there), through the transfer layer on the CPU; "ipc": on the
        CPU too, through the shared-memory segment mapped into the prefill process (same
        node); "transfer": the transfer layer only (CPU).
        ``store_shards``: the KV store shards it reads prefixes from for prefill
        replicas (``load_prefix``, DualPath's decode read path) and, with ``write_back``,
        writes every full block back to (the shard ``store_placement`` picks:
        ``policies.shard_choice``). ``link_budget``: its store reads and writes pay
        this replica's emulated storage link (on one machine each replica stands for a
        node). ``record_loads``: keep when each layer of a prefix load was in
        (``load_timeline``).
        ``serve_tcp``: prefill replicas on other nodes stream KV in over TCP to
        ``tcp_host`` (this node's address); same-node ones always use shared memory.
        ``cpus`` / ``threads``: cores the replica's loop runs on, torch threads. ``config``'s
        ``tp`` / ``spp`` spread it over worker actors on this node, each holding its share
        of the cache in its own segment; with ``kvp`` > 1 each KV rank's workers hold that
        rank's pool, and a request's blocks lie on the ranks its reservation spans
        (``KVDestination.ranks``), as a colocated KV-parallel replica lays them out."""
        run_actor_process_at_normal_priority()
        self.replica_id = replica_id
        folder = Path(model_dir) if model_dir is not None else tiny_model_dir("dense")
        model = read_model_config(folder)
        check_kv_route(kv_route)
        if store_shards and cache_device(config.device).type != "cpu":
            raise ValueError(
                "write-back and prefix loads move a decode replica's cache through host "
                "memory: with a store, decode replicas run on the CPU"
            )
        caches = SharedCacheWorkers(
            replica_id,
            model.num_hidden_layers,
            model.num_key_value_heads,
            serve_tcp,
            tcp_host,
            config.device,
            kv_route,
        )
        self.controller = ReplicaController.build(model_dir, config, worker_hooks=caches)
        self.targets: tuple[KVTarget, ...] = self._describe()
        self.client: KVStoreClient | None = None
        self.load_client: KVStoreClient | None = None
        self._written: dict[str, int] = {}  # request -> leading blocks the store holds
        # request -> (tenant, retention seconds, prompt hashes): retained when it finishes
        self._retention: dict[str, tuple[str | None, float, list[int]]] = {}
        self.stored_blocks = 0  # blocks this replica wrote back
        if store_shards:
            if not isinstance(self.controller.executor, LocalExecutor):
                self.controller.shutdown()
                raise ValueError(
                    "write-back and prefix loads use a decode replica's cache in its own "
                    "process: with a store, decode replicas run tp=spp=1"
                )
            self.client = KVStoreClient(
                f"decode-{replica_id}", node_id=self.node(), placement=store_placement
            )
            # loads run on the caller's thread (not the loop), with a client of their own
            self.load_client = KVStoreClient(f"decode-{replica_id}-loads", node_id=self.node())
            for shard_id, handle in store_shards.items():
                self.client.add_shard(shard_id, handle)
                self.load_client.add_shard(shard_id, handle)
        self.write_back = write_back and self.client is not None
        links = NodeLinks(link_budget) if link_budget is not None else None
        self.links = links
        self._storage_link = links.storage(replica_id) if links is not None else None
        if self.client is not None:
            self.client.write_link = self._storage_link  # write-back pays it too
        self._load_lock = threading.Lock()
        # guards _reserved_blocks against loads on other threads: a reservation is never
        # freed while a load writes into its blocks
        self._reservations = threading.Lock()
        self._loading: set[str] = set()
        self._free_after_load: set[str] = set()
        self.loaded_blocks = 0  # blocks read from the store for prefill replicas
        self._crash_on_load = False
        self._record_loads = record_loads
        self._load_timeline: list[tuple[int, float]] = []  # (layer, perf_counter) read
        self._recoveries = 0
        # perf_counter when the last step ended, None after a pass without one: a step that
        # follows another is measured from that end, so a DecodeStep is the gap between
        # tokens a running request sees (the loop's own work between steps included)
        self._last_step_end: float | None = None
        # (start, end) perf_counter of the last STEP_TIMES steps, for bench/pd_profile.py
        self._step_times: deque[tuple[float, float]] = deque(maxlen=STEP_TIMES)
        self._reserved_blocks: dict[str, int] = {}
        self._cached_tokens: dict[str, int] = {}  # admitted request -> prompt tokens reused
        self.returns = ReturnLinks()  # requests whose events go straight to their ingress
        self._token_clock = TokenGapClock()  # loop thread only: those requests' token times
        self.stats = self._stats()
        self.loop = ReplicaLoop(
            self._iterate, f"decode-{replica_id}", cpu_cores=cpus, torch_threads=threads
        )

    def node(self) -> str:
        return self.targets[0].endpoint.node_id

    # -- the Conductor and the prefill side (any thread: through the loop) -------------------
    @ray.method(enable_task_events=False)  # once per request: no record in the GCS
    def reserve(
        self, key: str, request: Request, route: ReturnRoute | None = None
    ) -> KVDestination | None:
        """``route``: where its events go (its ingress), else in the Conductor's reports."""
        return self.loop.call(lambda: self._reserve(key, request, route)).result()

    @ray.method(enable_task_events=False)  # once per request: no record in the GCS
    def admit(
        self,
        key: str,
        first_token: int,
        first_logprob: Any = None,
        cached_tokens: int = 0,
        receipts: tuple[KVWriteDone, ...] = (),
    ) -> None:
        """``cached_tokens``: prompt tokens the prefill side reused, reported in the
        request's output (the Conductor may see its end before the prefill's report).
        ``receipts``: of the blocks written into this replica's caches device to device,
        accepted before the request joins the batch."""
        self.loop.post(
            lambda: self._admit(key, first_token, first_logprob, cached_tokens, receipts)
        )

    def cancel(self, key: str) -> None:
        self.loop.post(lambda: None if self._cancel(key) else None)

    def abort(self, key: str) -> None:
        """Drop a reserved or decoding request and free its blocks (unknown keys: no-op)."""
        self.loop.post(lambda: self._abort(key))

    def reset(self, owner: str) -> None:
        """Conductor ``owner`` attaches (``actors.disagg.pool_actors``): abort every
        reservation and running request the old one placed, and ``claim`` the replica."""

        def reset() -> None:
            for key in {*self.controller.request_ids(), *self._reserved_blocks}:
                self._abort(key)
            self.stats = self._stats()
            self.loop.claim(owner)

        self.loop.call(reset).result()

    def load_prefix(self, key: str, hashes: list[int], block_ids: list[int]) -> Iterator[int]:
        """DualPath's decode read path, layer by layer: read the longest stored prefix of
        ``hashes`` (Full Blocks, through this replica's storage link) into blocks
        ``block_ids`` (same order) of request ``key``'s reservation. A generator (a Ray
        streaming call): after each layer is in it yields the leading blocks loaded, so
        the prefill replica relays layer ``l`` while layer ``l + 1`` is read; a miss or a
        dead shard yields 0 once and stops. Runs on the caller's thread: the blocks are
        reserved, nothing else touches them until the prefill replica's KV arrives."""
        if self._crash_on_load:
            os._exit(1)  # tests only: the relaying replica dies
        client = self.load_client
        executor = self.controller.executor
        if client is None or not isinstance(executor, LocalExecutor):
            yield 0
            return
        with self._reservations:  # a reservation being loaded into is freed only after
            if key not in self._reserved_blocks:
                yield 0  # cancelled or aborted meanwhile
                return
            self._loading.add(key)
        try:
            yield from self._load(client, executor, key, hashes, block_ids)
        finally:
            with self._reservations:
                self._loading.discard(key)
                free = key in self._free_after_load
                self._free_after_load.discard(key)
            if free:
                self.loop.post(lambda: None if self.controller.cancel_reservation(key) else None)

    def _load(
        self,
        client: KVStoreClient,
        executor: LocalExecutor,
        key: str,
        hashes: list[int],
        block_ids: list[int],
    ) -> Iterator[int]:
        with self._load_lock:
            client.refresh()
            pin = client.pin_prefix(key, hashes[: len(block_ids)])
            if pin is None:
                yield 0
                return
            caches = executor.worker.kv_caches
            n = len(pin.offsets)
            link = BudgetedTransfer(client.engine, self._storage_link)
            try:
                for layer in range(len(caches)):
                    local, ranges = KVStoreClient.layer_ranges(
                        caches, layer, pin.offsets, block_ids[:n]
                    )
                    try:
                        link.read_ranges(pin.endpoint, local, ranges)
                    except KVStoreError:
                        client.mark_dead(pin.shard_id)
                        yield 0
                        return
                    if self._record_loads:
                        self._load_timeline.append((layer, time.perf_counter()))
                    yield n
            finally:
                client.unpin(pin)
            self.loaded_blocks += n

    def step_times(self) -> list[tuple[float, float]]:
        """(start, end) ``time.perf_counter()`` of this replica's last ``STEP_TIMES``
        engine steps (CLOCK_MONOTONIC on Linux: one clock for every process of the
        machine, as ``time.monotonic()``)."""
        return list(self._step_times)

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes granted so far on this replica's emulated links (``NodeLinks.granted``;
        empty without a ``link_budget``)."""
        return self.links.granted(self.replica_id) if self.links is not None else {}

    def load_timeline(self) -> list[tuple[int, float]]:
        """``(layer, time.perf_counter())`` as each layer of a prefix load was read (with
        ``record_loads``; one clock for every process of the machine)."""
        return list(self._load_timeline)

    def crash_on_load(self) -> None:
        """Fault injection for tests: the process exits at the next ``load_prefix``."""
        self._crash_on_load = True

    def add_shard(self, shard_id: str, handle: Any) -> None:
        """Use a store shard started after this replica (a dead shard's replacement)."""
        client = self.client
        if client is None:
            return

        def add() -> None:
            assert client is not None
            if shard_id in client.handles:
                client.mark_dead(shard_id)
            client.add_shard(shard_id, handle)

        self.loop.call(add).result()
        if self.load_client is not None:
            with self._load_lock:
                if shard_id in self.load_client.handles:
                    self.load_client.mark_dead(shard_id)
                self.load_client.add_shard(shard_id, handle)

    # the caches are released or replaced, or their KV's weights change: describe again
    def sleep(self, level: int) -> int:
        freed = super().sleep(level)
        self.loop.call(self._refresh_targets).result()
        return freed

    def wake_up(self) -> None:
        super().wake_up()
        self.loop.call(self._refresh_targets).result()

    def update_weights(self, weights: list[object], version: int) -> int:
        got = super().update_weights(weights, version)
        self.loop.call(self._refresh_targets).result()
        return got

    def shutdown(self) -> None:
        self.loop.stop()
        self.controller.shutdown()
        self.returns.close()
        if self.client is not None:
            self.client.close()
        if self.load_client is not None:
            self.load_client.close()

    # -- the loop thread --------------------------------------------------------------------
    def _reserve(
        self, key: str, request: Request, route: ReturnRoute | None
    ) -> KVDestination | None:
        blocks = self.controller.reserve_prefilled(request.with_id(key))
        if blocks is None:
            return None
        self._reserved_blocks[key] = len(blocks)
        if route is not None:
            self.returns.add(key, route)
        if request.params.kv_retention_s > 0 and self.client is not None:
            hint = (request.tenant, request.params.kv_retention_s, request.block_hashes)
            self._retention[key] = hint
        self.stats = self._stats()
        ranks: tuple[int, ...] = ()
        if self.controller.kv.kvp > 1:  # token order over its shards, as reserve_prefilled
            shards = self.controller.kv.shards(key)
            ranks = tuple(rank for rank, _, ids in shards for _ in ids)
        return KVDestination(self.targets, tuple(blocks), ranks=ranks)

    def _admit(
        self,
        key: str,
        first_token: int,
        first_logprob: Any = None,
        cached_tokens: int = 0,
        receipts: tuple[KVWriteDone, ...] = (),
    ) -> None:
        if key not in self._reserved_blocks:
            return  # cancelled or aborted meanwhile
        try:
            self.accept_receipts(receipts)
        except KVHandleError:  # written into a cache since released or replaced
            self._cancel(key)
            self.loop.emit(ReservationLost(key))
            return
        self._reserved_blocks.pop(key)
        self._cached_tokens[key] = cached_tokens
        delta = self.controller.admit_prefilled(key, first_token, first_logprob)
        # the prefill replica stored the prompt's full blocks
        self._written[key] = len(self.controller.computed_full_blocks(key)[0])
        self._emit([delta])

    def _cancel(self, key: str) -> bool:
        self.returns.drop(key)
        with self._reservations:
            self._reserved_blocks.pop(key, None)
            if key in self._loading:  # freed once the store read into its blocks ends
                self._free_after_load.add(key)
                return True
        return self.controller.cancel_reservation(key)

    def _abort(self, key: str) -> None:
        self._written.pop(key, None)
        self._cached_tokens.pop(key, None)
        self._retention.pop(key, None)
        if not self._cancel(key) and self.controller.has_request(key):
            self.controller.abort(key)
            self.controller.release(key)

    def _iterate(self) -> bool:
        c = self.controller
        ran = c.has_unfinished()
        if ran:
            batch = c.scheduler.num_running
            blocks = c.kv.num_used_blocks - sum(self._reserved_blocks.values())
            # block tables before the step: one that finishes a request frees its blocks
            tables = {k: c.block_table(k) for k in self._written} if self.write_back else {}
            start = time.perf_counter()
            deltas = c.step()
            end = time.perf_counter()
            since = self._last_step_end if self._last_step_end is not None else start
            self._last_step_end = end
            self._step_times.append((start, end))
            self.loop.note(DecodeStep(batch, blocks, end - since))
            self._write_back([d.request_id for d in deltas], tables)
            self._retain([d.request_id for d in deltas if d.finished], tables)
            self._emit(deltas)
            if c.num_recoveries != self._recoveries:
                self._lose_reservations()
        else:
            self._last_step_end = None
        self.stats = self._stats()
        return ran

    def accept_receipts(self, receipts: tuple[KVWriteDone, ...]) -> None:
        """KVHandleError unless every receipt is of an export this replica holds now: its
        exporter, generation and weight version (``store.kv_cache_ipc.accept_receipt``)."""
        exports = {t.export.exporter: t.export for t in self.targets if t.export is not None}
        for done in receipts:
            export = exports.get(done.exporter)
            if export is None:
                raise KVHandleError(
                    f"a receipt for cache {done.exporter!r}, which decode replica "
                    f"{self.replica_id!r} no longer exports (its worker was restarted)"
                )
            accept_receipt(export, done)

    def _describe(self) -> tuple[KVTarget, ...]:
        """Every worker's target, each export stamped with the weight version the replica
        runs (a worker's cache provider does not know it)."""
        version = self.controller.weight_version
        return tuple(
            t
            if t.export is None
            else dataclasses.replace(
                t, export=dataclasses.replace(t.export, weight_version=version)
            )
            for t in self.controller.executor.hook_info()
        )

    def _refresh_targets(self) -> None:
        self.targets = self._describe()

    def _lose_reservations(self) -> None:
        """A worker died and the group was restarted with fresh caches: KV streamed into
        the old ones is gone, so every reservation is given up (its request runs again)."""
        self._recoveries = self.controller.num_recoveries
        self._refresh_targets()
        for key in list(self._reserved_blocks):
            self._cancel(key)
            self.loop.emit(ReservationLost(key))

    def _write_back(self, keys: list[str], tables: dict[str, list[int]]) -> None:
        """Write each request's newly full blocks to a store shard, right after the step
        (nothing allocates blocks before the next one on this thread, so a finished
        request's freed blocks, named by ``tables``, still hold its KV)."""
        client = self.client
        if client is None or not self.write_back:
            return
        executor = self.controller.executor
        assert isinstance(executor, LocalExecutor)
        caches = executor.worker.kv_caches
        for key in keys:
            hashes, blocks = self.controller.computed_full_blocks(key, tables.get(key))
            done = self._written.get(key, len(hashes))
            if len(hashes) <= done:
                continue
            self._written[key] = len(hashes)
            shard = self._store_shard(hashes[0])
            if shard is None:
                return
            try:
                stored = client.store_chain_from(shard, hashes, caches, blocks, done)
            except KVStoreError:
                client.mark_dead(shard)
                continue
            self.stored_blocks += len(stored)

    def _retain(self, keys: list[str], tables: dict[str, list[int]]) -> None:
        """Finished requests with a retention hint: their blocks kept on the shards
        (before ``_emit`` releases them, so the chain's hashes are still known)."""
        client = self.client
        for key in keys:
            hint = self._retention.pop(key, None)
            if hint is None or client is None:
                continue
            tenant, seconds, hashes = hint
            if key in tables:
                hashes = self.controller.computed_full_blocks(key, tables[key])[0] or hashes
            client.retain(hashes, tenant, seconds)

    def _store_shard(self, root: int) -> str | None:
        """The live shard the blocks of the prefix whose first block is ``root`` go to
        (``policies.shard_choice``; "local": one on this node, else any)."""
        client = self.client
        return client.pick_shard(None, self.node(), root) if client is not None else None

    def _emit(self, deltas: list[StreamDelta]) -> None:
        """A finished request's last ``TokenDelta`` and its ``Finished`` go out in one
        report: the Conductor must never see a request's end before its output. A routed
        request's go to its ingress first (``ReturnLinks.send``; lost ones end aborted)."""
        now = time.monotonic()
        ends = {d.request_id: self._release(d.request_id) for d in deltas if d.finished}
        lost = self.returns.send(deltas, ends)
        for key in lost:
            if key not in ends and key not in self._reserved_blocks:  # some events lost
                self.controller.abort(key)
                ends[key] = self._release(key)
            if key in ends:
                ends[key].finish_reason = "abort"
        gaps: list[float] = []
        events: list[Any] = []
        for d in deltas:
            key = d.request_id
            if self.returns.routed(key):
                gaps += self._token_clock.gaps(key, len(d.token_ids), now)
            else:
                events.append(TokenDelta(key, d, now))
            if key in ends:
                self.returns.drop(key)
                events.append(Finished(key, ends.pop(key)))
        for key, out in ends.items():  # lost, with no event this step
            self.returns.drop(key)
            events.append(Finished(key, out))
        if gaps:  # before the step's ends: a request's gaps are in the report of its end
            self.loop.note(TokenGaps(tuple(gaps)))
        if events:
            self.loop.emit(*events)

    def _release(self, key: str) -> RequestOutput:
        self._token_clock.forget(key)
        self._written.pop(key, None)
        self._retention.pop(key, None)
        out = self.controller.release(key)
        out.num_cached_tokens = self._cached_tokens.pop(key, 0)
        return out

    def _stats(self) -> DecodeStats:
        c = self.controller
        reserved = sum(self._reserved_blocks.values())
        return DecodeStats(
            num_running=c.scheduler.num_running,
            used_blocks=c.kv.num_used_blocks - reserved,
            pending=len(self._reserved_blocks),
            pending_blocks=reserved,
            total_blocks=c.num_blocks * c.kv.kvp,  # num_blocks is per KV rank
            stored_blocks=self.stored_blocks,
            loaded_blocks=self.loaded_blocks,
            remaining=tuple(
                max(0, q.max_tokens - len(q.output_token_ids)) for q in c.scheduler.running
            ),
        )
