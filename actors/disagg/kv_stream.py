"""Layer-by-layer KV streaming from a prefill worker into a decode replica's paged cache.

The decode replica keeps its paged KV cache *in* a shared-memory segment
(``SharedKVCache``), laid out as every layer's K then V tensor back to back:

    piece (layer l, kind k in {0: K, 1: V}, block b) lies at byte
    ((2 * l + k) * num_blocks + b) * piece_bytes                (``segment_offset``)

so the prefill side writes a block's KV straight into the decode worker's cache: one copy
through the transfer layer (shared memory on one node, TCP across nodes), no staging
buffer, no Ray object store, nothing on the compiled-graph control path. Only a small
``KVDestination`` (endpoint, geometry, block ids) travels on the control path. Each layer's
K and V tensors are registered with the transfer layer once per step (``LocalMemory``) and
every piece is a ``(remote offset, local offset, nbytes)`` range of them, so a step's copies
cost integer arithmetic plus the memcpy; consecutive blocks on both sides merge into one.

``LayerStreamer`` runs inside the prefill worker's ``StepHook`` (see
``actors.engine.worker_hooks``): as soon as layer ``l`` has written a step's KV, the copies
of layer ``l``'s pieces for the requests in that step start on a background thread while
layer ``l + 1`` computes (Mooncake, section 3.1 step 3).
``end_step`` waits for every copy of the step, so once a request's last prefill step
returned, all of its KV has arrived and it may join the decode batch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from actors.engine.step_plan import StepPlan
from actors.engine.worker_hooks import CacheGeometry, KVCaches
from store.shared_segment import SharedSegment
from store.transfer import Endpoint, LocalMemory, TransferEngine


@dataclass(frozen=True)
class KVDestination:
    """Where one request's KV goes: the decode cache segment and the request's blocks
    there, in token order (block i holds tokens ``[i * bs, (i + 1) * bs)``)."""

    endpoint: Endpoint
    num_blocks: int  # blocks per layer tensor in the decode cache
    piece_bytes: int  # bytes of one block of one K or V tensor
    block_ids: tuple[int, ...]


def segment_offset(num_blocks: int, piece_bytes: int, layer: int, kind: int, block: int) -> int:
    """Byte offset of (layer, K=0/V=1, block) in a ``SharedKVCache`` segment."""
    return ((2 * layer + kind) * num_blocks + block) * piece_bytes


def blocks_to_stream(start: int, end: int, first_step: bool, block_size: int) -> range:
    """Indices (in the request's block table) a prefill step over positions ``[start,
    end)`` must send: the blocks it wrote, and on a request's first step also every
    earlier block (a prefix it found cached, which no step computes). A partial last block
    is sent now and again, whole, by the step that completes it."""
    lo = 0 if first_step else start // block_size
    return range(lo, -(-end // block_size))


def piece_bytes_of(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class SharedKVCache:
    """A ``KVCacheProvider`` (``actors.engine.worker_hooks``) whose paged KV cache lives in a
    shared-memory segment served by a transfer engine: the decode side. The segment is made
    at the first ``allocate`` and handed out again after a worker restart, so a prefill
    replica's writes keep landing in the cache the decode worker reads."""

    def __init__(
        self, endpoint_id: str, node_id: str, serve_tcp: bool = False, tcp_host: str = "127.0.0.1"
    ) -> None:
        """``serve_tcp``: also serve the cache over TCP on ``tcp_host`` (an address other
        nodes reach), for prefill replicas on other nodes."""
        self._where = (endpoint_id, node_id, serve_tcp, tcp_host)
        self.geometry: CacheGeometry | None = None
        self.kv_caches: KVCaches = []
        self.num_blocks = 0
        self.piece_bytes = 0
        self.segment: SharedSegment | None = None
        self.engine: TransferEngine | None = None

    def allocate(self, geometry: CacheGeometry) -> KVCaches:
        if self.geometry is not None:
            if geometry != self.geometry:
                raise ValueError("the shared cache does not match the worker's cache geometry")
            return self.kv_caches
        g = geometry
        endpoint_id, node_id, serve_tcp, tcp_host = self._where
        self.num_blocks = g.num_blocks
        self.piece_bytes = piece_bytes_of(g.block_size, g.num_kv_heads, g.head_dim, g.dtype)
        self.segment = SharedSegment.create(2 * g.num_layers * g.num_blocks * self.piece_bytes)
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
        self.geometry = geometry
        return self.kv_caches

    @property
    def endpoint(self) -> Endpoint:
        if self.engine is None:
            raise RuntimeError("the shared cache is allocated when its worker starts")
        return self.engine.endpoint

    def destination(self, block_ids: list[int]) -> KVDestination:
        return KVDestination(self.endpoint, self.num_blocks, self.piece_bytes, tuple(block_ids))

    def close(self) -> None:
        self.kv_caches = []
        if self.engine is not None:
            self.engine.close()
        if self.segment is not None:
            self.segment.close()


