"""Which replicas hold which cached blocks, indexed for the router's prefix lookup.

One dict maps each block hash to a bitmask of the replicas holding it (bit ``slot`` set for
the replica in that slot); next to it, each replica keeps its own set of hashes (the set a
``ReplicaView`` exposes as ``cached``, adopted, never copied). Invariants, after every
public method:

- for every registered replica ``r`` and every hash ``h``:
  ``h in sets[r]``  iff  bit ``slot(r)`` of ``masks.get(h, 0)`` is set;
- no mask is 0 (a hash no replica holds has no entry), and no mask has the bit of a free slot.

A prefix lookup walks the request's chained hashes once, AND-ing the masks as it goes, and
stops at the first block that no replica holds through all earlier blocks. The walk runs in
C (``accumulate`` over ``map`` under ``takewhile``), so it costs tens of nanoseconds per
matched block whatever the number of replicas; it comes back as runs (one per distinct
mask, at most replicas + 1, usually two or three). Updates cost one set operation and one
dict read and write per hash, also in C.

Pure: stdlib only, no clock, deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_, or_


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}  # hash -> bitmask of the slots holding it
        self._slot: dict[str, int] = {}  # replica id -> its bit position
        self._sets: dict[str, set[int]] = {}  # replica id -> hashes it holds
        self._free: list[int] = []  # released slots, reused smallest first
        self._num_slots = 0  # slots ever handed out (free ones included)

    # -- membership ------------------------------------------------------------------------
    def add_replica(self, replica_id: str, cached: set[int] | None = None) -> int:
        """Register a replica and return its slot. ``cached`` (default: a new empty set) is
        adopted as the replica's set: later updates through this index mutate it in place,
        and the hashes already in it are indexed now. Registering twice is a no-op."""
        if replica_id in self._slot:
            return self._slot[replica_id]
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot = self._num_slots
            self._num_slots += 1
        self._slot[replica_id] = slot
        s = cached if cached is not None else set()
        self._sets[replica_id] = s
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        for h in s:
            masks[h] = get(h, 0) | bit
        return slot

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica: its bit leaves every mask and its slot becomes free. Its set
        object is left as it was (whoever else holds it keeps a consistent copy)."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        self._clear_bits(self._sets.pop(replica_id), ~(1 << slot))
        self._free.append(slot)

    def _clear_bits(self, hashes: Iterable[int], keep: int) -> None:
        masks = self._masks
        for h in hashes:
            m = masks[h] & keep
            if m:
                masks[h] = m
            else:
                del masks[h]

    def slot(self, replica_id: str) -> int:
        return self._slot[replica_id]

    def bit(self, replica_id: str) -> int:
        """``1 << slot``: the replica's bit in every mask."""
        return 1 << self._slot[replica_id]

    def cached(self, replica_id: str) -> set[int]:
        """The replica's set (live; mutate it only through this index)."""
        return self._sets[replica_id]

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._slot

    @property
    def num_slots(self) -> int:
        """One more than the highest slot ever handed out: the length of ``lengths_by_slot``."""
        return self._num_slots

    # -- updates ---------------------------------------------------------------------------
    def add(self, replica_id: str, hashes: Sequence[int]) -> None:
        """The replica now holds ``hashes``. Idempotent per hash (a set add and an OR of the
        replica's bit), so hashes it already holds need no check first."""
        if not hashes:
            return
        self._sets[replica_id].update(hashes)
        masks = self._masks
        bit = 1 << self._slot[replica_id]
        # masks[h] |= bit for every h, as one C-level pass.
        masks.update(
            zip(hashes, map(or_, map(masks.get, hashes, repeat(0)), repeat(bit)), strict=True)
        )

    def discard(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica no longer holds ``hashes`` (unknown ones are no-ops)."""
        s = self._sets[replica_id]
        keep = ~(1 << self._slot[replica_id])
        masks = self._masks
        for h in hashes:
            if h in s:
                s.discard(h)
                m = masks[h] & keep
                if m:
                    masks[h] = m
                else:
                    del masks[h]

    def apply_events(self, replica_id: str, events: Iterable[tuple[str, int]]) -> None:
        """Apply ``("stored" | "evicted", hash)`` events in order. An unknown kind raises
        ``ValueError``; the events before it stay applied."""
        s = self._sets[replica_id]
        slot = self._slot[replica_id]
        bit, keep = 1 << slot, ~(1 << slot)
        masks = self._masks
        get = masks.get
        for kind, h in events:
            if kind == "stored":
                if h not in s:
                    s.add(h)
                    masks[h] = get(h, 0) | bit
            elif kind == "evicted":
                if h in s:
                    s.discard(h)
                    m = masks[h] & keep
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
            else:
                raise ValueError(f"unknown cache event {kind!r}; expected 'stored' or 'evicted'")

    def reset(self, replica_id: str, hashes: Iterable[int]) -> None:
        """Replace the replica's hashes wholesale; its set object stays the same object."""
        s = self._sets[replica_id]
        self._clear_bits(s, ~(1 << self._slot[replica_id]))
        s.clear()
        self.add(replica_id, list(hashes))

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
        out = [0] * self._num_slots
        for holders, end in self.runs(block_hashes):
            # Later runs are subsets of earlier ones and overwrite them with longer ends.
            while holders:
                low = holders & -holders
                out[low.bit_length() - 1] = end
                holders ^= low
        return out

    def prefix_length(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` the replica holds (stops at the first miss)."""
        return len(list(takewhile(self._sets[replica_id].__contains__, block_hashes)))

    # -- checking --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``AssertionError`` unless the invariants in the module docstring hold."""
        rebuilt: dict[int, int] = {}
        for rid, s in self._sets.items():
            bit = 1 << self._slot[rid]
            for h in s:
                rebuilt[h] = rebuilt.get(h, 0) | bit
        if rebuilt != self._masks:
            raise AssertionError("prefix index masks disagree with the replicas' sets")
        if set(self._free) & set(self._slot.values()):
            raise AssertionError("a slot is both free and in use")
