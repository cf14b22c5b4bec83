"""Pins: which blocks in-flight requests hold, so eviction and demotion skip them.

A request pins blocks while it loads them (``pin``) and lets go of all of them at once when
done or aborted (``release``). A block may be pinned by several requests, and several times
by one; it is pinned while its count is positive.

Invariant: ``count(h) == sum over requests of how often that request pinned h``, and a
request with no pins left has no entry, so an idle store has ``len(table) == 0``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class PinTable:
    def __init__(self) -> None:
        self._by_request: dict[str, Counter[int]] = {}
        self._count: Counter[int] = Counter()

    def __len__(self) -> int:
        """Requests holding pins."""
        return len(self._by_request)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._count)

    def is_pinned(self, block_hash: int) -> bool:
        return block_hash in self._count

    def pin(self, request_id: str, hashes: Iterable[int]) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        held = self._by_request.setdefault(request_id, Counter())
        for h in hashes:
            held[h] += 1
            self._count[h] += 1
        if not held:
            del self._by_request[request_id]

    def unpin(self, request_id: str, hashes: Iterable[int]) -> None:
        """Drop one pin of each of ``hashes`` held by ``request_id`` (missing ones ignored)."""
        held = self._by_request.get(request_id)
        if held is None:
            return
        for h in hashes:
            if held[h] > 0:
                held[h] -= 1
                self._drop(h, 1)
                if held[h] == 0:
                    del held[h]
        if not held:
            del self._by_request[request_id]

    def release(self, request_id: str) -> list[int]:
        """Drop every pin ``request_id`` holds; returns the hashes it held."""
        held = self._by_request.pop(request_id, None)
        if held is None:
            return []
        for h, n in held.items():
            self._drop(h, n)
        return list(held)

    def _drop(self, block_hash: int, n: int) -> None:
        self._count[block_hash] -= n
        if self._count[block_hash] <= 0:
            del self._count[block_hash]
