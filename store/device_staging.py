"""A ring of host staging buffers that brings one layer's KV blocks off the device at a time.

A prefill that writes its KV to the store should not wait for the whole step: as soon as a
layer has written its blocks, their bytes can start towards host memory while the next
layer computes. ``DeviceStaging`` does that, per layer:

    staging = DeviceStaging(consumer, piece_bytes, max_blocks, device, depth=2)
    staging.submit(layer, (k_cache, v_cache), block_ids)   # returns once the copy is issued
    ...
    staging.flush()       # every submitted layer delivered (or the consumer's error raised)
    staging.close()

``submit`` takes the next buffer of the ring (in ring order), issues the copy of the layer's
blocks into it and queues the buffer for the consumer; the consumer (one thread, in
submission order) waits for that copy to complete and gets a ``StagedLayer``: the blocks' K
pieces and V pieces as host bytes. The store's write path is the consumer
(``store.staged_block_sink``: a shard's DRAM slots in process, or a remote shard's reserved
ranges through the transfer layer).

The blocks must not be rewritten until ``flush`` returned (on CUDA the copy reads them on
the side stream while the producer's stream runs on): flush at the end of the step, as a
prefill worker's stream hook waits for its copies.

Order and completion are explicit. A buffer is reused only after the copy into it completed
*and* its consumer returned: ``submit`` waits for that (a slow consumer back-pressures the
producer instead of having its bytes overwritten). An error in the consumer is kept, the
items queued behind it are dropped (their buffers freed unread), and the next ``submit`` or
``flush`` raises ``StagingError`` from it: nothing waits forever on a failed consumer.

Devices. On CUDA the buffers are pinned (``pin_memory``); the copy runs on a side stream
that first waits for the producer's current stream (so it sees the layer's writes), with
``non_blocking=True``, and an event recorded after it is what the consumer thread waits on.
On the CPU (where pinning is unavailable) the buffers are plain host tensors and the copy is
synchronous (an ``index_select`` straight into the buffer). Both run this same code; the
CUDA path ran once on a GPU (tests/gpu/README.md), where it refused the cache's tensors
(``cuda`` against ``cuda:0``); the fix has not run on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from store.devices import with_index
from store.kv_store_errors import InvalidBlockError, KVStoreError


class StagingError(KVStoreError, RuntimeError):
    """The consumer of staged layers failed; what it raised is the ``__cause__``."""


@dataclass(frozen=True)
class StagedLayer:
    """One layer's blocks in host memory, handed to the consumer.

    ``k[i]`` and ``v[i]`` are the K and V pieces (``piece_bytes`` each, the bytes of
    ``cache[block_ids[i]]``) of block ``block_ids[i]``; ``start`` is the position of
    ``block_ids[0]`` in the list given to ``submit`` (a layer with more blocks than a buffer
    holds arrives in several parts). ``k`` and ``v`` are views of the ring's buffer
    ``buffer``: valid only during the consumer's call, so copy what must outlive it."""

    layer: int
    block_ids: tuple[int, ...]
    start: int
    k: np.ndarray  # [n, piece_bytes] uint8
    v: np.ndarray  # [n, piece_bytes] uint8
    buffer: int  # which buffer of the ring holds it


Consumer = Callable[[StagedLayer], Any]


