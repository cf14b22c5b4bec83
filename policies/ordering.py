"""Who goes first: orderings the scheduler sorts requests by. Pure and pluggable.

An ordering returns a sort key per sequence; smaller keys run first and are preempted last.
"""

from __future__ import annotations

from typing import Protocol

from policies.sequence import Sequence


class Ordering(Protocol):
    def key(self, seq: Sequence, now: float) -> tuple[float, ...]: ...


class FCFS:
    """First come, first served: arrival time, ties by admission order (stable sort)."""

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        return (seq.arrival_time,)
