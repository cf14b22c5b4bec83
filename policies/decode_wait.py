"""The FIFO where a disaggregated request waits for decode room instead of being refused.

A request whose only obstacle is decode room (the Conductor's or DualPath's
``"decode_full"``, or ``"decode_restarting"`` while a dead decode replica is replaced)
joins the back of the queue instead of getting a 429, and is placed as soon as a decode
instance has room. The caller places the queue in order and stops at the first request
that still finds no room, so a big request at the head is never overtaken by smaller ones
(no starvation); a new arrival joins behind everyone already waiting.

Bounds: at most ``max_queued`` requests wait, and none longer than ``max_wait_s``; past
either the request is refused with the 429 it would have got without the queue. SLO
rejections (``"ttft_slo"``, ``"tbt_slo"``) and every other reason never wait.

Pure: ``now`` is an argument (any monotonic clock, the same for every call).
Invariant: entries are in the order they joined, so their ``since`` never decreases from
head to tail, and the expired ones are always a prefix of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WAIT_REASONS = frozenset({"decode_full", "decode_restarting"})


@dataclass(frozen=True)
class Waiting:
    request_id: str
    since: float  # when it joined the queue


class DecodeWaitQueue:
    """``max_wait_s``: the longest a request waits (0: never wait, every such request is
    refused at once as before); ``max_queued``: the most requests waiting at once."""

    def __init__(self, max_wait_s: float, max_queued: int) -> None:
        if max_wait_s < 0 or max_queued < 0:
            raise ValueError(
                f"decode wait bounds must be >= 0, got max_wait_s={max_wait_s}, "
                f"max_queued={max_queued}"
            )
        self.max_wait_s = max_wait_s
        self.max_queued = max_queued
        self._queue: deque[Waiting] = deque()
        self._ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def must_queue(self) -> bool:
        """A new arrival goes behind those waiting (it may not try to place first)."""
        return bool(self._queue)

    def may_wait(self, reason: str) -> bool:
        """Whether a request refused for ``reason`` may join the queue now."""
        return reason in WAIT_REASONS and self.max_wait_s > 0 and len(self._queue) < self.max_queued

    def join(self, request_id: str, now: float) -> None:
        if request_id in self._ids:
            raise ValueError(f"request {request_id!r} is already waiting")
        if self._queue and now < self._queue[-1].since:
            raise ValueError("now must not go back in time")
        self._queue.append(Waiting(request_id, now))
        self._ids.add(request_id)

    def head(self) -> Waiting | None:
        return self._queue[0] if self._queue else None

    def pop_head(self) -> Waiting:
        """Take the head off (it was placed, or refused for a reason that does not wait)."""
        w = self._queue.popleft()
        self._ids.discard(w.request_id)
        return w

    def remove(self, request_id: str) -> Waiting | None:
        """Take a request out wherever it is (cancelled); None if it was not waiting."""
        if request_id not in self._ids:
            return None
        for w in self._queue:
            if w.request_id == request_id:
                self._queue.remove(w)
                self._ids.discard(request_id)
                return w
        raise AssertionError("the id set and the queue disagree")

    def expired(self, now: float) -> list[Waiting]:
        """Take off and return every request that has waited ``max_wait_s`` or longer
        (a prefix of the queue, in order)."""
        out: list[Waiting] = []
        while self._queue and now - self._queue[0].since >= self.max_wait_s:
            out.append(self.pop_head())
        return out