class DeviceStaging:
    def __init__(
        self,
        consumer: Consumer,
        piece_bytes: int,
        max_blocks: int,
        device: torch.device | str,
        depth: int = 2,
    ) -> None:
        """``piece_bytes``: bytes of one block of one layer's K (or V) cache;
        ``max_blocks``: blocks one buffer holds; ``depth``: buffers in the ring (layers in
        flight between the device and the consumer)."""
        if min(piece_bytes, max_blocks, depth) <= 0:
            raise InvalidBlockError("piece_bytes, max_blocks and depth must be positive")
        self.consumer = consumer
        self.piece_bytes = piece_bytes
        self.max_blocks = max_blocks
        self.device = with_index(device)  # compares equal to its tensors' device
        self.cuda = self.device.type == "cuda"
        shape = (2, max_blocks, piece_bytes)  # K pieces, then V pieces
        self.buffers = [
            torch.empty(shape, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(depth)
        ]
        self._stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._busy: list[Future[None] | None] = [None] * depth  # each buffer's last delivery
        self._next = 0  # the ring position the next part takes
        self._consumer_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-staging")
        self._error: BaseException | None = None
        self._failed_layer = -1
        self.layers_staged = 0  # parts delivered to the consumer
        self.bytes_staged = 0

    # -- the producer's side (the thread that runs the model) ------------------------------
    def submit(
        self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: Sequence[int]
    ) -> None:
        """Start copying blocks ``block_ids`` of one layer's ``(K, V)`` cache to host
        memory; returns once the copies are issued (on the CPU: done). Waits while the next
        buffer of the ring is still being copied into or consumed. Raises ``StagingError``
        if the consumer failed on an earlier layer."""
        self._raise_if_failed()
        k, v = kv_cache
        if k.device != self.device or v.device != self.device:
            raise InvalidBlockError(
                f"layer {layer}'s cache is on {k.device}/{v.device}, this staging on {self.device}"
            )
        kb, vb = _as_pieces(k), _as_pieces(v)
        if kb.shape[1] != self.piece_bytes or vb.shape != kb.shape:
            raise InvalidBlockError(
                f"layer {layer}'s K/V blocks hold {kb.shape[1]}/{vb.shape[1]} bytes, "
                f"this staging's pieces {self.piece_bytes}"
            )
        ids = [int(b) for b in block_ids]
        if any(not 0 <= b < kb.shape[0] for b in ids):
            raise InvalidBlockError(f"a block id of {ids} is outside the cache ({kb.shape[0]})")
        for start in range(0, len(ids), self.max_blocks):
            part = ids[start : start + self.max_blocks]
            slot = self._next
            self._next = (slot + 1) % len(self.buffers)
            self._wait_free(slot)
            host = self.buffers[slot][:, : len(part)]
            done, keep = self._copy(kb, vb, part, host)
            item = StagedLayer(layer, tuple(part), start, host[0].numpy(), host[1].numpy(), slot)
            self._busy[slot] = self._consumer_thread.submit(self._deliver, item, done, keep)

    def flush(self) -> int:
        """Wait until every submitted layer was delivered; returns the parts delivered so
        far. Raises ``StagingError`` if the consumer failed."""
        for f in self._busy:
            if f is not None:
                f.result()
        self._raise_if_failed()
        return self.layers_staged

    def close(self) -> None:
        """Wait for what is queued (errors are not raised here: ``flush`` first) and free
        the buffers."""
        self._consumer_thread.shutdown(wait=True)
        self._busy = [None] * len(self.buffers)
        self.buffers = []

    def __enter__(self) -> DeviceStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _copy(
        self, kb: torch.Tensor, vb: torch.Tensor, part: list[int], host: torch.Tensor
    ) -> tuple[Any, Any]:
        """Issue the copy of blocks ``part`` into ``host`` ([2, n, piece]); returns (what
        the consumer waits on, what must stay alive until then)."""
        if not self.cuda:  # synchronous, and no temporary: gathered straight into the buffer
            idx = torch.tensor(part, dtype=torch.long)
            torch.index_select(kb, 0, idx, out=host[0])
            torch.index_select(vb, 0, idx, out=host[1])
            return None, None
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the layer's writes first
        with torch.cuda.stream(stream):
            idx = torch.tensor(part, dtype=torch.long).to(self.device, non_blocking=True)
            ksel, vsel = kb.index_select(0, idx), vb.index_select(0, idx)
            host[0].copy_(ksel, non_blocking=True)
            host[1].copy_(vsel, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event, (idx, ksel, vsel)

    def _deliver(self, item: StagedLayer, done: Any, keep: Any) -> None:
        """The consumer thread: wait for the copy, then hand the bytes over (skipped once
        the consumer failed: its buffer is simply freed)."""
        if done is not None:
            done.synchronize()
        del keep
        if self._error is not None:
            return
        try:
            self.consumer(item)
        except BaseException as e:
            self._error, self._failed_layer = e, item.layer
            return
        self.layers_staged += 1
        self.bytes_staged += item.k.nbytes + item.v.nbytes

    def _wait_free(self, slot: int) -> None:
        busy = self._busy[slot]
        if busy is not None:
            busy.result()  # back-pressure: the copy into it and its consumer are done
            self._busy[slot] = None
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StagingError(
                f"the consumer of staged KV failed on layer {self._failed_layer}: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error


def _as_pieces(t: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, ...]`` cache as ``[num_blocks, piece_bytes]`` uint8 (a view)."""
    if not t.is_contiguous():
        raise InvalidBlockError("KV cache tensors must be contiguous to stage their blocks")
    return t.view(torch.uint8).reshape(t.shape[0], -1)
