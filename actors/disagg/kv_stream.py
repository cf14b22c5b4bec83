"""Layer-by-layer KV streaming from prefill workers into a decode replica's paged cache.

Each decode worker keeps its paged KV cache *in* a shared-memory segment
(``SharedKVCache``, its KV-cache provider), laid out as its layers' K then V tensors back
to back (``kv_routes.segment_offset``), so prefill workers write a block's KV straight
into the decode workers' caches: one copy through the transfer layer (shared memory on one
node, TCP across nodes), no staging buffer, no Ray object store, nothing on the
compiled-graph control path. Only a small ``KVDestination`` (every decode worker's
endpoint and share of layers and heads, and the request's block ids) travels on the
control path, inside the step plan. The two sides may shard differently (any tp x spp):
``kv_routes`` works out which bytes go where. Each layer's K and V tensors are registered
with the transfer layer once per step (``LocalMemory``) and every piece is a ``(remote
offset, local offset, nbytes)`` range of them; consecutive ranges merge into one copy.

``LayerStreamer`` runs in a prefill worker's ``StepHook`` (``actors.engine.worker_hooks``):
as soon as layer ``l`` has written a step's KV, the copies of layer ``l``'s pieces for the
requests in that step start on a background thread while layer ``l + 1`` computes
(Mooncake, section 3.1 step 3). ``finish`` waits for every copy of the step and returns
the requests whose copies failed, so once a request's last prefill step returned on every
worker, all of its KV has arrived and it may join the decode batch.

Prefill and decode on the same device take the device-to-device route instead
(``kv_ipc_route``): the decode worker's cache offers an export (``KVTarget.export``; a GPU
cache is a ``DeviceKVCache``, a CPU one a ``SharedKVCache`` made with ``export=True``),
and the streamer, given an ``IPCRoute``, copies each layer's blocks straight into it;
``finish`` then also returns the receipts the decode side accepts before admitting.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from actors.disagg.kv_ipc_route import IPCRoute, cache_device, check_kv_route
from actors.disagg.kv_routes import KVTarget, piece_ranges, sent_heads
from actors.engine.collectives import Layout
from actors.engine.step_plan import StepPlan
from actors.engine.worker_hooks import CacheGeometry, KVCaches, WorkerHooks
from models.sharding import kv_head_range, layer_range
from store.kv_block_layout import KVBlockLayout
from store.kv_cache_ipc import KVCacheExporter, KVCacheImport, KVHandleError, KVWriteDone
from store.shared_segment import SharedSegment
from store.transfer import LocalMemory, TransferEngine
from store.transfer.links import BudgetedTransfer, LinkBudget, NodeLinks


@dataclass(frozen=True)
class KVDestination:
    """Where one request's KV goes: every decode worker's share of the cache, and the
    request's blocks there in token order (block i holds tokens ``[i * bs, (i + 1) * bs)``;
    the same block ids on every decode worker of the KV rank ``ranks[i]`` that holds it,
    and only there: a KV-parallel decode replica holds each block on one rank's pool)."""

    targets: tuple[KVTarget, ...]
    block_ids: tuple[int, ...]
    held_blocks: int = 0  # leading blocks the decode side loaded itself: never streamed
    ranks: tuple[int, ...] = ()  # KV rank of each block (empty: rank 0 holds every block)
    # the weights the prefill side computes this KV with (its replica stamps it): the
    # device-to-device route writes only into a cache of the same version
    weight_version: int | None = None

    def rank_of(self, i: int) -> int:
        return self.ranks[i] if self.ranks else 0


