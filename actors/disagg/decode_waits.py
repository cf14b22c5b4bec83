"""Requests of one ``PDCluster`` that wait for decode room (``policies.decode_wait``).

``PDCluster.submit_request`` offers a request the Conductor turned away for decode room
(``hold``); a held request is accepted (its verdict is pending) and waits in FIFO order.
``place_waiting`` runs after every poll has applied the replicas' reports (decode blocks
freed by finished requests among them): requests past ``max_wait_s`` are refused, then
the queue is placed from its head until one finds no room. A request refused here (past
the bound, or for a reason that does not wait, e.g. an SLO) is ended and keeps its
``RequestRejected`` until it is released: the caller answers it with that 429.

Invariants:
- A waiting request is in the ``RequestTable``, has no attempt (no key, nothing reserved
  or queued on any replica) and is in the queue; a replica failure cannot lose it, it is
  placed on whatever replicas the cluster has when room appears.
- Each request is in exactly one of: waiting, placed (verdict accepted), refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.disagg.conductor import RequestRejected
from actors.disagg.pd_request import PDRequest
from actors.disagg.request_table import RequestTable
from policies.decode_wait import WAIT_REASONS, DecodeWaitQueue


class DecodeWaits:
    """``place``: places one request or raises ``RequestRejected`` (``RequestPlacement``);
    ``retry_after``: the Retry-After of a refusal past the bounds (the Conductor's floor)."""

    def __init__(
        self,
        queue: DecodeWaitQueue,
        table: RequestTable,
        place: Callable[[PDRequest], None],
        retry_after: float,
    ) -> None:
        self.queue, self.table, self.place = queue, table, place
        self.retry_after = retry_after
        self.refused: dict[str, RequestRejected] = {}  # request id -> its 429, until released
        self.num_waited = 0  # requests placed after waiting
        self.seconds_waited = 0.0  # their waits, summed

    def submit(self, req: PDRequest) -> None:
        """Place ``req`` now, or queue it when the queue is not empty (no overtaking) or
        decode has no room; raises ``RequestRejected`` when it can neither run nor wait."""
        if self.queue.must_queue():
            self.hold(req, RequestRejected("decode_full", self.retry_after))
            return
        try:
            self.place(req)
        except RequestRejected as e:
            self.hold(req, e)

    def hold(self, req: PDRequest, refusal: RequestRejected) -> None:
        """Queue ``req`` (refused for ``refusal``'s reason); re-raises the refusal when that
        reason does not wait or the queue is full."""
        if not self.queue.may_wait(refusal.reason):
            raise refusal
        self.queue.join(req.request_id, time.monotonic())

    def waiting(self, request_id: str) -> bool:
        return request_id in self.queue

    def cancel(self, request_id: str) -> None:
        """Take an aborted request out of the queue (it was never placed)."""
        self.queue.remove(request_id)

    def forget(self, request_id: str) -> RequestRejected | None:
        """Drop a released request's refusal; returns it (None: it was not refused)."""
        return self.refused.pop(request_id, None)

    def place_waiting(self) -> None:
        """Refuse what waited past ``max_wait_s``, then place from the head in order until
        a request finds no room; one refused for another reason ends at once."""
        now = time.monotonic()
        for w in self.queue.expired(now):
            self._refuse(w.request_id, RequestRejected("decode_full", self.retry_after))
        while (head := self.queue.head()) is not None:
            req = self.table.get(head.request_id)
            if req is None or req.output is not None:  # ended meanwhile
                self.queue.pop_head()
                continue
            try:
                self.place(req)
            except RequestRejected as e:
                if e.reason in WAIT_REASONS:
                    return  # still no room: the head keeps its place
                self.queue.pop_head()
                self._refuse(req.request_id, e)
                continue
            self.queue.pop_head()
            self.num_waited += 1
            self.seconds_waited += time.monotonic() - head.since

    def _refuse(self, request_id: str, refusal: RequestRejected) -> None:
        req = self.table.get(request_id)
        if req is None or req.output is not None:
            return
        self.refused[request_id] = refusal
        req.end(text=False)
