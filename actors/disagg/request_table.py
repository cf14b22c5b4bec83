"""The requests of one ``PDCluster``: every request not yet released, its live attempt by
key, and the requests waiting to run again.

Invariants:
- ``by_key`` names exactly the live attempts (``PDRequest.key``) of requests in the table;
  a request waiting to run again, or ended, has no entry there.
- A request waits to run again (``retry_later``) only while it has no live attempt; the
  queue keeps the order in which they are to be placed again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from actors.disagg.pd_request import PDRequest


class RequestTable:
    def __init__(self) -> None:
        self._reqs: dict[str, PDRequest] = {}  # request id -> request, until released
        self._by_key: dict[str, PDRequest] = {}  # live attempt key -> its request
        self._retry: deque[str] = deque()  # request ids waiting to be placed again

    # -- requests ---------------------------------------------------------------------------
    def add(self, req: PDRequest) -> None:
        rid = req.request_id
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        self._reqs[rid] = req

    def remove(self, request_id: str) -> PDRequest:
        """Drop a request that holds no attempt and waits for no retry (ended, or turned
        away before its first attempt)."""
        return self._reqs.pop(request_id)

    def get(self, request_id: str) -> PDRequest | None:
        return self._reqs.get(request_id)

    def __getitem__(self, request_id: str) -> PDRequest:
        return self._reqs[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __iter__(self) -> Iterator[PDRequest]:
        return iter(list(self._reqs.values()))

    def has_unfinished(self) -> bool:
        return any(r.output is None for r in self._reqs.values())

    def bound_to_decode(self, decode_id: str) -> list[PDRequest]:
        """Unfinished requests whose attempt runs on decode replica ``decode_id``."""
        return [r for r in self._reqs.values() if r.decode_id == decode_id and r.output is None]

    def in_prefill_on(self, prefill_id: str) -> list[PDRequest]:
        """Requests whose attempt is in prefill on replica ``prefill_id``."""
        return [r for r in self._reqs.values() if r.prefill_id == prefill_id and r.in_prefill]

    def in_prefill_counts(self) -> Counter[str]:
        """Prefill replica id -> attempts in prefill there."""
        return Counter(r.prefill_id or "" for r in self._reqs.values() if r.in_prefill)

    def num_waiting(self) -> int:
        """Requests in prefill or waiting to run again."""
        return sum(r.in_prefill for r in self._reqs.values()) + len(self._retry)

    # -- attempts ---------------------------------------------------------------------------
    def bind(self, key: str, req: PDRequest) -> None:
        """``key`` is ``req``'s live attempt from now on."""
        self._by_key[key] = req

    def attempt(self, key: str) -> PDRequest | None:
        """The request whose live attempt is ``key`` (None: given up, or ended)."""
        return self._by_key.get(key)

    def unbind(self, key: str) -> PDRequest | None:
        """Forget attempt ``key``; returns its request if it was live."""
        return self._by_key.pop(key, None)

    # -- running again ----------------------------------------------------------------------
    def retry_later(self, req: PDRequest) -> None:
        self._retry.append(req.request_id)

    def cancel_retry(self, request_id: str) -> None:
        if request_id in self._retry:
            self._retry.remove(request_id)

    def take_retries(self) -> Iterator[PDRequest]:
        """Each request waiting to run again now, in order, taken off the queue as it is
        yielded (ended or released ones are skipped); one that cannot be placed now goes
        back with ``retry_later``, behind those still queued."""
        for _ in range(len(self._retry)):
            req = self._reqs.get(self._retry.popleft())
            if req is not None and req.output is None:
                yield req
