"""Where staged layers land: stored blocks, assembled one layer at a time.

A stored block is its 2 * num_layers pieces back to back (``store.kv_block_layout``: piece
``2 * layer`` is the layer's K, ``2 * layer + 1`` its V). ``DeviceStaging`` delivers one
layer's pieces for several blocks at once; a sink writes them where the block's bytes go,
at ``2 * layer * piece_bytes`` and ``(2 * layer + 1) * piece_bytes`` inside each block:

- ``ShardPutSink``: a ``ShardStore`` in this process (the DRAM tier's put). The blocks are
  reserved up front (``begin_put``, invisible to lookups), filled layer by layer, and
  committed only once every layer of every block arrived (``commit``); ``abort`` drops
  them (a failed step, a consumer error), so a half-written block is never visible.
- ``RangesSink``: a shard elsewhere, whose slots were reserved on the control path (the
  offsets its ``begin_put`` returned): each layer is one ``write_ranges`` of the transfer
  layer from the staging buffer, the caller commits after its last layer.

Either is a ``DeviceStaging`` consumer (a callable taking a ``StagedLayer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from store.device_staging import StagedLayer
from store.kv_block_layout import KVBlockLayout
from store.kv_store_errors import InvalidBlockError, WriteStateError
from store.shard_store import ShardStore
from store.transfer.endpoint import LocalMemory, Ranges


class ShardPutSink:
    def __init__(
        self,
        store: ShardStore,
        layout: KVBlockLayout,
        hashes: Sequence[int],
        block_ids: Sequence[int],
        parents: Sequence[int | None] | None = None,
    ) -> None:
        """Reserve one DRAM slot per block: cache block ``block_ids[i]`` is stored under
        ``hashes[i]`` (``parents``: each one's chain parent; default, the block before).
        A hash the shard already holds or is writing is skipped."""
        if len(hashes) != len(block_ids):
            raise InvalidBlockError("one cache block per hash")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidBlockError("a cache block is listed twice")
        self.store, self.layout = store, layout
        parents = list(parents) if parents is not None else [None, *hashes[:-1]]
        self._views: dict[int, tuple[int, np.ndarray]] = {}  # cache block -> (hash, slot)
        try:
            for h, b, p in zip(hashes, block_ids, parents, strict=True):
                view = store.begin_put(h, layout.block_bytes, p)
                if view is not None:
                    self._views[int(b)] = (int(h), view)
        except BaseException:
            self.abort()
            raise
        self._layers: dict[int, set[int]] = {b: set() for b in self._views}

    def __call__(self, staged: StagedLayer) -> None:
        pb = self.layout.piece_bytes
        if not 0 <= staged.layer < self.layout.num_layers:
            raise InvalidBlockError(f"layer {staged.layer} is outside the layout")
        at = 2 * staged.layer * pb
        for i, b in enumerate(staged.block_ids):
            entry = self._views.get(b)
            if entry is None:
                continue  # already stored, or not one of this sink's blocks
            view = entry[1]
            view[at : at + pb] = staged.k[i]
            view[at + pb : at + 2 * pb] = staged.v[i]
            self._layers[b].add(staged.layer)

    def commit(self) -> list[int]:
        """Make every reserved block visible; returns their hashes. WriteStateError (and
        nothing visible) if some layer of some block never arrived."""
        missing = {
            b: n for b, got in self._layers.items() if (n := self.layout.num_layers - len(got))
        }
        if missing:
            self.abort()
            raise WriteStateError(f"cache blocks {sorted(missing)} miss layers: nothing stored")
        stored = [h for h, _ in self._views.values()]
        for h in stored:
            self.store.commit_put(h)
        self._views.clear()
        return stored

    def abort(self) -> None:
        """Drop every reserved block (nothing of them was ever visible)."""
        views, self._views = self._views, {}
        for h, _ in views.values():
            self.store.abort_put(h)


class RangesSink:
    def __init__(
        self,
        write_ranges: Callable[[LocalMemory, Ranges], int],
        layout: KVBlockLayout,
        offsets: dict[int, int],
    ) -> None:
        """``offsets``: cache block id -> byte offset of its reserved stored block in the
        remote segment (blocks not listed are not sent); ``write_ranges(local, ranges)``:
        the transfer layer's write to that remote (e.g. ``functools.partial(engine.
        write_ranges, endpoint)``)."""
        self.write_ranges = write_ranges
        self.layout = layout
        self.offsets = offsets
        self.bytes_sent = 0

    def __call__(self, staged: StagedLayer) -> None:
        pb = self.layout.piece_bytes
        n = len(staged.block_ids)
        local = LocalMemory(staged.k, staged.v)  # K pieces at i * pb, V at n * pb + i * pb
        at = 2 * staged.layer * pb
        ranges: list[tuple[int, int, int]] = []
        for i, b in enumerate(staged.block_ids):
            off = self.offsets.get(b)
            if off is not None:
                ranges.append((off + at, i * pb, pb))
                ranges.append((off + at + pb, (n + i) * pb, pb))
        if ranges:
            self.bytes_sent += self.write_ranges(local, ranges)
