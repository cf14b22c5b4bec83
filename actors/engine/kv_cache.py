"""The engine's door to KV: what a replica (its controller, its loop, a P/D replica) may ask
of its KV manager. Nobody outside the KV manager touches a ``BlockPool``.

``KVCache`` widens the scheduler's ``KVManager`` (``policies.scheduler``) with block
tables, statistics, cache events and integrity checks. Both ``store.kv_manager.
KVCacheManager`` (one pool) and ``store.kv_sharded_manager.ShardedKVManager`` (one pool per
KV-parallel rank) implement it. A one-rank replica's ``KVCacheManager`` also handles blocks
outside any request table (``cached_prefix``, ``hold`` / ``unhold``,
``allocate_published``, ``unpublish``, ``allocate_unpublished`` / ``publish``): loads
from the KV store into its prefix cache (a P/D prefill replica's, a colocated replica's).
"""

from __future__ import annotations

from typing import Protocol

from policies.scheduler import KVManager

Shard = tuple[int, int, list[int]]  # (KV rank, first position, block ids)


class KVCache(KVManager, Protocol):
    @property
    def kvp(self) -> int:
        """KV-parallel ranks (pools)."""
        ...

    @property
    def max_tokens(self) -> int:
        """The longest request the cache can hold."""
        ...

    @property
    def hit_ratio(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        ...

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use over every rank (0 once every request is freed)."""
        ...

    def shards(self, request_id: str) -> list[Shard]:
        """Where a request's KV lives: one shard per rank it spans, position order."""
        ...

    def block_table(self, request_id: str) -> list[int]:
        """The block ids of a request's first shard (its whole table on one rank)."""
        ...

    def check_blocks(self) -> list[int]:
        """Blocks in use per rank, after each pool's integrity check (AssertionError)."""
        ...

    def evict_all_cached(self) -> int:
        """Forget every cached prefix (its KV is gone or stale); returns blocks dropped."""
        ...

    def drain_events(self) -> list[tuple[str, int]]:
        """``("stored" | "evicted", hash)`` since the last drain, in order per rank."""
        ...

    def cached_hashes(self) -> list[int]:
        """Every hash a prefix hit can be served from, sorted (a router's full resync)."""
        ...

    def likely_cached_blocks(self, hashes: list[int]) -> int:
        """Leading ``hashes`` held, by hash alone (an admission estimate, not a hit)."""
        ...
