"""Sharing a decode replica's paged KV cache with a prefill replica on the same device.

When prefill and decode run as two processes on one GPU (or, on the CPU, one node), the
prefill side can write a request's KV straight into the decode side's cache, device to
device, with no host copy and no transfer engine. The protocol:

1. The decode side (the *exporter*) exports its caches once: ``KVCacheExporter(...)
   .export()`` gives a ``KVCacheExport``, a small picklable record sent on the control path
   (a Ray call, a pipe): one ``TensorHandle`` per layer for K and one for V, the block
   layout, the number of blocks, the device, the weight version, and a *generation*.
2. The prefill side (the *importer*) opens it: ``KVCacheImport.open(export, layout,
   weight_version, device)`` checks it and maps every tensor, or refuses with
   ``KVHandleError`` saying what differs: the protocol version, the block layout (which
   field), the weight version, the device (kind, which GPU). It refuses before mapping
   anything.
3. The importer writes blocks (``write_blocks`` / ``write_layer`` from its own cache on the
   same device, ``scatter`` of host bytes) and then calls ``complete(block_ids)``: it waits
   for its copies (on CUDA: a synchronize of the stream that issued them) and returns a
   ``KVWriteDone`` receipt that it sends to the exporter on the control path. The exporter
   reads those blocks only after ``accept(receipt)``, which refuses a receipt of another
   exporter, generation or weight version (a write that raced a revoke).
4. The importer must drop its mapping (``close``) when the exporter revokes the export
   (``revoke``: its caches are about to be freed or replaced, at a sleep, a worker restart
   or a weight update; the generation moves on and the exporter tells its importers on the
   control path), when it has to open a newer generation, and before the exporter's
   process exits. On CUDA a mapping keeps the exporter's allocation alive (torch's IPC
   reference counting), so an importer that does not drop it keeps the memory in use.

Handle formats (``TensorHandle.kind``):

- ``"cuda_ipc"``: ``args`` are the arguments of
  ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` as ``reduce_tensor`` makes them
  (a ``cudaIpcMemHandle`` of the tensor's allocation, its offsets, torch's IPC reference
  counter). The export names the GPU by UUID; the importer maps it on the local device of
  that UUID (device indices differ between processes with different visible devices).
- ``"shm"``: ``args`` are ``(segment name, segment bytes, byte offset)``: the tensor lies in
  a ``store.shared_segment.SharedSegment`` (a decode worker's ``SharedKVCache`` keeps its
  cache in one), which the importer attaches by name. The export names the node.

The CUDA path runs the same code as the CPU path and is tested on the CPU only; it has not
run on a GPU.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from store.block_key import address_of
from store.kv_block_layout import KVBlockLayout, KVCaches
from store.kv_store_errors import KVStoreError
from store.shared_segment import DEFAULT_SHM_DIR, SharedSegment

PROTOCOL_VERSION = 1


class KVHandleError(KVStoreError, ValueError):
    """An export refused (it does not fit this side: the message says what differs), or a
    receipt refused by the exporter."""


@dataclass(frozen=True)
class TensorHandle:
    kind: str  # "cuda_ipc" | "shm"
    args: tuple[Any, ...]


@dataclass(frozen=True)
class KVCacheExport:
    version: int  # PROTOCOL_VERSION of the exporter
    exporter: str
    generation: int  # moves on at each revoke: a mapping of an older one is stale
    layout: KVBlockLayout
    num_blocks: int
    device: str  # "cuda" or "cpu"
    place: str  # CUDA: the GPU's UUID; CPU: the node (host name) whose shared memory holds it
    weight_version: int | None
    handles: tuple[tuple[TensorHandle, TensorHandle], ...]  # per layer: (K, V)


@dataclass(frozen=True)
class KVWriteDone:
    """The importer's receipt: these blocks of the exporter's cache are written."""

    exporter: str
    generation: int
    weight_version: int | None
    block_ids: tuple[int, ...]
    nbytes: int


def gpu_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device (the same in every process, unlike its index)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class KVCacheExporter:
    def __init__(
        self,
        exporter: str,
        kv_caches: KVCaches,
        weight_version: int | None = None,
        segment: SharedSegment | None = None,
        node: str | None = None,
        generation: int = 0,
    ) -> None:
        """``kv_caches``: the decode side's paged cache (``(K, V)`` per layer, each
        ``[num_blocks, block_size, heads, head_dim]``), on CUDA or, on the CPU, views of
        ``segment``. ``node``: this node's name (default: the host name). ``generation``:
        the first one it exports (a cache allocated again after its exporter revoked:
        that exporter's generation, so its importers see the old mapping is stale)."""
        self.exporter = exporter
        self.generation = generation
        self.weight_version = weight_version
        self.segment = segment
        self.node = node or socket.gethostname()
        self._export: KVCacheExport | None = None
        self._caches = list(kv_caches)
        self.layout = KVBlockLayout.of(self._caches)

    def export(self) -> KVCacheExport:
        """This generation's export (made once, then the same record)."""
        if self._export is None:
            self._export = self._make()
        return self._export

    def revoke(self, kv_caches: KVCaches | None = None, weight_version: int | None = None) -> int:
        """The caches are about to be freed or replaced (a sleep, a restart, a weight
        update): importers must drop their mappings, and receipts of the old generation
        are refused from now on. ``kv_caches`` / ``weight_version``: what the next export
        describes. Returns the new generation."""
        self.generation += 1
        self._export = None
        if kv_caches is not None:
            self._caches = list(kv_caches)
            self.layout = KVBlockLayout.of(self._caches)
        if weight_version is not None:
            self.weight_version = weight_version
        return self.generation

    def accept(self, done: KVWriteDone) -> tuple[int, ...]:
        """Check a receipt; returns the blocks it says are written (readable now)."""
        return _check_receipt(done, self.exporter, self.generation, self.weight_version)

    def _make(self) -> KVCacheExport:
        first = self._caches[0][0]
        for i, (k, v) in enumerate(self._caches):
            for name, t in (("K", k), ("V", v)):
                if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise KVHandleError(
                        f"layer {i}'s {name} cache differs from layer 0's K in shape, "
                        "dtype or device"
                    )
                if not t.is_contiguous():
                    raise KVHandleError(f"layer {i}'s {name} cache is not contiguous")
        if first.device.type == "cuda":
            handles = tuple((_cuda_handle(k), _cuda_handle(v)) for k, v in self._caches)
            device, place = "cuda", gpu_uuid(first.device)
        elif first.device.type == "cpu":
            seg = self.segment
            if seg is None:
                raise KVHandleError(
                    "a CPU cache is shared from a shared-memory segment (a SharedKVCache's); "
                    "pass segment= the one its tensors are views of"
                )
            handles = tuple((_shm_handle(seg, k), _shm_handle(seg, v)) for k, v in self._caches)
            device, place = "cpu", self.node
        else:
            raise KVHandleError(f"caches on {first.device} cannot be shared between processes")
        return KVCacheExport(
            PROTOCOL_VERSION,
            self.exporter,
            self.generation,
            self.layout,
            int(first.shape[0]),
            device,
            place,
            self.weight_version,
            handles,
        )


class KVCacheImport:
    """The exporter's caches mapped into this process (``kv_caches``), until ``close``."""

    def __init__(
        self, export: KVCacheExport, kv_caches: KVCaches, segments: list[SharedSegment]
    ) -> None:
        self.export = export
        self.kv_caches = list(kv_caches)
        self.device = self.kv_caches[0][0].device
        self._segments = segments
        self._written = 0
        # the last block lists written and their index tensors on the device: a step's
        # layers write the same blocks, so they are checked and copied to the device once
        self._index: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.Tensor] | None
        self._index = None

    @classmethod
    def open(
        cls,
        export: KVCacheExport,
        layout: KVBlockLayout,
        weight_version: int | None = None,
        device: torch.device | str | None = None,
        node: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
    ) -> KVCacheImport:
        """Map ``export`` if it fits this side: the blocks of ``layout`` at
        ``weight_version``, written from ``device`` (default: the export's kind, GPU by
        UUID) on ``node`` (default: this host). Raises KVHandleError naming what differs."""
        check_export(export, layout, weight_version)
        if export.device == "cuda":
            local = _local_gpu(export.place)
            if device is not None and torch.device(device) != local:
                raise KVHandleError(
                    f"this side computes on {torch.device(device)}, the exporter's cache is "
                    f"on GPU {export.place} ({local} here): CUDA IPC copies stay on one GPU"
                )
            caches = [(_rebuild_cuda(k, local), _rebuild_cuda(v, local)) for k, v in export.handles]
            return cls(export, caches, [])
        if device is not None and torch.device(device).type != "cpu":
            raise KVHandleError(
                f"this side computes on {torch.device(device)}, the exporter's cache is in "
                "host shared memory"
            )
        here = node or socket.gethostname()
        if export.place != here:
            raise KVHandleError(
                f"the exporter's cache is in shared memory on node {export.place!r}, this "
                f"side runs on {here!r}: use a transfer backend across nodes"
            )
        segments: dict[str, SharedSegment] = {}
        caches = []
        try:
            for k, v in export.handles:
                caches.append(
                    (_map_shm(k, export, segments, shm_dir), _map_shm(v, export, segments, shm_dir))
                )
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise
        return cls(export, caches, list(segments.values()))

    # -- writes into the exporter's cache --------------------------------------------------
    def write_layer(
        self,
        layer: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> int:
        """Copy blocks ``src_blocks`` of one layer of this side's cache into blocks
        ``dst_blocks`` of the exporter's same layer (device to device; issued on the current
        stream, complete after ``complete``). Returns the bytes copied."""
        if len(src_blocks) != len(dst_blocks):
            raise KVHandleError("one destination block per source block")
        if not dst_blocks:
            return 0
        dk, dv = self._layer(layer)
        sk, sv = kv_cache
        if sk.device != self.device:
            raise KVHandleError(f"the source cache is on {sk.device}, the mapping on {self.device}")
        src, dst = self._indices(src_blocks, dst_blocks)
        dk.index_copy_(0, dst, sk.index_select(0, src))
        dv.index_copy_(0, dst, sv.index_select(0, src))
        n = 2 * len(dst_blocks) * self.export.layout.piece_bytes
        self._written += n
        return n

    def write_blocks(
        self, kv_caches: KVCaches, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> int:
        """``write_layer`` for every layer."""
        return sum(
            self.write_layer(i, kv, src_blocks, dst_blocks) for i, kv in enumerate(kv_caches)
        )

    def scatter(self, data: object, block_id: int) -> None:
        """Write a stored block's host bytes (``KVBlockLayout`` order) into block
        ``block_id`` of the exporter's cache."""
        self._check_blocks([block_id])
        self.export.layout.scatter(data, self.kv_caches, block_id)
        self._written += self.export.layout.block_bytes

    def complete(self, block_ids: Sequence[int]) -> KVWriteDone:
        """Wait until every write issued so far is done; the receipt to send the exporter."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        e = self.export
        done = KVWriteDone(
            e.exporter,
            e.generation,
            e.weight_version,
            tuple(int(b) for b in block_ids),
            self._written,
        )
        self._written = 0
        return done

    def close(self) -> None:
        """Drop the mapping (the exporter revoked, or this side is done with it)."""
        self.kv_caches = []
        segments, self._segments = self._segments, []
        for seg in segments:
            seg.close()

    def __enter__(self) -> KVCacheImport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kv_caches:
            raise KVHandleError(f"the mapping of {self.export.exporter!r}'s cache was dropped")
        if not 0 <= layer < len(self.kv_caches):
            raise KVHandleError(f"layer {layer} is outside the exporter's {len(self.kv_caches)}")
        return self.kv_caches[layer]

    def _indices(
        self, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block lists as index tensors on the mapping's device (``[n]`` int64), the
        destinations checked; the last pair is kept for the next layer's write."""
        src_key, dst_key = tuple(src_blocks), tuple(dst_blocks)
        held = self._index
        if held is not None and held[0] == src_key and held[1] == dst_key:
            return held[2], held[3]
        self._check_blocks(dst_key)
        both = torch.tensor([src_key, dst_key], dtype=torch.long)
        if self.device.type == "cuda":
            both = both.pin_memory().to(self.device, non_blocking=True)
        self._index = (src_key, dst_key, both[0], both[1])
        return both[0], both[1]

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        if not self.kv_caches:
            raise KVHandleError(f"the mapping of {self.export.exporter!r}'s cache was dropped")
        n = self.export.num_blocks
        bad = [b for b in blocks if not 0 <= b < n]
        if bad:
            raise KVHandleError(f"blocks {bad} are outside the exporter's cache ({n} blocks)")


def check_export(export: KVCacheExport, layout: KVBlockLayout, weight_version: int | None) -> None:
    """KVHandleError unless ``export`` is of this protocol, ``layout`` and weight version."""
    if export.version != PROTOCOL_VERSION:
        raise KVHandleError(
            f"the export is in handle format v{export.version}, this side reads "
            f"v{PROTOCOL_VERSION}: run one release on both sides"
        )
    if export.device not in ("cuda", "cpu"):
        raise KVHandleError(f"an export of a {export.device!r} cache: only cuda and cpu are shared")
    if export.layout != layout:
        diff = ", ".join(
            f"{f.name} {getattr(export.layout, f.name)} (exporter) != "
            f"{getattr(layout, f.name)} (here)"
            for f in fields(KVBlockLayout)
            if getattr(export.layout, f.name) != getattr(layout, f.name)
        )
        raise KVHandleError(f"block layout mismatch with {export.exporter!r}: {diff}")
    if export.weight_version != weight_version:
        raise KVHandleError(
            f"{export.exporter!r}'s cache holds KV of weight version {export.weight_version}, "
            f"this side computes version {weight_version}: open its export after both updated"
        )
    if len(export.handles) != layout.num_layers:
        raise KVHandleError(
            f"the export has {len(export.handles)} layers of handles, its layout "
            f"{layout.num_layers}"
        )


def accept_receipt(export: KVCacheExport, done: KVWriteDone) -> tuple[int, ...]:
    """``KVCacheExporter.accept`` against the export record the exporter's owner holds now
    (its latest, as its importers were sent it): where the exporter itself is out of reach
    (a worker's KV-cache provider, behind its replica)."""
    return _check_receipt(done, export.exporter, export.generation, export.weight_version)


def _check_receipt(
    done: KVWriteDone, exporter: str, generation: int, weight_version: int | None
) -> tuple[int, ...]:
    if done.exporter != exporter:
        raise KVHandleError(f"a receipt for {done.exporter!r} reached {exporter!r}")
    if done.generation != generation:
        raise KVHandleError(
            f"the receipt is for generation {done.generation} of {exporter!r}'s "
            f"cache, which is at {generation}: those writes may have hit freed memory"
        )
    if done.weight_version != weight_version:
        raise KVHandleError(
            f"the receipt's KV is of weight version {done.weight_version}, the cache's "
            f"{weight_version}"
        )
    return done.block_ids


# -- handles -------------------------------------------------------------------------------
def _cuda_handle(t: torch.Tensor) -> TensorHandle:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(t)
    if rebuild is not rebuild_cuda_tensor:  # pragma: no cover - torch changed its format
        raise KVHandleError(f"torch reduces a CUDA tensor with {rebuild.__name__}")
    return TensorHandle("cuda_ipc", tuple(args))


def _rebuild_cuda(h: TensorHandle, local: torch.device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if h.kind != "cuda_ipc":
        raise KVHandleError(f"a {h.kind!r} handle in a CUDA export")
    args = list(h.args)
    if len(args) != 15 or not isinstance(args[6], int):  # pragma: no cover - torch changed
        raise KVHandleError("a CUDA IPC handle of a format this torch does not rebuild")
    args[6] = local.index  # storage_device: the exporter's index of that GPU, here ours
    return rebuild_cuda_tensor(*args)  # type: ignore[no-any-return]


def _local_gpu(uuid: str) -> torch.device:
    if not torch.cuda.is_available():
        raise KVHandleError(
            f"the exporter's cache is on CUDA GPU {uuid}; CUDA is not available in this process"
        )
    for i in range(torch.cuda.device_count()):
        d = torch.device("cuda", i)
        if gpu_uuid(d) == uuid:
            return d
    raise KVHandleError(
        f"GPU {uuid} is not visible in this process: CUDA IPC needs both processes on one "
        "node with that GPU visible to both"
    )


def _shm_handle(seg: SharedSegment, t: torch.Tensor) -> TensorHandle:
    base = address_of(seg.array)
    offset = t.data_ptr() - base
    nbytes = t.numel() * t.element_size()
    if not 0 <= offset <= seg.nbytes - nbytes:
        raise KVHandleError(
            f"a cache tensor lies outside shared-memory segment {seg.name!r}: export the "
            "segment its tensors are views of"
        )
    return TensorHandle("shm", (seg.name, seg.nbytes, offset))


def _map_shm(
    h: TensorHandle, export: KVCacheExport, segments: dict[str, SharedSegment], shm_dir: str
) -> torch.Tensor:
    if h.kind != "shm":
        raise KVHandleError(f"a {h.kind!r} handle in a CPU export")
    name, seg_bytes, offset = h.args
    seg = segments.get(name)
    if seg is None:
        seg = segments[name] = SharedSegment.attach(name, seg_bytes, shm_dir)
    lay = export.layout
    shape = (export.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    nbytes = export.num_blocks * lay.piece_bytes
    flat: np.ndarray = seg.array[offset : offset + nbytes]
    if flat.size != nbytes:
        raise KVHandleError(f"segment {name!r} is shorter than the export says")
    return torch.frombuffer(flat, dtype=torch.uint8).view(lay.dtype).view(shape)
