"""The DRAM tier of a store shard: fixed-size slots in one byte buffer, with LRU order.

Layout: ``buffer`` is a flat ``uint8`` array of ``num_slots * slot_bytes`` bytes (a shared
memory segment in a deployed shard, so a reader on the same node copies a block out of it
in one copy). Slot ``s`` is ``buffer[s * slot_bytes : (s + 1) * slot_bytes]``; a block of
``nbytes <= slot_bytes`` occupies the first ``nbytes`` of one slot.

Invariants:
- every slot is exactly one of: free, pending (a write in progress), committed;
- ``used_bytes == (num_slots - num_free_slots) * slot_bytes <= capacity_bytes``;
- only committed blocks are visible (``contains``, ``view``) and only they are in the
  LRU order (oldest first), so a pending slot is never chosen for eviction;
- the tier never evicts on its own: the shard picks victims with ``lru_order``, skipping
  pinned blocks, and calls ``remove``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from store.kv_store_errors import InvalidBlockError, StoreFullError, WriteStateError


class DramTier:
    def __init__(
        self, capacity_bytes: int, slot_bytes: int, buffer: np.ndarray | None = None
    ) -> None:
        if slot_bytes <= 0:
            raise InvalidBlockError(f"slot_bytes must be positive, got {slot_bytes}")
        if capacity_bytes < slot_bytes:
            raise InvalidBlockError(
                f"DRAM capacity {capacity_bytes} bytes is below one block ({slot_bytes} bytes)"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.capacity_bytes = self.num_slots * slot_bytes
        if buffer is None:
            buffer = np.zeros(self.capacity_bytes, dtype=np.uint8)
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < self.capacity_bytes:
            raise InvalidBlockError(
                f"DRAM buffer must be a flat uint8 array of >= {self.capacity_bytes} bytes"
            )
        self.buffer = buffer
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # pop() -> slot 0
        self._committed: dict[int, tuple[int, int]] = {}  # hash -> (slot, nbytes)
        self._pending: dict[int, tuple[int, int]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed hashes, oldest first

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes

    def __len__(self) -> int:
        return len(self._committed)

    # -- writes ----------------------------------------------------------------------------
    def reserve(self, block_hash: int, nbytes: int) -> np.ndarray:
        """A pending slot for ``block_hash``; returns the writable ``nbytes`` view of it.

        The caller made room first; the block stays invisible until ``commit``."""
        if block_hash in self._committed or block_hash in self._pending:
            raise WriteStateError(f"block {block_hash:#x} is already in the DRAM tier")
        if not 0 < nbytes <= self.slot_bytes:
            raise InvalidBlockError(
                f"a block of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )
        if not self._free:
            raise StoreFullError("no free DRAM slot; evict or demote a block first")
        slot = self._free.pop()
        self._pending[block_hash] = (slot, nbytes)
        return self._slot_view(slot, nbytes)

    def commit(self, block_hash: int) -> None:
        """Make a pending block visible (newest in LRU order)."""
        entry = self._pending.pop(block_hash, None)
        if entry is None:
            raise WriteStateError(f"block {block_hash:#x} has no write in progress")
        self._committed[block_hash] = entry
        self._lru[block_hash] = None

    def abort(self, block_hash: int) -> None:
        """Drop a pending write; its slot becomes free and nothing was ever visible."""
        entry = self._pending.pop(block_hash, None)
        if entry is None:
            raise WriteStateError(f"block {block_hash:#x} has no write in progress")
        self._free.append(entry[0])

    def is_pending(self, block_hash: int) -> bool:
        return block_hash in self._pending

    # -- reads -----------------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._committed

    def location(self, block_hash: int) -> tuple[int, int]:
        """``(byte offset in buffer, nbytes)`` of a committed or pending block."""
        entry = self._committed.get(block_hash) or self._pending.get(block_hash)
        if entry is None:
            raise KeyError(block_hash)
        return entry[0] * self.slot_bytes, entry[1]

    def view(self, block_hash: int) -> np.ndarray:
        """The committed block's bytes (a view into the buffer, not a copy)."""
        slot, nbytes = self._committed[block_hash]
        return self._slot_view(slot, nbytes)

    def touch(self, block_hash: int) -> None:
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def lru_order(self) -> Iterator[int]:
        """Committed hashes, least recently used first. Do not remove while iterating:
        pick a victim, stop, then ``remove`` it."""
        return iter(self._lru)

    # -- removal ---------------------------------------------------------------------------
    def remove(self, block_hash: int) -> None:
        slot, _ = self._committed.pop(block_hash)
        del self._lru[block_hash]
        self._free.append(slot)

    def _slot_view(self, slot: int, nbytes: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.buffer[start : start + nbytes]