@dataclass
class _Item:
    request_id: str
    dest: KVDestination
    src: list[int]  # prefill-side block ids
    dst: list[int]  # decode-side block ids, same order


class LayerStreamer:
    """Per-layer KV streaming of the requests registered with ``expect``."""

    def __init__(self, engine: TransferEngine, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self.destinations: dict[str, KVDestination] = {}
        self._started: set[str] = set()
        self._items: list[_Item] = []
        self._futures: list[tuple[str, Future[int]]] = []
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="kv-stream")
        self.failed: dict[str, str] = {}  # request id -> why its stream broke
        self.bytes_sent = 0
        self.layers_sent = 0

    def expect(self, request_id: str, dest: KVDestination) -> None:
        self.destinations[request_id] = dest

    def forget(self, request_id: str) -> None:
        self.destinations.pop(request_id, None)
        self._started.discard(request_id)
        self.failed.pop(request_id, None)

    def begin_step(self, plan: StepPlan) -> None:
        """Work out which blocks of which requests this step sends (none for requests
        without a destination: a replica's own prefills stay local)."""
        bs = self.block_size
        self._items = []
        for e in plan.entries:
            dest = self.destinations.get(e.request_id)
            if dest is None or e.request_id in self.failed:
                continue
            first = e.request_id not in self._started
            self._started.add(e.request_id)
            blocks = e.shards[0][2]
            idx = [
                i for i in blocks_to_stream(e.start, e.end, first, bs) if i < len(dest.block_ids)
            ]
            self._items.append(
                _Item(
                    e.request_id, dest, [blocks[i] for i in idx], [dest.block_ids[i] for i in idx]
                )
            )

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not self._items:
            return
        # this layer's K and V tensors, registered once for every request of the step:
        # K's block s lies at local offset s * piece, V's at v_base + s * piece
        local = LocalMemory(kv_cache[0], kv_cache[1])
        piece = local.sizes[0] // kv_cache[0].shape[0]
        v_base = local.starts[1]
        for item in self._items:
            d = item.dest
            ranges: list[tuple[int, int, int]] = []
            for kind, base in ((0, 0), (1, v_base)):
                for s, t in zip(item.src, item.dst, strict=True):
                    off = segment_offset(d.num_blocks, d.piece_bytes, layer, kind, t)
                    ranges.append((off, base + s * piece, piece))
            future = self._threads.submit(self._write, d, local, ranges)
            self._futures.append((item.request_id, future))
        self.layers_sent += 1

    def _write(
        self, dest: KVDestination, local: LocalMemory, ranges: list[tuple[int, int, int]]
    ) -> int:
        return self.engine.write_ranges(dest.endpoint, local, ranges)

    def wait_started(self) -> None:
        """Block until every copy started so far has finished (or failed)."""
        for _, f in self._futures:
            f.exception()

    def end_step(self) -> None:
        """Wait for every copy of this step; a failed one marks its request ``failed``."""
        futures, self._futures, self._items = self._futures, [], []
        for rid, f in futures:
            try:
                self.bytes_sent += f.result()
            except Exception as e:  # the decode side died or its segment is gone
                self.failed[rid] = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self._threads.shutdown(wait=True)
