"""The event heap: an event is a time and an action; firing an action returns new events.

Invariants: time never goes backwards (an action may only schedule events at or after the
time it fires); events at the same time fire in the order they were scheduled (a counter
breaks ties), so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import NamedTuple

Action = Callable[[float], "Iterable[Event] | None"]


class Event(NamedTuple):
    time: float
    action: Action


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Action]] = []
        self._counter = 0
        self.now = 0.0
        self.fired = 0

    def push(self, event: Event) -> None:
        if event.time < self.now:
            raise ValueError(f"event at {event.time} is before now ({self.now})")
        heapq.heappush(self._heap, (event.time, self._counter, event.action))
        self._counter += 1

    def extend(self, events: Iterable[Event] | None) -> None:
        for e in events or ():
            self.push(e)

    def __len__(self) -> int:
        return len(self._heap)

    def next_time(self) -> float:
        """Time of the next queued event (infinity when none)."""
        return self._heap[0][0] if self._heap else float("inf")

    def run(self, until: float = float("inf")) -> None:
        """Fire events in time order until the heap is empty or the next one is after ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, action = heapq.heappop(heap)
            self.now = t
            self.fired += 1
            new = action(t)
            if new:
                for e in new:
                    if e.time < t:
                        raise ValueError(f"event at {e.time} scheduled from {t}")
                    heapq.heappush(heap, (e.time, self._counter, e.action))
                    self._counter += 1
