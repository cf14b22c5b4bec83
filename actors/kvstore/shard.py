"""The KV store shard actor (one per node) and the client workers use to reach shards.

``KVStoreShard`` is a plain class: a ``store.ShardStore`` whose DRAM tier lives in a shared
memory segment, plus a ``TransferEngine`` that serves that segment (to same-node processes
by mapping it, to other nodes over TCP). Deploy it with ``kv_store_shard_actor()`` (Ray,
``num_cpus=0``). Only small control messages go through its methods: hashes, offsets,
endpoints. KV bytes move through the transfer layer, one copy, never through Ray.

    shard = KVStoreShard(shard_id, block_bytes, dram_bytes, ssd_bytes=0, ssd_dir=None,
                         node_id=None, serve_tcp=True, tcp_host="127.0.0.1",
                         serve_nixl=None, tenant_retained_share=1.0)
    shard.endpoint() -> Endpoint
    shard.begin_put(hashes, nbytes, parents=None) -> list[int | None]  # offsets to write
    shard.commit_put(hashes) -> list[int] / shard.abort_put(hashes)
    shard.acquire(request_id, hashes) -> list[BlockLocation]            # pinned, in DRAM
    shard.release(request_id) -> int
    shard.pull(source: Endpoint, blocks: list[BlockLocation]) -> list[int]  # replica copy
    shard.match_prefix(hashes) -> int; remove(hashes) -> int; stats()
    shard.retain(hashes, tenant, seconds) -> int     # a session's turn ended (store.retention)
    shard.events_since(cursor) -> (cursor, events, snapshot | None)   # directory feed

``KVStoreClient`` runs where a worker or the Conductor runs. It keeps the ``BlockDirectory``
and one handle per shard; a shard that died (its calls raise ``RayActorError``) drops out
of the directory and its blocks read as misses, so the caller recomputes:

    client = KVStoreClient(client_id, directory=None, node_id=None)
    client.add_shard(shard_id, handle) -> Endpoint | None
    client.put_blocks(shard_id, hashes, blocks, parents=None) -> list[int]
    client.get_blocks(request_id, hashes, outs) -> int           # leading blocks loaded
    client.store_from_cache(shard_id, hashes, kv_caches, block_ids, parents=None)
    client.store_chain_from(shard_id, hashes, kv_caches, block_ids, start)  # a prefix's tail
    client.pick_shard(wanted, node_id, root=None) -> str | None  # policies.shard_choice
    client.store_chain(hashes, kv_caches, block_ids, start, wanted, node_id) -> int
    client.load_into_cache(request_id, hashes, kv_caches, block_ids) -> int
    client.pin_prefix(request_id, hashes) -> StorePin | None ; client.unpin(pin)
    KVStoreClient.pin_ranges(kv_caches, pin.offsets, block_ids) -> (local, ranges)
    client.change_replica(hashes, src_shard, dst_shard, move=False) -> list[int]
    client.retain(hashes, tenant, seconds)         # on every live shard, not awaited
    client.refresh() (apply shard events) ; client.mark_dead(shard_id)
Calls block on ``ray.get``; from async code run them in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from policies.shard_choice import check_placement, key_owner, local_choice
from store.block_directory import BlockDirectory
from store.kv_block_layout import KVBlockLayout, KVCaches
from store.kv_store_errors import (
    InvalidBlockError,
    KVStoreError,
    StoreFullError,
    TransferError,
)
from store.shard_store import BlockLocation, ShardStore
from store.shared_segment import DEFAULT_SHM_DIR, SharedSegment
from store.transfer import Endpoint, LocalMemory, TransferEngine
from store.transfer.links import BudgetedTransfer, Link

DEAD = (RayActorError, ActorUnavailableError)
LOG_LIMIT = 100_000  # events a shard keeps for directory readers


@dataclass(frozen=True)
class StorePin:
    """A stored prefix pinned for reading: its shard and the blocks' offsets there."""

    shard_id: str
    pin_id: str
    endpoint: Endpoint
    offsets: list[int]


def current_node_id() -> str:
    """Ray's node id inside a Ray process, else the host name."""
    if ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


