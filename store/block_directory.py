"""The cluster-wide map: block hash -> the store shards holding a visible copy.

Plain data, no Ray: whoever routes loads (the Conductor, a router, a store client) keeps one
and feeds it the shards' ``drain_events()`` (``("stored" | "removed", hash)``), or calls
``add``/``discard`` directly. It may lag a shard by one poll: a hit here is a hint that the
shard's ``acquire`` confirms (a stale entry costs a shorter prefix, never wrong KV).

    d = BlockDirectory()
    d.add_shard(shard_id); d.remove_shard(shard_id) -> int    # a dead shard drops out
    d.apply_events(shard_id, events); d.add(h, shard_id); d.discard(h, shard_id)
    d.holders(h) -> frozenset[str]
    d.match_prefix(hashes) -> int                 # leading blocks held by some shard
    d.best_holder(hashes) -> (shard_id | None, n) # longest prefix held by one shard

Invariants: ``shard in holders(h)`` iff ``h in blocks_of(shard)``; no hash maps to an empty
set; a removed shard holds nothing and events for it are ignored until it is added again
(an event that arrives after its shard was declared dead must not resurrect it).
"""

from __future__ import annotations

from collections.abc import Iterable

from store.block_key import check_block_hash


class BlockDirectory:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}

    # -- shards ----------------------------------------------------------------------------
    def add_shard(self, shard_id: str) -> None:
        if not isinstance(shard_id, str) or not shard_id:
            raise ValueError("shard_id must be a non-empty string")
        self._blocks.setdefault(shard_id, set())

    def remove_shard(self, shard_id: str) -> int:
        """Forget a shard (it died or left) and every block it held; returns how many."""
        blocks = self._blocks.pop(shard_id, set())
        for h in blocks:
            holders = self._holders[h]
            holders.discard(shard_id)
            if not holders:
                del self._holders[h]
        return len(blocks)

    @property
    def shards(self) -> list[str]:
        return sorted(self._blocks)

    def blocks_of(self, shard_id: str) -> frozenset[int]:
        return frozenset(self._blocks.get(shard_id, ()))

    def __len__(self) -> int:
        """Distinct blocks held somewhere."""
        return len(self._holders)

    # -- updates ---------------------------------------------------------------------------
    def add(self, block_hash: int, shard_id: str) -> None:
        """Record that ``shard_id`` holds ``block_hash``; ignored for an unknown shard."""
        h = check_block_hash(block_hash)
        blocks = self._blocks.get(shard_id)
        if blocks is None:
            return
        blocks.add(h)
        self._holders.setdefault(h, set()).add(shard_id)

    def discard(self, block_hash: int, shard_id: str) -> None:
        h = check_block_hash(block_hash)
        blocks = self._blocks.get(shard_id)
        if blocks is None or h not in blocks:
            return
        blocks.discard(h)
        holders = self._holders[h]
        holders.discard(shard_id)
        if not holders:
            del self._holders[h]

    def apply_events(self, shard_id: str, events: Iterable[tuple[str, int]]) -> None:
        for kind, h in events:
            if kind == "stored":
                self.add(h, shard_id)
            elif kind == "removed":
                self.discard(h, shard_id)
            else:
                raise ValueError(f"unknown store event {kind!r}; expected 'stored' or 'removed'")

    # -- queries ---------------------------------------------------------------------------
    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(int(block_hash), ()))

    def match_prefix(self, hashes: Iterable[int]) -> int:
        """Leading blocks of the chain held by at least one shard (maybe different ones)."""
        n = 0
        for h in hashes:
            if int(h) not in self._holders:
                break
            n += 1
        return n

    def prefix_len(self, shard_id: str, hashes: Iterable[int]) -> int:
        """Leading blocks of the chain held by ``shard_id``."""
        blocks = self._blocks.get(shard_id, set())
        n = 0
        for h in hashes:
            if int(h) not in blocks:
                break
            n += 1
        return n

    def best_holder(self, hashes: list[int]) -> tuple[str | None, int]:
        """The shard holding the longest prefix of ``hashes`` and that length (ties: the
        smallest shard id, so the answer is deterministic)."""
        best: tuple[str | None, int] = (None, 0)
        candidates = sorted(self._holders.get(int(hashes[0]), ())) if hashes else []
        for shard in candidates:
            n = self.prefix_len(shard, hashes)
            if n > best[1]:
                best = (shard, n)
        return best
