"""The paged block pool: which KV blocks are free, cached or in use.

Every block is in exactly one of three states:
- free: holds nothing reusable (``ref_count == 0``, no hash);
- cached: holds a full block's KV that no request uses (``ref_count == 0``, has a hash);
  it can be reused by a prefix hit or evicted, oldest release first;
- in use: ``ref_count > 0``; it may also carry a hash (then it is shareable).
``num_free + num_cached + num_in_use == num_blocks`` always; ``check_integrity`` verifies it.

A hash maps to at most one block; a hit is confirmed by comparing the block's tokens, so a
hash collision never serves wrong KV. The pool records ``stored`` and ``evicted`` events so a
router can mirror which prefixes this replica holds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than can be freed."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._by_hash: dict[int, int] = {}
        self._events: list[tuple[str, int]] = []

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    # -- prefix cache ----------------------------------------------------------------------
    def lookup(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, or None."""
        block = self._by_hash.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(tokens):
            return None
        return block

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def cached_hashes(self) -> list[int]:
        """Every hash a prefix hit can be served from (for a router's full resync)."""
        return list(self._by_hash)

    def register(self, block: int, block_hash: int, tokens: Sequence[int]) -> None:
        """Mark an in-use, fully written block as reusable under ``block_hash``.

        If another block already holds this hash, the first one stays the cached copy and
        this block remains private to its request.
        """
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is not in use")
        if self.block_hash[block] is not None or block_hash in self._by_hash:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(tokens)
        self._by_hash[block_hash] = block
        self._events.append(("stored", block_hash))

    # -- reference counting ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with ref count 1, evicting the oldest cached ones if needed."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} can be freed")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def acquire(self, block: int) -> None:
        """Take one more reference on a block found by ``lookup``."""
        if self.ref_count[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free and holds nothing to share")
            del self._cached[block]
        self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, in the given order.

        Pass a request's blocks tail first: a prefix's later blocks then become older in the
        eviction order than its head, so shared heads outlive private tails.
        """
        for block in blocks:
            if self.ref_count[block] <= 0:
                raise ValueError(f"block {block} released more often than acquired")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None

    def unregister(self, block: int) -> None:
        """Unpublish a block that is in use (its contents turned out bad): no lookup finds
        it, and it returns to the free list when released."""
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is not in use")
        self._forget(block)

    def evict_all_cached(self) -> int:
        """Drop every cached block (e.g. when weights change); returns how many."""
        n = len(self._cached)
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self._free.append(block)
        return n

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._by_hash[h]
            self._events.append(("evicted", h))
        self.block_hash[block] = None
        self.block_tokens[block] = None

    # -- observation -----------------------------------------------------------------------
    def drain_events(self) -> list[tuple[str, int]]:
        """``("stored" | "evicted", hash)`` since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is in exactly one consistent state."""
        free, cached = set(self._free), set(self._cached)
        in_use = {b for b in range(self.num_blocks) if self.ref_count[b] > 0}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & cached) and not (free & in_use) and not (cached & in_use), (
            "a block is in two states"
        )
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} "
            f"!= total {self.num_blocks}"
        )
        assert all(c >= 0 for c in self.ref_count), "negative ref count"
        assert all(self.block_hash[b] is None for b in free), "a free block keeps a hash"
        assert all(self.block_hash[b] is not None for b in cached), "a cached block has no hash"
        for h, b in self._by_hash.items():
            assert self.block_hash[b] == h, f"hash map points block {b} at the wrong hash"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self._by_hash), "a block carries a hash the map does not know"
