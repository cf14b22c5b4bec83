"""Closed-loop clients per region, replaying a trace's conversations turn by turn (the
SkyWalker paper's setup, section 5.1: each client issues one program at a time, and a
conversation's next turn follows its previous answer).

A conversation is a trace session (``sim.regional_workload.session_key``: Mooncake's first
two hash ids) with its turns in trace order; a later turn's hash ids extend an earlier
one's in 85% of Mooncake's consecutive turns, so the turn that follows at once finds the
previous turn's blocks in the cache that served it, the reuse the paper's conversation
workloads have. Replayed open-loop at the trace's own timestamps, consecutive turns are a
median of two minutes apart and the replica's cache has long evicted them.

Diurnal load: region ``k`` has ``round(clients * w_k(t))`` active clients at time ``t``
(``w_k`` from ``region_weights``: peaks a third of a period apart, sum constant, so the
global client count is steady while each region's swings). Client ``j`` of region ``k`` is
active while ``j`` is below that count; an active client takes the next unused
conversation from one shared list (trace order) and runs it to the end, one turn at a time,
the next turn ``think`` seconds after the previous answer reached it; a client that is not
active when its conversation ends waits until it is (checked on a grid of ``period / 400``).
No turn is issued after ``duration``.

Invariants: every conversation is run by at most one client, each turn once and after its
predecessor's answer; every request this hands out has a fresh id and is in ``region_of``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sim.regional_workload import region_weights, session_key
from sim.workload import TraceRequest


@dataclass(frozen=True)
class ClientLoad:
    clients: int  # mean active clients per region
    duration: float  # seconds during which turns are issued
    period: float  # the diurnal period (seconds)
    amplitude: float = 0.8
    think: float = 0.0  # seconds from an answer reaching its client to the next turn
    stagger: float = 0.05  # client j of a region starts at j * stagger

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError("clients must be at least 1")
        if self.duration <= 0 or self.period <= 0:
            raise ValueError("duration and period must be positive")
        if not 0.0 <= self.amplitude <= 1.0:
            raise ValueError("amplitude must be in [0, 1]")
        if self.think < 0 or self.stagger < 0:
            raise ValueError("think and stagger must be non-negative")


def conversations(requests: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """The trace's sessions, each its turns in trace order, in order of first turn."""
    by_key: dict[str, list[TraceRequest]] = {}
    for r in requests:
        by_key.setdefault(session_key(r), []).append(r)
    return list(by_key.values())


class ClosedLoopClients:
    def __init__(
        self, convs: Sequence[Sequence[TraceRequest]], regions: Sequence[str], load: ClientLoad
    ) -> None:
        if not regions:
            raise ValueError("give at least one region")
        self.convs = convs
        self.regions = list(regions)
        self.load = load
        self.region_of: dict[str, str] = {}  # request id -> its client's region
        self._next_conv = 0
        # request id -> (region index, client, conversation, turn)
        self._owner: dict[str, tuple[int, int, int, int]] = {}
        self.issued = 0
        self._slots = max(1, round(load.clients * (1 + load.amplitude)))

    def active(self, k: int, j: int, t: float) -> bool:
        w = region_weights(t, len(self.regions), self.load.period, self.load.amplitude)[k]
        return j < round(self.load.clients * w)

    def _activation(self, k: int, j: int, t: float) -> float | None:
        """The first grid time at or after ``t`` when client ``j`` of region ``k`` is
        active, or None if not before ``duration``."""
        step = self.load.period / 400
        while t <= self.load.duration:
            if self.active(k, j, t):
                return t
            t += step
        return None

    def _turn(self, k: int, j: int, c: int, turn: int, t: float) -> TraceRequest:
        src = self.convs[c][turn]
        rid = f"c{c}.{turn}"
        self._owner[rid] = (k, j, c, turn)
        self.region_of[rid] = self.regions[k]
        self.issued += 1
        return replace(src, request_id=rid, arrival=t, session_id=f"c{c}")

    def _start(self, k: int, j: int, t: float) -> list[TraceRequest]:
        """Client (k, j) is free at ``t``: its next conversation's first turn, once active."""
        at = self._activation(k, j, t)
        if at is None or self._next_conv >= len(self.convs):
            return []
        c = self._next_conv
        self._next_conv += 1
        return [self._turn(k, j, c, 0, at)]

    def initial(self) -> list[TraceRequest]:
        out = []
        for k in range(len(self.regions)):
            for j in range(self._slots):
                out += self._start(k, j, j * self.load.stagger)
        return sorted(out, key=lambda r: r.arrival)

    def answered(self, request_id: str, t: float) -> list[TraceRequest]:
        """``request_id``'s answer (or refusal) reached its client at ``t``: what it sends
        next."""
        k, j, c, turn = self._owner.pop(request_id)
        nxt = t + self.load.think
        if nxt > self.load.duration:
            return []
        if turn + 1 < len(self.convs[c]):
            return [self._turn(k, j, c, turn + 1, nxt)]
        return self._start(k, j, nxt)
