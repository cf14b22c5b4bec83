"""One KV store shard's logic: a DRAM tier over an SSD tier, pins, chained LRU, events.

No Ray, no transfers: ``actors/kvstore/shard.py`` wraps this with a shared-memory segment
(the DRAM buffer) and a transfer engine. API (hashes are 64-bit ints from store.hashing; a
block's bytes are any contiguous buffer of at most ``block_bytes`` bytes):

    store = ShardStore(block_bytes, dram_bytes, ssd_bytes=0, ssd_dir=None, dram_buffer=None,
                       tenant_retained_share=1.0, clock=time.monotonic)
    store.put(h, data, parent=None) -> bool          # False: already stored or being written
    store.begin_put(h, nbytes, parent=None) -> np.ndarray | None   # writable, invisible view
    store.commit_put(h) / store.abort_put(h)        # visible only after commit
    store.get(h) -> np.ndarray | None                # a copy; None is a miss
    store.get_into(h, out) -> bool
    store.contains(h) / tier_of(h) / match_prefix(hashes) -> int
    store.acquire(request_id, hashes) -> list[BlockLocation]   # pins + promotes to DRAM
    store.pin(request_id, hashes) -> int / store.release(request_id) -> int
    store.remove(h) -> bool / change_replica(hashes, target, move=False) -> list[int]
    store.retain(hashes, tenant, seconds) -> int      # kept ahead of LRU (store.retention)
    store.drain_events() -> list[("stored" | "removed", h)]   # feed a BlockDirectory
    store.stats() -> dict[str, int]   # occupancy, and reads by tier: dram_hit_blocks,
                                      # ssd_hit_blocks, miss_blocks (since the shard started);
                                      # retention: retained_blocks, retention_hit_blocks,
                                      # expired_retentions, revoked_retentions

Invariants:
- every visible block is in exactly one tier (DRAM or SSD: tiers are exclusive);
- a block is visible only after its write completed (DRAM: ``commit_put``; SSD: rename);
- a pinned block is never evicted, demoted or moved, so a ``BlockLocation`` handed out by
  ``acquire`` stays valid until ``release``;
- eviction order is LRU per tier, and an access to block i of a chain (the ``parent`` links
  given at put) refreshes i, then its parent, ..., up to the root, so the root ends most
  recent and a chain is evicted from its tail first (a tail is useless without its head);
- DRAM is full -> the LRU unpinned DRAM block is demoted to SSD (SSD full -> its LRU
  unpinned block is dropped); no SSD tier -> it is dropped. A get of an SSD block promotes
  it back into DRAM.
- retention (``store.retention``): a victim is the LRU unpinned *unretained* block of its
  tier, and a retained one only when no unretained one is left; an unretained block being
  demoted never displaces a retained SSD block (it is dropped instead). So within its
  retention a block leaves DRAM for SSD before anything is dropped for it.
- ``stored`` and ``removed`` events describe exactly the changes in what this shard holds
  (demotion and promotion are not changes), so a directory replaying them stays exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.block_key import as_byte_view, check_block_hash
from store.dram_tier import DramTier
from store.kv_store_errors import InvalidBlockError, StoreFullError, WriteStateError
from store.pin_table import PinTable
from store.retention import RetentionTable
from store.ssd_tier import SsdTier


@dataclass(frozen=True)
class BlockLocation:
    """Where a pinned block's bytes lie in the shard's DRAM buffer."""

    block_hash: int
    offset: int  # byte offset into the DRAM buffer (the shard's shared segment)
    nbytes: int
    parent: int | None


class ShardStore:
    def __init__(
        self,
        block_bytes: int,
        dram_bytes: int,
        ssd_bytes: int = 0,
        ssd_dir: str | os.PathLike[str] | None = None,
        dram_buffer: np.ndarray | None = None,
        ssd_fsync: bool = False,
        tenant_retained_share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``tenant_retained_share``: of the shard's blocks (DRAM slots + SSD files of a
        full block), the share one tenant's retained blocks may hold. ``clock``: the
        retention deadlines' clock."""
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise InvalidBlockError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if ssd_bytes < 0:
            raise InvalidBlockError(f"ssd_bytes must be >= 0, got {ssd_bytes}")
        if ssd_bytes > 0 and ssd_dir is None:
            raise InvalidBlockError("an SSD tier needs ssd_dir= (a folder for its files)")
        self.block_bytes = block_bytes
        self.dram = DramTier(dram_bytes, block_bytes, dram_buffer)
        self.ssd = SsdTier(ssd_dir, ssd_bytes, ssd_fsync) if ssd_bytes > 0 and ssd_dir else None
        self.pins = PinTable()
        if not 0 < tenant_retained_share <= 1:
            raise InvalidBlockError(
                f"tenant_retained_share must be in (0, 1], got {tenant_retained_share}"
            )
        ssd = self.ssd
        ssd_blocks = ssd.capacity_bytes // ssd.file_bytes(block_bytes) if ssd is not None else 0
        bound = max(1, int(tenant_retained_share * (self.dram.num_slots + ssd_blocks)))
        self.retention = RetentionTable(bound, clock)
        self.retention_hit_blocks = 0  # blocks read or acquired while retained
        self._parent: dict[int, int | None] = {}  # every visible block -> its parent
        self._pending_parent: dict[int, int | None] = {}
        self._busy: set[int] = set()  # blocks mid-promotion: not victims
        self._events: list[tuple[str, int]] = []
        # blocks read (get_into) or acquired, by the tier that served them; misses: blocks
        # asked for that this shard did not serve (acquire counts the rest of the prefix)
        self.dram_hit_blocks = self.ssd_hit_blocks = self.miss_blocks = 0
        if self.ssd is not None:  # blocks adopted from an earlier run of this shard
            for h in list(self.ssd.lru_order()):
                self._parent[h] = self.ssd.parent(h)
                self._events.append(("stored", h))

    # -- writes ----------------------------------------------------------------------------
    def begin_put(
        self, block_hash: int, nbytes: int, parent: int | None = None
    ) -> np.ndarray | None:
        """Reserve a DRAM slot; returns its writable ``nbytes`` view, invisible to lookups
        until ``commit_put``. None when the block is already stored or being written."""
        h = check_block_hash(block_hash)
        if parent is not None:
            parent = check_block_hash(parent)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise InvalidBlockError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if not 0 < nbytes <= self.block_bytes:
            raise InvalidBlockError(
                f"a block of {nbytes} bytes does not fit this shard (1..{self.block_bytes})"
            )
        if self.contains(h) or self.dram.is_pending(h):
            return None
        self._make_dram_room()
        view = self.dram.reserve(h, int(nbytes))
        self._pending_parent[h] = parent
        return view

    def commit_put(self, block_hash: int) -> None:
        h = check_block_hash(block_hash)
        self.dram.commit(h)
        self._parent[h] = self._pending_parent.pop(h)
        self._touch_chain(h)
        self._events.append(("stored", h))

    def abort_put(self, block_hash: int) -> None:
        h = check_block_hash(block_hash)
        self.dram.abort(h)
        self._pending_parent.pop(h, None)

    def put(self, block_hash: int, data: Any, parent: int | None = None) -> bool:
        """Store a copy of ``data``; False if the block is already stored or in flight."""
        view = as_byte_view(data)
        buf = self.begin_put(block_hash, view.size, parent)
        if buf is None:
            return False
        try:
            np.copyto(buf, view)
        except BaseException:
            self.abort_put(block_hash)
            raise
        self.commit_put(block_hash)
        return True

    # -- reads -----------------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._parent

    def tier_of(self, block_hash: int) -> str | None:
        if self.dram.contains(block_hash):
            return "dram"
        if self.ssd is not None and self.ssd.contains(block_hash):
            return "ssd"
        return None

    def nbytes(self, block_hash: int) -> int:
        if self.dram.contains(block_hash):
            return self.dram.location(block_hash)[1]
        if self.ssd is not None and self.ssd.contains(block_hash):
            return self.ssd.nbytes(block_hash)
        raise KeyError(block_hash)

    def match_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of the chain ``hashes`` are visible here."""
        n = 0
        for h in hashes:
            if check_block_hash(h) not in self._parent:
                break
            n += 1
        return n

    def get(self, block_hash: int) -> np.ndarray | None:
        """A copy of the block's bytes (promoting it to DRAM), or None on a miss."""
        h = check_block_hash(block_hash)
        if h not in self._parent:
            return None
        out = np.empty(self.nbytes(h), dtype=np.uint8)
        return out if self.get_into(h, out) else None

    def get_into(self, block_hash: int, out: Any) -> bool:
        """Copy the block into ``out`` (a writable buffer of exactly its size); False on a
        miss. Refreshes the block's chain; an SSD block is promoted to DRAM when DRAM has an
        unpinned victim, else read straight from its file."""
        h = check_block_hash(block_hash)
        dst = as_byte_view(out)
        if h not in self._parent:
            self.miss_blocks += 1
            return False
        if dst.size != self.nbytes(h):
            raise InvalidBlockError(f"out holds {dst.size} bytes, block has {self.nbytes(h)}")
        if not dst.flags.writeable:
            raise InvalidBlockError("out must be writable")
        if self.ssd is not None and self.ssd.contains(h):
            try:
                promoted: bool | None = self._promote(h)
            except StoreFullError:  # DRAM is all pinned: serve straight from the file
                promoted = None
            if promoted is None:
                if not self.ssd.read_into(h, dst):
                    self._forget(h)
                    self.miss_blocks += 1
                    return False
            elif not promoted:  # torn file, already forgotten
                self.miss_blocks += 1
                return False
            else:
                np.copyto(dst, self.dram.view(h))
            self.ssd_hit_blocks += 1
        else:
            np.copyto(dst, self.dram.view(h))
            self.dram_hit_blocks += 1
        self._count_retention_hits([h])
        self._touch_chain(h)
        return True

    def acquire(self, request_id: str, hashes: list[int]) -> list[BlockLocation]:
        """Pin the longest visible prefix of ``hashes`` and bring it into DRAM; returns its
        locations (possibly fewer than visible when DRAM is full of pinned blocks). The
        locations stay valid until ``release(request_id)``."""
        out: list[BlockLocation] = []
        for raw in hashes:
            h = check_block_hash(raw)
            if h not in self._parent:
                break
            self.pins.pin(request_id, [h])
            if self.dram.contains(h):
                self.dram_hit_blocks += 1
            else:
                try:
                    ok = self._promote(h)
                except StoreFullError:
                    ok = False
                if not ok:
                    self.pins.unpin(request_id, [h])
                    break
                self.ssd_hit_blocks += 1
            offset, nbytes = self.dram.location(h)
            out.append(BlockLocation(h, offset, nbytes, self._parent[h]))
        self.miss_blocks += len(hashes) - len(out)
        self._count_retention_hits([loc.block_hash for loc in out])
        if out:
            self._touch_chain(out[-1].block_hash)
        return out

    def pin(self, request_id: str, hashes: list[int]) -> int:
        """Pin the longest visible prefix of ``hashes`` where it lies; returns its length."""
        n = self.match_prefix(hashes)
        self.pins.pin(request_id, [int(h) for h in hashes[:n]])
        return n

    def retain(self, hashes: list[int], tenant: str | None, seconds: float) -> int:
        """Keep the blocks of ``hashes`` visible here ahead of LRU eviction for ``seconds``
        (``tenant``'s, within its bound); returns how many were retained."""
        held = [h for h in (check_block_hash(x) for x in hashes) if h in self._parent]
        return self.retention.retain(held, tenant, seconds)

    def release(self, request_id: str) -> int:
        """Drop every pin of ``request_id``; returns how many distinct blocks it held."""
        return len(self.pins.release(request_id))

    def is_pinned(self, block_hash: int) -> bool:
        return self.pins.is_pinned(block_hash)

    # -- removal and replicas --------------------------------------------------------------
    def remove(self, block_hash: int) -> bool:
        """Drop a block now; False if absent. A pinned block cannot be removed."""
        h = check_block_hash(block_hash)
        if h not in self._parent:
            return False
        if self.pins.is_pinned(h):
            raise WriteStateError(f"block {h:#x} is pinned by an in-flight request")
        self._drop(h)
        return True

    def change_replica(
        self, hashes: list[int], target: ShardStore, move: bool = False
    ) -> list[int]:
        """Copy (or move) the listed blocks present here into ``target`` in this process;
        returns the hashes ``target`` now holds because of it. Across processes the actor
        does the same through the transfer layer (``KVStoreShard.pull``)."""
        done = []
        for raw in hashes:
            h = check_block_hash(raw)
            data = self.get(h)
            if data is None:
                continue
            if target.put(h, data, self._parent.get(h)) or target.contains(h):
                done.append(h)
            if move and not self.pins.is_pinned(h):
                self._drop(h)
        return done

    def held(self) -> list[int]:
        """Every visible block hash (both tiers)."""
        return list(self._parent)

    def drain_events(self) -> list[tuple[str, int]]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        self.retention.expire()
        ssd = self.ssd
        return {
            "dram_blocks": len(self.dram),
            "dram_used_bytes": self.dram.used_bytes,
            "dram_capacity_bytes": self.dram.capacity_bytes,
            "ssd_blocks": len(ssd) if ssd else 0,
            "ssd_used_bytes": ssd.used_bytes if ssd else 0,
            "ssd_capacity_bytes": ssd.capacity_bytes if ssd else 0,
            "pending_writes": len(self._pending_parent),
            "pinned_blocks": self.pins.num_pinned_blocks,
            "pinning_requests": len(self.pins),
            "dram_hit_blocks": self.dram_hit_blocks,
            "ssd_hit_blocks": self.ssd_hit_blocks,
            "miss_blocks": self.miss_blocks,
            "retained_blocks": self.retention.num_retained,
            "retention_hit_blocks": self.retention_hit_blocks,
            "expired_retentions": self.retention.expired,
            "revoked_retentions": self.retention.revoked,
        }

    # -- internals -------------------------------------------------------------------------
    def _victim(self, order: Any, retained_ok: bool = True) -> int | None:
        """The first unpinned, not busy, unretained block of ``order``; else (with
        ``retained_ok``) the first such retained one."""
        retained = None
        for h in order:
            if h in self._busy or self.pins.is_pinned(h):
                continue
            if not self.retention.is_retained(h):
                return int(h)
            if retained is None:
                retained = int(h)
        return retained if retained_ok else None

    def _count_retention_hits(self, hashes: list[int]) -> None:
        self.retention.expire()
        self.retention_hit_blocks += sum(map(self.retention.is_retained, hashes))

    def _make_dram_room(self) -> None:
        self.retention.expire()
        while self.dram.num_free_slots == 0:
            victim = self._victim(self.dram.lru_order())
            if victim is None:
                raise StoreFullError(
                    f"every DRAM slot of this shard ({self.dram.num_slots}) is pinned or "
                    "being written; release finished requests or give the shard more DRAM"
                )
            self._demote(victim)

    def _demote(self, h: int) -> None:
        """DRAM -> SSD, or drop when there is no SSD tier or no unpinned room on it."""
        ssd = self.ssd
        nbytes = self.dram.location(h)[1]
        if ssd is not None and ssd.file_bytes(nbytes) <= ssd.capacity_bytes:
            self._busy.add(h)
            try:
                self._make_ssd_room(nbytes, self.retention.is_retained(h))
                ssd.write(h, self.dram.view(h), self._parent[h])
            except (StoreFullError, OSError):  # no unpinned room or a failing disk: drop
                self._drop(h)
                return
            finally:
                self._busy.discard(h)
            self.dram.remove(h)
            return
        self._drop(h)

    def _make_ssd_room(self, nbytes: int, retained: bool) -> None:
        """Room for a block demoted from DRAM; only a ``retained`` one may displace
        retained SSD blocks."""
        ssd = self.ssd
        assert ssd is not None
        while not ssd.has_room(nbytes):
            victim = self._victim(ssd.lru_order(), retained_ok=retained)
            if victim is None:
                raise StoreFullError("every SSD block of this shard is pinned or retained")
            self._drop(victim)

    def _promote(self, h: int) -> bool:
        """SSD -> DRAM. False (and the block forgotten) if its file fails its check."""
        ssd = self.ssd
        assert ssd is not None
        self._busy.add(h)
        try:
            self._make_dram_room()
            view = self.dram.reserve(h, ssd.nbytes(h))
            if not ssd.read_into(h, view):  # torn file: the SSD tier already dropped it
                self.dram.abort(h)
                self._forget(h)
                return False
            ssd.remove(h)
            self.dram.commit(h)
            return True
        finally:
            self._busy.discard(h)

    def _drop(self, h: int) -> None:
        if self.dram.contains(h):
            self.dram.remove(h)
        elif self.ssd is not None and self.ssd.contains(h):
            self.ssd.remove(h)
        self._forget(h)

    def _forget(self, h: int) -> None:
        if self._parent.pop(h, _MISSING) is not _MISSING:
            self._events.append(("removed", h))
            self.retention.forget(h)

    def _touch_chain(self, h: int | None) -> None:
        """Refresh ``h`` then each visible ancestor, so ancestors end more recent."""
        steps = 0
        while h is not None and h in self._parent and steps <= len(self._parent):
            if self.dram.contains(h):
                self.dram.touch(h)
            elif self.ssd is not None:
                self.ssd.touch(h)
            h = self._parent[h]
            steps += 1


_MISSING: Any = object()
