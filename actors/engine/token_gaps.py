"""The gaps between a request's tokens, as the inter-token-latency histogram counts them.

Each of ``n`` tokens that arrive together at ``now`` gets an equal share of the time since
the request's previous tokens; a request's first tokens get none (their latency is the
TTFT). The colocated engine loop (``ReplicaMetrics``) and a decode replica whose tokens go
straight to their ingress (``DecodeReplica``, reported as ``TokenGaps``) both count with
this, so the histogram means the same on either path. Written by one thread.
"""

from __future__ import annotations


class TokenGapClock:
    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # request id -> when its last tokens came

    def gaps(self, request_id: str, n: int, now: float) -> list[float]:
        """The gaps of ``n`` tokens of ``request_id`` that arrived at ``now`` (monotonic
        seconds): ``n`` equal shares, or none for a request's first tokens or ``n <= 0``."""
        if n <= 0:
            return []
        last = self._last.get(request_id)
        self._last[request_id] = now
        if last is None:
            return []
        return [max(0.0, now - last) / n] * n

    def forget(self, request_id: str) -> None:
        """The request ended: drop its last time (no-op if it had none)."""
        self._last.pop(request_id, None)