def blocks_to_stream(first_block: int, end: int, block_size: int) -> range:
    """Indices (in the request's block table) a prefill step ending at position ``end``
    sends: from ``first_block`` (0 on a request's first step, so a prefix it found cached,
    which no step computes, goes too; else the block of the step's first token). A partial
    last block is sent now and again, whole, by the step that completes it."""
    return range(first_block, -(-end // block_size))


class SharedKVCache:
    """A ``KVCacheProvider`` whose paged KV cache lives in a shared-memory segment served
    by a transfer engine: a decode worker's. The segment is made at the first ``allocate``
    and handed out again after a worker restart in the same process. ``release`` (the
    worker sleeps) frees the segment's memory but keeps its name, mapping and endpoint, so
    prefill workers reach the same cache after the wake. ``export``: also offer the cache
    to prefill processes on this node as a ``KVCacheExport`` of the segment ("shm"
    handles; ``kv_ipc_route``); ``release`` revokes it (the next generation is the same
    memory, but an importer learns the pages were given back)."""

    def __init__(
        self,
        endpoint_id: str,
        node_id: str,
        layers: tuple[int, int],
        heads: tuple[int, int],
        serve_tcp: bool = False,
        tcp_host: str = "127.0.0.1",
        kvp_rank: int = 0,
        export: bool = False,
    ) -> None:
        """``layers`` / ``heads``: the global layers and KV heads the worker holds;
        ``kvp_rank``: the KV-parallel rank whose pool it holds. ``serve_tcp``: also serve
        the cache over TCP on ``tcp_host`` (an address other nodes reach), for prefill
        replicas on other nodes."""
        self._where = (endpoint_id, node_id, serve_tcp, tcp_host)
        self.offers_export = export
        self.exporter: KVCacheExporter | None = None
        self.layers, self.heads, self.kvp_rank = layers, heads, kvp_rank
        self.geometry: CacheGeometry | None = None
        self.kv_caches: KVCaches = []
        self.segment: SharedSegment | None = None
        self.engine: TransferEngine | None = None
        self.released = False  # the segment's pages are freed until the next allocate

    def allocate(self, geometry: CacheGeometry) -> KVCaches:
        if self.geometry is not None:
            if geometry != self.geometry:
                raise ValueError("the shared cache does not match the worker's cache geometry")
            if self.released and self.segment is not None:
                self.segment.prefault()
                self.released = False
            return self.kv_caches
        g = geometry
        if (g.num_layers, g.num_kv_heads) != (
            self.layers[1] - self.layers[0],
            self.heads[1] - self.heads[0],
        ):
            raise ValueError("the shared cache's layers and heads do not match the worker's")
        endpoint_id, node_id, serve_tcp, tcp_host = self._where
        piece = piece_bytes_of(g.block_size, g.num_kv_heads, g.head_dim, g.dtype)
        self.segment = SharedSegment.create(2 * g.num_layers * g.num_blocks * piece)
        self.engine = TransferEngine(
            endpoint_id, node_id, self.segment, serve_tcp=serve_tcp, tcp_host=tcp_host
        )
        flat = torch.frombuffer(self.segment.array, dtype=g.dtype)
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        per = g.num_blocks * g.block_size * g.num_kv_heads * g.head_dim
        self.kv_caches = [
            (
                flat[(2 * i) * per : (2 * i + 1) * per].view(shape),
                flat[(2 * i + 1) * per : (2 * i + 2) * per].view(shape),
            )
            for i in range(g.num_layers)
        ]
        if self.offers_export:
            self.exporter = KVCacheExporter(
                f"{endpoint_id}#{self.segment.name}",
                self.kv_caches,
                segment=self.segment,
                node=node_id,
            )
        self.geometry = geometry
        return self.kv_caches

    def release(self) -> int:
        if self.segment is None or self.released:
            return 0
        self.released = True
        if self.exporter is not None:
            self.exporter.revoke()
        return self.segment.release_pages()

    def describe(self) -> KVTarget:
        """How a prefill worker reaches this cache."""
        g, engine = self.geometry, self.engine
        if g is None or engine is None:
            raise RuntimeError("the shared cache is allocated when its worker starts")
        export = self.exporter.export() if self.exporter is not None else None
        return KVTarget.of_cache(engine.endpoint, self.layers, self.heads, g, self.kvp_rank, export)

    def close(self) -> None:
        self.kv_caches = []
        if self.engine is not None:
            self.engine.close()
        if self.segment is not None:
            self.segment.close()


def piece_bytes_of(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class StreamReport:
    """One worker's streaming in one step."""

    failed: dict[str, str]  # request id -> why its copies failed
    bytes_sent: int
    layers_sent: int
    chunks: list[tuple[int, int]]  # (new tokens, context tokens) of each request it ran
    # request id -> receipts of its blocks written device to device (``kv_ipc_route``)
    receipts: dict[str, list[KVWriteDone]] = field(default_factory=dict)


@dataclass
class _Item:
    request_id: str
    dest: KVDestination
    src: list[int]  # prefill-side block ids
    dst: list[int]  # decode-side block ids, same order
    ranks: list[int]  # the decode-side KV rank of each, same order
    # per target (same order as dest.targets): its mapping, or None (the transfer layer)
    mappings: list[KVCacheImport | None] = field(default_factory=list)


class LayerStreamer:
    """A prefill worker's per-layer KV streaming of the step's requests that carry a
    destination (``PlanEntry.kv_dest``); a replica's own prefills stay local."""

    def __init__(
        self,
        engine: TransferEngine | BudgetedTransfer,
        block_size: int,
        held: tuple[int, int],
        sent: tuple[int, int],
        route: IPCRoute | None = None,
    ) -> None:
        """``held``: the global KV heads this worker caches; ``sent``: those it sends
        (``kv_routes.sent_heads``: a replicated head goes from one worker only).
        ``engine``: a ``BudgetedTransfer`` makes the stream pay a link (KV class).
        ``route``: write into decode caches on this device through their exports where
        it can (``kv_ipc_route``; device-to-device copies pay no link)."""
        self.engine = engine
        self.block_size = block_size
        self.held, self.sent = held, sent
        self.route = route
        self._items: list[_Item] = []
        self._failed: dict[str, str] = {}  # request id -> why, found while issuing copies
        self._futures: list[tuple[str, Future[int]]] = []
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="kv-stream")
        self.bytes_sent = 0
        self.layers_sent = 0
        self._layers_reported = 0
        self._ipc_bytes = 0  # this step's, written through the route
        self._chunks: list[tuple[int, int]] = []

    def begin(self, plan: StepPlan, kv_caches: KVCaches | None = None) -> None:
        """``kv_caches``: this worker's cache (the device-to-device route needs it)."""
        self._items = []
        self._chunks = [(e.num_tokens, e.start) for e in plan.entries]
        for e in plan.entries:
            dest = e.kv_dest
            if dest is None:
                continue
            blocks = e.shards[0][2]
            idx = [
                i
                for i in blocks_to_stream(e.stream_from_block, e.end, self.block_size)
                if dest.held_blocks <= i < len(dest.block_ids)
            ]
            src, dst = [blocks[i] for i in idx], [dest.block_ids[i] for i in idx]
            ranks = [dest.rank_of(i) for i in idx]
            item = _Item(e.request_id, dest, src, dst, ranks)
            if self.route is not None and kv_caches:
                try:
                    item.mappings = self._mappings(dest, kv_caches)
                except KVHandleError as err:
                    self._failed[e.request_id] = f"{type(err).__name__}: {err}"
                    continue
            self._items.append(item)

    def _mappings(self, dest: KVDestination, kv_caches: KVCaches) -> list[KVCacheImport | None]:
        route = self.route
        assert route is not None
        layout, device = KVBlockLayout.of(kv_caches), kv_caches[0][0].device
        return [route.mapping(t, dest.weight_version, layout, device) for t in dest.targets]

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not self._items:
            return
        local: LocalMemory | None = None  # registered on first use, once for the step
        piece = v_base = 0
        for item in self._items:
            for t, target in enumerate(item.dest.targets):
                src, dst = item.src, item.dst
                if item.dest.ranks:  # only the blocks this target's KV rank holds
                    mine = [k for k, r in enumerate(item.ranks) if r == target.kvp_rank]
                    src, dst = [src[k] for k in mine], [dst[k] for k in mine]
                imp = item.mappings[t] if item.mappings else None
                if imp is not None:
                    self._write_mapped(item.request_id, target, imp, layer, kv_cache, src, dst)
                    continue
                if local is None:
                    if kv_cache[0].device.type != "cpu":
                        self._fail_off_host(item.request_id, target, kv_cache[0].device)
                        continue
                    # this layer's K and V tensors, registered once for every request of
                    # the step: K's block s lies at local offset s * piece, V's at v_base +
                    # s * piece
                    local = LocalMemory(kv_cache[0], kv_cache[1])
                    piece = local.sizes[0] // kv_cache[0].shape[0]
                    v_base = local.starts[1]
                ranges = piece_ranges(target, layer, self.held, self.sent, piece, v_base, src, dst)
                if ranges:
                    future = self._threads.submit(
                        self.engine.write_ranges, target.endpoint, local, ranges
                    )
                    self._futures.append((item.request_id, future))
        self.layers_sent += 1

    def _write_mapped(
        self,
        request_id: str,
        target: KVTarget,
        imp: KVCacheImport,
        layer: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        src: list[int],
        dst: list[int],
    ) -> None:
        if request_id in self._failed or not target.layers[0] <= layer < target.layers[1]:
            return
        assert self.route is not None
        try:
            self._ipc_bytes += self.route.write(request_id, target, imp, layer, kv_cache, src, dst)
        except KVHandleError as e:
            self._failed[request_id] = f"{type(e).__name__}: {e}"

    def _fail_off_host(self, request_id: str, target: KVTarget, device: torch.device) -> None:
        self._failed.setdefault(
            request_id,
            f"decode cache {target.endpoint.endpoint_id!r} is reachable only through the "
            f"transfer layer, which moves host memory, and this worker's cache is on {device}"
            ": on one GPU use the device-to-device route (kv_route auto or ipc on both sides)",
        )

    def wait_started(self) -> None:
        """Block until every copy started so far has finished (or failed)."""
        for _, f in self._futures:
            f.exception()

    def finish(self) -> StreamReport:
        """Wait for every copy of this step; the report names the requests whose copies
        failed (the decode side died or its segment is gone), and carries the receipts
        of the blocks written device to device."""
        futures, self._futures, self._items = self._futures, [], []
        failed, self._failed = self._failed, {}
        report = StreamReport(failed, 0, self.layers_sent - self._layers_reported, self._chunks)
        self._layers_reported = self.layers_sent
        for rid, f in futures:
            try:
                report.bytes_sent += f.result()
            except Exception as e:
                report.failed[rid] = f"{type(e).__name__}: {e}"
        if self.route is not None:
            receipts, broken = self.route.complete()
            report.failed.update(broken)
            report.receipts = {k: r for k, r in receipts.items() if k not in report.failed}
            report.bytes_sent += self._ipc_bytes
            self._ipc_bytes = 0
        self.bytes_sent += report.bytes_sent
        return report

    def drop_mappings(self) -> None:
        """Close every mapping of a decode cache (this worker sleeps or updates weights:
        the decode side is releasing or replacing its caches too)."""
        if self.route is not None:
            self.route.drop()

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.drop_mappings()


class StreamHook:
    """A prefill worker's ``StepHook`` that only streams (the multi-worker layouts)."""

    def __init__(self, streamer: LayerStreamer) -> None:
        self.streamer = streamer

    def begin_step(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        self.streamer.begin(plan, kv_caches)

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.streamer.after_layer(layer, kv_cache)

    def end_step(self, plan: StepPlan, kv_caches: KVCaches) -> StreamReport:
        return self.streamer.finish()


@dataclass(frozen=True)
class StreamingWorkers:
    """``HooksFactory`` of a prefill replica's workers: each streams the layers and heads
    it holds (a replicated head from the lowest TP rank holding it). ``num_layers`` > 0:
    each also keeps its cache in a shared-memory segment (``SharedKVCache``) that the
    replica maps to read and write the KV store (``actors.disagg.stage_caches``).
    ``link_budget``: the replica's node links; each of its ``tp * spp`` workers streams
    through an equal share of the compute link (KV class)."""

    replica_id: str
    block_size: int
    num_kv_heads: int
    num_layers: int = 0
    link_budget: LinkBudget | None = None

    def __call__(self, coords: tuple[int, int, int], layout: Layout) -> WorkerHooks:
        from actors.kvstore.shard import current_node_id

        tp_rank, stage, kvp_rank = coords
        ranges = [kv_head_range(self.num_kv_heads, layout.tp, t) for t in range(layout.tp)]
        held = ranges[tp_rank]
        engine = TransferEngine(
            f"prefill-{self.replica_id}-{tp_rank}.{stage}.{kvp_rank}", current_node_id()
        )
        link = None
        if self.link_budget is not None:
            links = NodeLinks(self.link_budget.share(layout.tp * layout.spp))
            link = links.compute(self.replica_id)
        stream = BudgetedTransfer(engine, link)
        streamer = LayerStreamer(stream, self.block_size, held, sent_heads(held, tp_rank, ranges))
        cache = None
        if self.num_layers > 0:
            cache = SharedKVCache(
                f"prefill-{self.replica_id}-cache-{tp_rank}.{stage}.{kvp_rank}",
                current_node_id(),
                layer_range(self.num_layers, layout.spp, stage),
                held,
            )
        return WorkerHooks(kv_cache=cache, step=StreamHook(streamer))


@dataclass(frozen=True)
class SharedCacheWorkers:
    """``HooksFactory`` of a decode replica's workers: each keeps its share of the cache in
    a shared-memory segment (``SharedKVCache``) that prefill workers write into, or, on a
    GPU, in device memory exported to prefill workers on the same GPU
    (``DeviceKVCache``). ``device``: the engine config's (None: as the engine picks it);
    ``kv_route``: "ipc" also exports a CPU cache (``kv_ipc_route``)."""

    replica_id: str
    num_layers: int
    num_kv_heads: int
    serve_tcp: bool = False
    tcp_host: str = "127.0.0.1"
    device: str | None = None
    kv_route: str = "auto"

    def __call__(self, coords: tuple[int, int, int], layout: Layout) -> WorkerHooks:
        from actors.disagg.device_kv_cache import DeviceKVCache
        from actors.kvstore.shard import current_node_id

        tp_rank, stage, kvp_rank = coords
        name = f"decode-{self.replica_id}-{tp_rank}.{stage}.{kvp_rank}"
        layers = layer_range(self.num_layers, layout.spp, stage)
        heads = kv_head_range(self.num_kv_heads, layout.tp, tp_rank)
        if cache_device(self.device).type != "cpu":
            if check_kv_route(self.kv_route) == "transfer":
                raise ValueError(
                    "a decode cache on a GPU is reached only device to device (no transfer "
                    'backend moves device memory yet): use kv_route="auto" or "ipc"'
                )
            return WorkerHooks(DeviceKVCache(name, current_node_id(), layers, heads, kvp_rank))
        cache = SharedKVCache(
            name,
            current_node_id(),
            layers,
            heads,
            self.serve_tcp,
            self.tcp_host,
            kvp_rank,
            export=check_kv_route(self.kv_route) == "ipc",
        )
        return WorkerHooks(kv_cache=cache)
