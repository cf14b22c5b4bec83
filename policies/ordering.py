"""Who goes first: orderings the scheduler sorts requests by. Pure and pluggable.

An ordering returns a sort key per sequence; smaller keys run first and are preempted last.
The deadline orderings (EDF, LRS, ILRS) are in ``slack.py``; ``slack.ORDERINGS`` names them
all.
"""

from __future__ import annotations

from typing import Protocol

from policies.sequence import Sequence


class Ordering(Protocol):
    """What the scheduler asks of an ordering."""

    # True: running and waiting prefills are ranked together by ``key`` every step (a
    # partial prefill competes with new ones); False: running prefills are served first
    # and waiting requests join after them (each group sorted by ``key``).
    ranks_prefills: bool

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        """Sort key; smaller runs first and is preempted last."""
        ...

    def urgency(self, seq: Sequence, now: float) -> float:
        """In [0, 1]: how much of a packed step's prefill room this prefill may claim
        (``policies.batch_packer``); 1 when the ordering has no notion of urgency."""
        ...


class FCFS:
    """First come, first served: arrival time, ties by admission order (stable sort)."""

    ranks_prefills = False

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        return (seq.arrival_time,)

    def urgency(self, seq: Sequence, now: float) -> float:
        return 1.0
