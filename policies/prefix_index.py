"""Which replicas hold which cached blocks, indexed for the router's prefix lookup.

One dict maps each block hash to a bitmask of the replicas holding it (bit ``slot`` set for
the replica in that slot). It is the only copy: a replica's set of hashes is a read-only
view over it (``cached``), and next to it the index keeps how many hashes each slot holds.
Invariants, after every public method:

- no mask is 0 (a hash no replica holds has no entry), and no mask has the bit of a free
  slot;
- for every registered replica, its count equals the number of masks with its bit set.

A prefix lookup walks the request's chained hashes once, AND-ing the masks as it goes, and
stops at the first block that no replica holds through all earlier blocks. The walk runs in
C (``accumulate`` over ``map`` under ``takewhile``), so it costs tens of nanoseconds per
matched block whatever the number of replicas; it comes back as runs (one per distinct
mask, at most replicas + 1, usually two or three). An update costs one dict read and (for
a hash the replica did not hold) one dict write per hash. Removing a replica or replacing
its hashes wholesale scans the whole dict (rare: membership changes and resyncs).

With a warm interpreter the router's cost is mostly memory reads of this dict (a prompt's
older blocks were last touched many decisions ago), so it is kept small: each hash is stored
once (not also in a set per replica), and a mask with a single bit, what most hashes have,
is one shared int object per slot instead of an int allocated per hash.

Pure: stdlib only, no clock, deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Set
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import TypeVar

_T = TypeVar("_T")


class CachedBlocks(Set[int]):
    """The live, read-only set of hashes one replica holds in a ``PrefixIndex``
    (``h in s``, ``len(s)``, iteration, and the comparisons of ``collections.abc.Set``,
    e.g. ``s == {1, 2}`` or ``s >= set(hashes)``). Iterating scans the index."""

    __slots__ = ("_bit", "_counts", "_masks", "_slot")

    def __init__(self, masks: dict[int, int], counts: list[int], slot: int) -> None:
        self._masks = masks
        self._counts = counts
        self._slot = slot
        self._bit = 1 << slot

    def __contains__(self, block_hash: object) -> bool:
        return bool(self._masks.get(block_hash, 0) & self._bit)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return self._counts[self._slot]

    def __iter__(self) -> Iterator[int]:
        bit = self._bit
        return iter([h for h, m in self._masks.items() if m & bit])

    def __repr__(self) -> str:
        return f"CachedBlocks({set(self)!r})"

    def _detach(self) -> None:
        """Read as empty from now on (its replica left the index)."""
        self._masks = {}
        self._counts = [0] * (self._slot + 1)

    @classmethod
    def _from_iterable(cls, it: Iterable[_T]) -> Set[_T]:
        """What ``&``, ``|``, ``-`` and ``^`` return: a plain, detached ``set``."""
        return set(it)


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}  # hash -> bitmask of the slots holding it
        self._slot: dict[str, int] = {}  # replica id -> its bit position
        self._counts: list[int] = []  # slot -> hashes it holds (0 for a free slot)
        # slot -> ``1 << slot``, one object per slot: a hash only one replica holds (most of
        # them) maps to this shared object, not to an int allocated per hash, so reading
        # its mask touches memory that is already in cache.
        self._bits: list[int] = []
        self._views: dict[str, CachedBlocks] = {}  # replica id -> its read-only set
        self._free: list[int] = []  # released slots, reused smallest first

    # -- membership ------------------------------------------------------------------------
    def add_replica(self, replica_id: str, cached: Iterable[int] = ()) -> int:
        """Register a replica holding ``cached`` (default: nothing) and return its slot.
        Registering twice is a no-op."""
        if replica_id in self._slot:
            return self._slot[replica_id]
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot = len(self._counts)
            self._counts.append(0)
            self._bits.append(1 << slot)
        self._slot[replica_id] = slot
        self._views[replica_id] = CachedBlocks(self._masks, self._counts, slot)
        self.add(replica_id, list(cached))
        return slot

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica: its bit leaves every mask and its slot becomes free. Its
        ``CachedBlocks`` view reads as empty from then on."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        self._views.pop(replica_id)._detach()
        self._clear_slot(slot)
        self._free.append(slot)

    def _clear_slot(self, slot: int) -> None:
        bit = 1 << slot
        masks = self._masks
        for h in [h for h, m in masks.items() if m & bit]:
            m = masks[h] ^ bit
            if m:
                masks[h] = self._shared(m)
            else:
                del masks[h]
        self._counts[slot] = 0

    def _shared(self, mask: int) -> int:
        """``mask``, as the shared object of its slot when it has a single bit."""
        if mask & (mask - 1):
            return mask
        return self._bits[mask.bit_length() - 1]

    def slot(self, replica_id: str) -> int:
        return self._slot[replica_id]

    def bit(self, replica_id: str) -> int:
        """``1 << slot``: the replica's bit in every mask."""
        return 1 << self._slot[replica_id]

    def cached(self, replica_id: str) -> CachedBlocks:
        """The replica's hashes: a live read-only view (the same object every call)."""
        return self._views[replica_id]

    @property
    def counts(self) -> list[int]:
        """Hashes held, by slot (live; read it, never write it): ``counts[slot(r)] ==
        len(cached(r))``."""
        return self._counts

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._slot

    @property
    def num_slots(self) -> int:
        """One more than the highest slot ever handed out: the length of ``lengths_by_slot``."""
        return len(self._counts)

    # -- updates ---------------------------------------------------------------------------
    def add(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica now holds ``hashes`` (idempotent per hash)."""
        slot = self._slot[replica_id]
        bit = self._bits[slot]
        masks = self._masks
        get = masks.get
        new = 0
        for h in hashes:
            m = get(h, 0)
            if not m & bit:
                masks[h] = m | bit if m else bit
                new += 1
        self._counts[slot] += new

    def discard(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica no longer holds ``hashes`` (unknown ones are no-ops)."""
        slot = self._slot[replica_id]
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        shared = self._shared
        gone = 0
        for h in hashes:
            m = get(h, 0)
            if m & bit:
                gone += 1
                if m == bit:
                    del masks[h]
                else:
                    masks[h] = shared(m ^ bit)
        self._counts[slot] -= gone

    def apply_events(self, replica_id: str, events: Iterable[tuple[str, int]]) -> None:
        """Apply ``("stored" | "evicted", hash)`` events in order. An unknown kind raises
        ``ValueError``; the events before it stay applied."""
        slot = self._slot[replica_id]
        bit = self._bits[slot]
        masks = self._masks
        get = masks.get
        shared = self._shared
        count = self._counts[slot]
        try:
            for kind, h in events:
                m = get(h, 0)
                if kind == "stored":
                    if not m & bit:
                        masks[h] = m | bit if m else bit
                        count += 1
                elif kind == "evicted":
                    if m & bit:
                        count -= 1
                        if m == bit:
                            del masks[h]
                        else:
                            masks[h] = shared(m ^ bit)
                else:
                    raise ValueError(
                        f"unknown cache event {kind!r}; expected 'stored' or 'evicted'"
                    )
        finally:
            self._counts[slot] = count

    def reset(self, replica_id: str, hashes: Iterable[int]) -> None:
        """Replace the replica's hashes wholesale (its ``cached`` view stays the same
        object)."""
        self._clear_slot(self._slot[replica_id])
        self.add(replica_id, hashes)

    # -- lookups ---------------------------------------------------------------------------
    def holders(self, block_hash: int) -> int:
        """Bitmask of the slots holding ``block_hash`` (0 if none)."""
        return self._masks.get(block_hash, 0)

    def runs(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """How far each replica's cached prefix of ``block_hashes`` reaches, as runs.

        Returns ``[(holders_0, end_0), (holders_1, end_1), ...]``: ``holders_j`` is the
        bitmask of the slots holding blocks ``0 .. end_{j-1}`` (all blocks before the run's
        end), the masks strictly shrink and the ends strictly grow. A slot in ``holders_j``
        but not in ``holders_{j+1}`` matched exactly ``end_j`` blocks; a slot in no run
        matched none (the walk stops at each slot's first miss: chained hashes make block i
        useless without blocks 0..i-1). Empty when no slot holds block 0.
        """
        # walk[i] = slots holding blocks 0..i; non-increasing, cut at the first empty one.
        walk = list(
            takewhile(bool, accumulate(map(self._masks.get, block_hashes, repeat(0)), and_))
        )
        if not walk:
            return []
        # Each distinct mask starts a run (a mask never comes back once it shrinks).
        masks = list(dict.fromkeys(walk))
        if len(masks) == 1:
            return [(masks[0], len(walk))]
        ends = [walk.index(m) for m in masks[1:]]
        ends.append(len(walk))
        return list(zip(masks, ends, strict=True))

    def lengths_by_slot(self, block_hashes: Sequence[int]) -> list[int]:
        """For every slot, the number of leading blocks of ``block_hashes`` that replica
        holds, stopping at its first miss. Free slots read 0."""
        out = [0] * len(self._counts)
        for holders, end in self.runs(block_hashes):
            # Later runs are subsets of earlier ones and overwrite them with longer ends.
            while holders:
                low = holders & -holders
                out[low.bit_length() - 1] = end
                holders ^= low
        return out

    def prefix_length(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` the replica holds (stops at the first miss)."""
        return len(list(takewhile(self._views[replica_id].__contains__, block_hashes)))

    # -- checking --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``AssertionError`` unless the invariants in the module docstring hold."""
        used = 0
        for slot in self._slot.values():
            used |= 1 << slot
        counts = [0] * len(self._counts)
        for m in self._masks.values():
            if not m:
                raise AssertionError("a hash no replica holds is still indexed")
            if m & ~used:
                raise AssertionError("a mask has the bit of a free slot")
            while m:
                low = m & -m
                counts[low.bit_length() - 1] += 1
                m ^= low
        if counts != self._counts:
            raise AssertionError("prefix index counts disagree with its masks")
        if set(self._free) & set(self._slot.values()):
            raise AssertionError("a slot is both free and in use")
