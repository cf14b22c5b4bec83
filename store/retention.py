"""Retention of a store shard: blocks kept ahead of LRU eviction until a deadline (sessions).

A turn of a session ends; its blocks are ``retain``-ed for the request's ``kv_retention_s``
so the next turn, after a tool pause, still finds them in the store. The shard's eviction
asks ``is_retained`` and picks unretained victims first (``store.shard_store``): a retained
block leaves DRAM for SSD before anything else is dropped for it, and is dropped only when
nothing unretained is left to drop. Past its deadline a block is an ordinary LRU block
again (its place in the tiers' LRU order never changed).

Tenants: each entry belongs to one tenant (the request's, ``""`` without keys). At most
``max_blocks_per_tenant`` entries per tenant: retaining more takes retention from that
tenant's oldest-retained blocks first, so one tenant's sessions cannot hold the whole store.

    table = RetentionTable(max_blocks_per_tenant=None, clock=time.monotonic)
    table.retain(hashes, tenant, seconds) -> int   # entries set (re-retaining extends)
    table.is_retained(h) -> bool; table.expire() -> list[int]; table.forget(h)
    table.num_retained; table.tenant_blocks(tenant); table.expired; table.revoked

Invariants: ``h`` is retained iff it has an entry and ``clock() < until``; every entry is in
exactly one tenant's order (oldest retained first) and the sum of those orders' sizes is
``num_retained``; ``len(order(t)) <= max_blocks_per_tenant``. ``expired`` counts entries
that reached their deadline, ``revoked`` those that lost retention to their tenant's bound.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class RetentionTable:
    def __init__(
        self,
        max_blocks_per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_tenant is not None and max_blocks_per_tenant < 1:
            raise ValueError(f"max_blocks_per_tenant must be >= 1, got {max_blocks_per_tenant}")
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.clock = clock
        self._until: dict[int, float] = {}  # hash -> deadline (clock time)
        self._tenant: dict[int, str] = {}  # hash -> its tenant
        self._orders: dict[str, OrderedDict[int, None]] = {}  # tenant -> hashes, oldest first
        self._deadlines: list[tuple[float, int]] = []  # heap; stale pairs skipped on pop
        self.expired = 0
        self.revoked = 0

    @property
    def num_retained(self) -> int:
        return len(self._until)

    def tenant_blocks(self, tenant: str | None) -> int:
        return len(self._orders.get(tenant or "", ()))

    def retain(self, hashes: Iterable[int], tenant: str | None, seconds: float) -> int:
        """Keep each of ``hashes`` until ``clock() + seconds`` (a later deadline than the
        one held wins) as ``tenant``'s newest; returns how many entries were set."""
        if not seconds > 0:
            return 0
        self.expire()
        owner = tenant or ""
        until = self.clock() + seconds
        order = self._orders.setdefault(owner, OrderedDict())
        n = 0
        for raw in hashes:
            h = int(raw)
            held = self._until.get(h)
            if held is not None and self._tenant[h] != owner:
                self._unlink(h)  # the latest retainer owns it
            self._until[h] = max(until, held or until)
            self._tenant[h] = owner
            order[h] = None
            order.move_to_end(h)
            heapq.heappush(self._deadlines, (self._until[h], h))
            n += 1
        if len(self._deadlines) > 2 * len(self._until) + 64:  # drop the stale pairs
            self._deadlines = [(u, h) for h, u in self._until.items()]
            heapq.heapify(self._deadlines)
        bound = self.max_blocks_per_tenant
        while bound is not None and len(order) > bound:
            oldest = next(iter(order))
            self._remove(oldest)
            self.revoked += 1
        return n

    def is_retained(self, block_hash: int) -> bool:
        until = self._until.get(block_hash)
        return until is not None and self.clock() < until

    def expire(self) -> list[int]:
        """Drop every entry whose deadline passed; returns their hashes."""
        now = self.clock()
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            until, h = heapq.heappop(heap)
            if self._until.get(h) == until:  # else stale: re-retained or forgotten
                self._remove(h)
                out.append(h)
        self.expired += len(out)
        return out

    def forget(self, block_hash: int) -> bool:
        """The block left the store: its entry goes (not counted as expired)."""
        if block_hash not in self._until:
            return False
        self._remove(block_hash)
        return True

    def _remove(self, h: int) -> None:
        self._unlink(h)
        del self._until[h]
        del self._tenant[h]

    def _unlink(self, h: int) -> None:
        owner = self._tenant[h]
        order = self._orders[owner]
        del order[h]
        if not order:
            del self._orders[owner]