class KVStoreShard:
    def __init__(
        self,
        shard_id: str,
        block_bytes: int,
        dram_bytes: int,
        ssd_bytes: int = 0,
        ssd_dir: str | None = None,
        node_id: str | None = None,
        serve_tcp: bool = True,
        tcp_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        tenant_retained_share: float = 1.0,
        serve_nixl: bool | None = None,
    ) -> None:
        if block_bytes <= 0 or dram_bytes < block_bytes:
            raise InvalidBlockError("need block_bytes > 0 and dram_bytes >= block_bytes")
        self.shard_id = shard_id
        self.segment = SharedSegment.create((dram_bytes // block_bytes) * block_bytes, shm_dir)
        self.store = ShardStore(
            block_bytes,
            dram_bytes,
            ssd_bytes,
            ssd_dir,
            dram_buffer=self.segment.array,
            tenant_retained_share=tenant_retained_share,
        )
        self.engine = TransferEngine(
            shard_id,
            node_id or current_node_id(),
            self.segment,
            serve_tcp=serve_tcp,
            tcp_host=tcp_host,
            advertise_host=advertise_host,
            shm_dir=shm_dir,
            serve_nixl=serve_nixl,
        )
        self._log: list[tuple[str, int]] = []  # events since _log_base, for every reader
        self._log_base = 0

    def endpoint(self) -> Endpoint:
        return self.engine.endpoint

    def ping(self) -> str:
        return self.shard_id

    # -- writes: the writer reserves, copies through the transfer layer, commits -----------
    def begin_put(
        self, hashes: list[int], nbytes: int | list[int], parents: list[int | None] | None = None
    ) -> list[int | None]:
        """Reserve invisible slots; one entry per handled hash, in order: the byte offset to
        write to, or None when the block is already stored or in flight. Shorter than
        ``hashes`` when the shard is full of pinned blocks."""
        sizes = [nbytes] * len(hashes) if isinstance(nbytes, int) else list(nbytes)
        parents = parents if parents is not None else [None, *hashes[:-1]]
        if not len(sizes) == len(parents) == len(hashes):
            raise InvalidBlockError("hashes, nbytes and parents must have the same length")
        out: list[int | None] = []
        for h, n, p in zip(hashes, sizes, parents, strict=True):
            try:
                view = self.store.begin_put(h, n, p)
            except StoreFullError:
                break
            out.append(None if view is None else self.store.dram.location(int(h))[0])
        return out

    def commit_put(self, hashes: list[int]) -> list[int]:
        for h in hashes:
            self.store.commit_put(h)
        return [int(h) for h in hashes]

    def abort_put(self, hashes: list[int]) -> None:
        for h in hashes:
            if self.store.dram.is_pending(int(h)):
                self.store.abort_put(h)

    # -- reads: the reader acquires (pins), copies, releases --------------------------------
    def acquire(self, request_id: str, hashes: list[int]) -> list[BlockLocation]:
        return self.store.acquire(request_id, hashes)

    def release(self, request_id: str) -> int:
        return self.store.release(request_id)

    def match_prefix(self, hashes: list[int]) -> int:
        return self.store.match_prefix(hashes)

    def retain(self, hashes: list[int], tenant: str | None, seconds: float) -> int:
        return self.store.retain(hashes, tenant, seconds)

    # -- replicas ---------------------------------------------------------------------------
    def pull(self, source: Endpoint, blocks: list[BlockLocation]) -> list[int]:
        """Copy blocks the source shard pinned into this shard (change_replica's target
        side); returns the hashes now visible here because of it."""
        reserved, ops = [], []
        for loc in blocks:
            try:
                view = self.store.begin_put(loc.block_hash, loc.nbytes, loc.parent)
            except StoreFullError:
                break
            if view is not None:
                reserved.append(loc.block_hash)
                ops.append((loc.offset, view))
        try:
            self.engine.read(source, ops)
        except BaseException:
            self.abort_put(reserved)
            raise
        return self.commit_put(reserved)

    def remove(self, hashes: list[int]) -> int:
        return sum(self.store.remove(h) for h in hashes if not self.store.is_pinned(int(h)))

    @ray.method(enable_task_events=False)  # polled by every Conductor: no record in the GCS
    def events_since(self, cursor: int) -> tuple[int, list[tuple[str, int]], list[int] | None]:
        """Changes since ``cursor`` for any number of readers: ``(new cursor, events,
        None)``, or ``(new cursor, [], every hash held)`` when ``cursor`` fell out of the
        bounded log (the reader then replaces what it knew of this shard)."""
        self._log.extend(self.store.drain_events())
        if len(self._log) > LOG_LIMIT:
            drop = len(self._log) - LOG_LIMIT
            del self._log[:drop]
            self._log_base += drop
        end = self._log_base + len(self._log)
        if cursor < self._log_base or cursor > end:
            return end, [], sorted(self.store.held())
        return end, self._log[cursor - self._log_base :], None

    @ray.method(enable_task_events=False)  # polled: no record in the GCS
    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def close(self) -> None:
        self.engine.close()
        self.segment.close()


def kv_store_shard_actor(**options: Any) -> Any:
    """``KVStoreShard`` as a Ray actor class (``num_cpus=0`` unless overridden)."""
    return ray.remote(**{"num_cpus": 0, **options})(KVStoreShard)


class KVStoreClient:
    def __init__(
        self,
        client_id: str,
        directory: BlockDirectory | None = None,
        node_id: str | None = None,
        prefer: Sequence[str] = (),
        placement: str = "key",
    ) -> None:
        """``placement``: which shard a prefix is written to (``policies.shard_choice``)."""
        self.placement = check_placement(placement)
        self.directory = directory if directory is not None else BlockDirectory()
        self.engine = TransferEngine(client_id, node_id or current_node_id(), prefer=prefer)
        # writes pay this link (its node's emulated storage link, KV class); None: unlimited
        self.write_link: Link | None = None
        self.handles: dict[str, Any] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self._cursors: dict[str, int] = {}
        self._ids = itertools.count()

    def add_shard(self, shard_id: str, handle: Any) -> Endpoint | None:
        """Start using a shard; None (and nothing added) if it is already dead."""
        try:
            ep: Endpoint = ray.get(handle.endpoint.remote())
        except DEAD:
            return None
        self.handles[shard_id] = handle
        self.endpoints[shard_id] = ep
        self.directory.add_shard(shard_id)
        return ep

    def mark_dead(self, shard_id: str) -> int:
        """Drop a dead shard: out of the directory; returns how many blocks it held."""
        ep = self.endpoints.pop(shard_id, None)
        self.handles.pop(shard_id, None)
        self._cursors.pop(shard_id, None)
        if ep is not None:
            self.engine.forget(ep)
        return self.directory.remove_shard(shard_id)

    def refresh(self) -> list[str]:
        """Apply every live shard's events to the directory; returns shards found dead."""
        dead = []
        for shard_id, handle in list(self.handles.items()):
            try:
                cursor, events, snapshot = ray.get(
                    handle.events_since.remote(self._cursors.get(shard_id, 0))
                )
            except DEAD:
                self.mark_dead(shard_id)
                dead.append(shard_id)
                continue
            self._cursors[shard_id] = cursor
            if snapshot is not None:
                self.directory.remove_shard(shard_id)
                self.directory.add_shard(shard_id)
                events = [("stored", h) for h in snapshot]
            self.directory.apply_events(shard_id, events)
        return dead

    def retain(self, hashes: list[int], tenant: str | None, seconds: float) -> None:
        """Retain ``hashes`` for ``seconds`` on every live shard (each keeps those it
        holds). Not awaited: a shard handles calls from one caller in order, so blocks this
        client wrote before are retained; a dead shard's blocks are gone anyway."""
        if seconds <= 0 or not hashes:
            return
        hashes = [int(h) for h in hashes]
        for handle in self.handles.values():
            handle.retain.remote(hashes, tenant, float(seconds))

    # -- writes ----------------------------------------------------------------------------
    def put_blocks(
        self,
        shard_id: str,
        hashes: list[int],
        blocks: Sequence[Any],
        parents: list[int | None] | None = None,
    ) -> list[int]:
        """Write blocks (contiguous buffers) to a shard; returns hashes stored by this
        call. Blocks already there or the shard being full shorten the list."""
        local = LocalMemory(*blocks)
        per_block = [[(0, start, n)] for start, n in zip(local.starts, local.sizes, strict=True)]
        return self._put(shard_id, hashes, local, per_block, parents)

    def store_from_cache(
        self,
        shard_id: str,
        hashes: list[int],
        kv_caches: KVCaches,
        block_ids: list[int],
        parents: list[int | None] | None = None,
    ) -> list[int]:
        """Write full paged-cache blocks straight from a worker's KV cache."""
        pieces, num_blocks, piece = self._cache_geometry(kv_caches)
        local = self._register_cache(kv_caches)
        per_block = [self._cache_ranges(pieces, num_blocks, piece, b, 0) for b in block_ids]
        return self._put(shard_id, hashes, local, per_block, parents)

    def store_chain_from(
        self,
        shard_id: str,
        hashes: list[int],
        kv_caches: KVCaches,
        block_ids: list[int],
        start: int,
    ) -> list[int]:
        """``store_from_cache`` of blocks ``start..`` of one chained prefix (``hashes`` and
        ``block_ids`` cover the whole prefix): each block's parent is the block before it."""
        parents: list[int | None] = [hashes[start - 1] if start else None, *hashes[start:-1]]
        return self.store_from_cache(
            shard_id, hashes[start:], kv_caches, block_ids[start:], parents
        )

    def pick_shard(self, wanted: str | None, node_id: str, root: int | None = None) -> str | None:
        """The live shard to write a prefix whose first block is ``root`` to (None: none
        is live): by ``placement`` (``policies.shard_choice``), the owner of ``root``, or
        ``wanted``, else one on ``node_id``, else any (also when ``root`` is not known)."""
        if self.placement == "key" and root is not None:
            return key_owner(root, self.endpoints)
        local = [s for s, ep in self.endpoints.items() if ep.node_id == node_id]
        return local_choice(wanted, local, self.endpoints)

    def store_chain(
        self,
        hashes: list[int],
        kv_caches: KVCaches,
        block_ids: list[int],
        start: int,
        wanted: str | None,
        node_id: str,
    ) -> int:
        """``store_chain_from`` blocks ``start..`` of one chained prefix to
        ``pick_shard(wanted, node_id, hashes[0])``; a shard that fails is marked dead and the next
        one tried (a dead shard costs only cache). Returns blocks stored."""
        stored = 0
        while True:
            shard = self.pick_shard(wanted, node_id, hashes[0])
            if shard is None:
                return stored
            try:
                stored += len(self.store_chain_from(shard, hashes, kv_caches, block_ids, start))
            except KVStoreError:
                self.mark_dead(shard)
                continue
            if shard in self.endpoints:
                return stored  # written (or the shard is full): done with this prefix

    @staticmethod
    def _cache_geometry(kv_caches: KVCaches) -> tuple[int, int, int]:
        """(pieces per block, blocks per cache tensor, bytes per piece) of a paged cache."""
        layout = KVBlockLayout.of(kv_caches)
        return 2 * layout.num_layers, int(kv_caches[0][0].shape[0]), layout.piece_bytes

    @staticmethod
    def _register_cache(kv_caches: KVCaches) -> LocalMemory:
        """A paged cache's tensors registered for range transfers, in the stored block's
        piece order (layer 0 K, layer 0 V, layer 1 K, ...)."""
        first = kv_caches[0][0]
        tensors = [t for pair in kv_caches for t in pair]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
            raise InvalidBlockError("every layer's K and V cache must have one shape and dtype")
        return LocalMemory(*tensors)

    @staticmethod
    def _cache_ranges(
        pieces: int, num_blocks: int, piece: int, block_id: int, remote: int
    ) -> list[tuple[int, int, int]]:
        """Ranges between cache block ``block_id`` and a stored block at ``remote``: piece j
        lies at ``remote + j * piece`` there and at local offset ``(j * num_blocks +
        block_id) * piece`` of the memory ``_register_cache`` registered."""
        if not 0 <= block_id < num_blocks:
            raise InvalidBlockError(f"block id {block_id} is outside the cache")
        local = block_id * piece
        step = num_blocks * piece
        return [(remote + j * piece, local + j * step, piece) for j in range(pieces)]

    def _put(
        self,
        shard_id: str,
        hashes: list[int],
        local: LocalMemory,
        per_block: list[list[tuple[int, int, int]]],
        parents: list[int | None] | None,
    ) -> list[int]:
        """``per_block``: each block's ranges ``(offset in the stored block, local offset,
        nbytes)`` of ``local``."""
        if len(per_block) != len(hashes):
            raise InvalidBlockError("one block per hash")
        handle, ep = self.handles[shard_id], self.endpoints[shard_id]
        sizes = [sum(n for _, _, n in ranges) for ranges in per_block]
        parents = parents if parents is not None else [None, *hashes[:-1]]
        stored: list[int] = []
        start = 0
        try:
            while start < len(hashes):  # a batch stops where the shard has no free slot
                end = len(hashes)
                offsets = ray.get(
                    handle.begin_put.remote(hashes[start:end], sizes[start:end], parents[start:end])
                )
                if not offsets:
                    break  # full of pinned or pending blocks: the rest is not stored
                todo = [
                    (hashes[start + i], off, per_block[start + i])
                    for i, off in enumerate(offsets)
                    if off is not None
                ]
                ranges = [(off + rel, lo, n) for _, off, block in todo for rel, lo, n in block]
                try:
                    BudgetedTransfer(self.engine, self.write_link).write_ranges(ep, local, ranges)
                except TransferError:
                    handle.abort_put.remote([h for h, _, _ in todo])
                    raise
                stored += ray.get(handle.commit_put.remote([h for h, _, _ in todo]))
                start += len(offsets)
        except DEAD:
            self.mark_dead(shard_id)
        for h in stored:
            self.directory.add(h, shard_id)
        return stored

    # -- reads -----------------------------------------------------------------------------
    def get_blocks(self, request_id: str, hashes: list[int], outs: Sequence[Any]) -> int:
        """Load the longest stored prefix of ``hashes`` into ``outs`` (one writable buffer
        per block, of the block's size); returns how many leading blocks were loaded. The
        rest (a miss, a dead shard) is the caller's to recompute."""
        return self._get(
            request_id,
            hashes,
            lambda: LocalMemory(*outs),
            lambda mem, i, off: [(off, mem.starts[i], mem.sizes[i])],
        )

    def load_into_cache(
        self, request_id: str, hashes: list[int], kv_caches: KVCaches, block_ids: list[int]
    ) -> int:
        """Load the longest stored prefix of ``hashes`` straight into paged-cache blocks
        ``block_ids`` (one copy from the shard's segment); returns blocks loaded."""
        pieces, num_blocks, piece = self._cache_geometry(kv_caches)
        return self._get(
            request_id,
            hashes,
            lambda: self._register_cache(kv_caches),
            lambda mem, i, off: self._cache_ranges(pieces, num_blocks, piece, block_ids[i], off),
        )

    def _get(
        self,
        request_id: str,
        hashes: list[int],
        register: Callable[[], LocalMemory],
        ranges_for: Callable[[LocalMemory, int, int], list[tuple[int, int, int]]],
    ) -> int:
        """``register()``: the local memory to load into (called once, when a holder is
        found); ``ranges_for(local, i, offset)``: block i's ranges from ``offset``."""
        local: LocalMemory | None = None
        while True:
            shard_id, n = self.directory.best_holder(hashes)
            if shard_id is None or n == 0:
                return 0
            handle, ep = self.handles[shard_id], self.endpoints[shard_id]
            pin_id = f"{request_id}#{next(self._ids)}"
            try:
                locs: list[BlockLocation] = ray.get(handle.acquire.remote(pin_id, hashes[:n]))
                try:
                    if local is None:
                        local = register()
                    mem = local
                    ranges = [
                        r for i, loc in enumerate(locs) for r in ranges_for(mem, i, loc.offset)
                    ]
                    self.engine.read_ranges(ep, mem, ranges)
                finally:
                    handle.release.remote(pin_id)
            except (*DEAD, TransferError):
                self.mark_dead(shard_id)
                continue  # another holder may have the prefix; else a miss
            return len(locs)  # fewer than n: evicted since (refresh() catches up) or
            # DRAM full of pinned blocks; either way the rest is a miss for this call

    # -- per-layer reads (the caller copies, layer by layer, while the prefix is pinned) --
    def pin_prefix(self, request_id: str, hashes: list[int]) -> StorePin | None:
        """Pin the longest stored prefix of ``hashes`` on its best live holder (None: a
        miss). The blocks stay in that shard's DRAM until ``unpin``."""
        while True:
            shard_id, n = self.directory.best_holder(hashes)
            if shard_id is None or n == 0:
                return None
            handle = self.handles[shard_id]
            pin_id = f"{request_id}#{next(self._ids)}"
            try:
                locs: list[BlockLocation] = ray.get(handle.acquire.remote(pin_id, hashes[:n]))
            except DEAD:
                self.mark_dead(shard_id)
                continue
            if not locs:
                handle.release.remote(pin_id)
                return None
            return StorePin(shard_id, pin_id, self.endpoints[shard_id], [x.offset for x in locs])

    def unpin(self, pin: StorePin) -> None:
        handle = self.handles.get(pin.shard_id)
        if handle is not None:
            handle.release.remote(pin.pin_id)  # a dead shard's pins died with it

    @staticmethod
    def layer_ranges(
        kv_caches: KVCaches, layer: int, offsets: list[int], block_ids: list[int]
    ) -> tuple[LocalMemory, list[tuple[int, int, int]]]:
        """The registered cache and the ranges that move layer ``layer``'s K and V of the
        stored blocks at ``offsets`` into cache blocks ``block_ids`` (same order)."""
        pieces, num_blocks, piece = KVStoreClient._cache_geometry(kv_caches)
        local = KVStoreClient._register_cache(kv_caches)
        ranges = []
        for off, b in zip(offsets, block_ids, strict=True):
            per = KVStoreClient._cache_ranges(pieces, num_blocks, piece, b, off)
            ranges += per[2 * layer : 2 * layer + 2]
        return local, ranges

    @staticmethod
    def pin_ranges(
        kv_caches: KVCaches, offsets: list[int], block_ids: list[int]
    ) -> tuple[LocalMemory, list[tuple[int, int, int]]]:
        """The registered cache and the ranges that move every layer's K and V of the
        stored blocks at ``offsets`` (a ``StorePin``'s) into cache blocks ``block_ids``
        (same order): one read of a whole pinned prefix."""
        pieces, num_blocks, piece = KVStoreClient._cache_geometry(kv_caches)
        local = KVStoreClient._register_cache(kv_caches)
        ranges = [
            r
            for off, b in zip(offsets, block_ids, strict=True)
            for r in KVStoreClient._cache_ranges(pieces, num_blocks, piece, b, off)
        ]
        return local, ranges

    # -- replicas --------------------------------------------------------------------------
    def change_replica(
        self, hashes: list[int], src_shard: str, dst_shard: str, move: bool = False
    ) -> list[int]:
        """Copy (``move``: then drop at the source) the stored prefix of ``hashes`` from
        one shard to another, shard to shard through the transfer layer; returns the hashes
        the destination now holds because of it."""
        src, dst = self.handles[src_shard], self.handles[dst_shard]
        pin_id = f"replica-{src_shard}-{dst_shard}#{next(self._ids)}"
        try:
            locs = ray.get(src.acquire.remote(pin_id, hashes))
            try:
                copied: list[int] = ray.get(dst.pull.remote(self.endpoints[src_shard], locs))
            finally:
                src.release.remote(pin_id)
        except DEAD:
            self.refresh()
            return []
        for h in copied:
            self.directory.add(h, dst_shard)
        if move and copied:
            ray.get(src.remove.remote(copied))
            for h in copied:
                self.directory.discard(h, src_shard)
        return copied

    def close(self) -> None:
        self.engine.close()
