"""Per-request block tables over a ``BlockPool``, with prefix caching.

Implements the engine's ``KVCache`` protocol (``actors.engine.kv_cache``, the scheduler's
``KVManager`` widened): the only door to the pool, which nobody else touches. A request's
table lists its blocks in token order; block i holds tokens ``[i * block_size, (i + 1) *
block_size)``. Full blocks whose KV has been computed are registered under their chained
hash so later requests with the same prefix (and salt) reuse them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from store.block_pool import BlockPool
from store.hashing import extend_block_hashes

if TYPE_CHECKING:  # the scheduler's request type; store does not depend on policies
    from policies.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # leading blocks of a table already registered
        self.hit_tokens = 0  # prefix-cache statistics since start
        self.queried_tokens = 0

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def shards(self, request_id: str) -> list[tuple[int, int, list[int]]]:
        """(rank, first position, blocks): one shard on rank 0 (see ShardedKVManager)."""
        return [(0, 0, self.tables.get(request_id, []))]

    @property
    def pools(self) -> list[BlockPool]:
        return [self.pool]

    @property
    def kvp(self) -> int:
        """KV-parallel ranks: one pool."""
        return 1

    @property
    def max_tokens(self) -> int:
        """The longest request the pool can hold."""
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of ``seq``; returns the tokens it covers.

        At least one token is always left to compute, so the step that follows produces
        logits to sample from.
        """
        if seq.request_id in self.tables:
            raise ValueError(f"request {seq.request_id!r} already holds blocks")
        self.tables[seq.request_id] = []
        self._registered[seq.request_id] = 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, bs, seq.salt)
        usable = (seq.num_tokens - 1) // bs
        table = self.tables[seq.request_id]
        for i, h in enumerate(seq.block_hashes[:usable]):
            block = self.pool.lookup(h, seq.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            self.pool.acquire(block)
            table.append(block)
        self._registered[seq.request_id] = len(table)
        self.queried_tokens += seq.num_prompt_tokens
        self.hit_tokens += len(table) * bs
        return len(table) * bs

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        rid = seq.request_id
        table = self.tables.get(rid)
        if table is None:
            table = self.tables[rid] = []
        if rid not in self._registered:
            self._registered[rid] = 0
        need = -(-num_tokens // self.block_size) - len(table)  # blocks_needed, inlined
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(need))
        return True

    def commit(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq.request_id)
        if table is None:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(table))
        done = self._registered[seq.request_id]
        if full <= done:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids[: full * bs], bs, seq.salt)
        for i in range(done, full):
            self.pool.register(table[i], seq.block_hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
        self._registered[seq.request_id] = full

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.request_id, None)
        self._registered.pop(seq.request_id, None)
        if table:
            self.pool.release(table[::-1])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def free_blocks_per_rank(self) -> list[int]:
        return [self.pool.num_free]

    def blocks_per_rank(self, seq: Sequence, num_tokens: int) -> list[int]:
        """One rank: the blocks of ``num_tokens`` tokens, at most the pool's."""
        return [min(-(-max(num_tokens, 0) // self.block_size), self.pool.num_blocks)]

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request (or a hold) uses: neither free nor merely cached."""
        return self.pool.num_in_use

    def check_blocks(self) -> list[int]:
        """Blocks in use per rank, after the pool's integrity check (AssertionError)."""
        self.pool.check_integrity()
        return [self.pool.num_in_use]

    def evict_all_cached(self) -> int:
        """Forget every cached prefix (its KV is gone or stale); returns blocks dropped."""
        return self.pool.evict_all_cached()

    def drain_events(self) -> list[tuple[str, int]]:
        """``("stored" | "evicted", hash)`` since the last drain, oldest first."""
        return self.pool.drain_events()

    def cached_hashes(self) -> list[int]:
        """Every hash a prefix hit can be served from, sorted (for a router's resync)."""
        return sorted(self.pool.cached_hashes())

    def likely_cached_blocks(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` the cache holds, by hash alone (tokens are not
        compared, so a hit is likely, not sure): an admission estimate."""
        n = 0
        for h in hashes:
            if not self.pool.contains(h):
                break
            n += 1
        return n

    # -- blocks outside any request table (loads from the KV store into the prefix cache) -
    def cached_block(self, block_hash: int, tokens: list[int]) -> int | None:
        """The cached block holding exactly ``tokens`` under ``block_hash``, or None."""
        return self.pool.lookup(block_hash, tokens)

    def cached_prefix(self, hashes: list[int], tokens: list[int]) -> list[int]:
        """Ids of the leading blocks of a prompt (``hashes`` chained over its ``tokens``)
        that the cache holds, block 0 first, up to the first miss."""
        bs, out = self.block_size, []
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            out.append(block)
        return out

    def hold(self, blocks: list[int]) -> None:
        """Take a reference on each block (cached or in use): none is evicted until
        ``unhold``."""
        for b in blocks:
            self.pool.acquire(b)

    def unhold(self, blocks: list[int]) -> None:
        """Drop the references ``hold`` or ``allocate_published`` took, tail first (a
        prefix's later blocks are evicted before its head)."""
        self.pool.release(blocks[::-1])

    def allocate_published(
        self, hashes: list[int], tokens: list[int], first: int, n: int
    ) -> list[int]:
        """``n`` fresh blocks, held, and published at once: block ``i`` under
        ``hashes[first + i]`` for tokens ``[(first + i) * bs, (first + i + 1) * bs)``.
        A lookup finds them before their KV is written: the caller writes it before
        ``unhold``, or ``unpublish``es them if the write fails. Raises NoFreeBlocksError
        when fewer than ``n`` blocks can be freed."""
        blocks = self.allocate_unpublished(n)
        self.publish(blocks, hashes, tokens, first)
        return blocks

    def allocate_unpublished(self, n: int) -> list[int]:
        """``n`` fresh blocks, held and published nowhere: no lookup finds them, so the
        caller may write their KV while steps run (a colocated replica's store load), then
        ``publish`` them, or just ``unhold`` them (they return to the free list). Raises
        NoFreeBlocksError when fewer than ``n`` blocks can be freed."""
        return self.pool.allocate(n)

    def publish(self, blocks: list[int], hashes: list[int], tokens: list[int], first: int) -> None:
        """Publish held blocks whose KV is written: block ``i`` under ``hashes[first + i]``
        for tokens ``[(first + i) * bs, (first + i + 1) * bs)``. A hash some other block
        already holds keeps that block; this one then stays private (freed on ``unhold``)."""
        bs = self.block_size
        for i, b in enumerate(blocks):
            k = first + i
            self.pool.register(b, hashes[k], tokens[k * bs : (k + 1) * bs])

    def unpublish(self, blocks: list[int]) -> None:
        """Held blocks whose KV turned out bad: no lookup finds them any more, and they
        return to the free list on ``unhold``."""
        for b in blocks:
            self.pool.unregister(b)
