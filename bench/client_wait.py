"""How long the bench client itself waited for a CPU during a run: the part of a measured gap
between tokens that no server caused.

A client on the server's cores reads each chunk only when its event loop runs. Where the
engines keep every core busy, the loop can sit runnable for a long time before the kernel
gives it a core (seen here: up to 5 s under Linux's per-session autogroups, with the
replica's frames on time at the ingress), and the chunks queue in the socket meanwhile. A
``LoopWatch`` beside the client's streams measures that: every ``period`` it sleeps and
records how late it woke (``lag``), and on Linux the loop thread's run-queue time
(``/proc/thread-self/schedstat``, the kernel's own count of time spent runnable but not
running), so a tail can be split into the server's and the client's.

    watch = LoopWatch()
    task = asyncio.ensure_future(watch.run())
    ...                                       # the run's streams
    task.cancel(); watch.max_lag, watch.runqueue_s, watch.cpu_s
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def schedstat_seconds(field: int) -> float | None:
    """One of the calling thread's ``/proc/thread-self/schedstat`` counters in seconds (0:
    time on a CPU; 1: time runnable but waiting for one); None without schedstats."""
    try:
        return int(SCHEDSTAT.read_text().split()[field]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def runqueue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux with
    schedstats' basic counters; None elsewhere)."""
    return schedstat_seconds(1)


def cpu_seconds() -> float | None:
    """Seconds the calling thread has run on a CPU (as ``runqueue_seconds``)."""
    return schedstat_seconds(0)


class LoopWatch:
    """``clock`` and ``runqueue`` are the readings it takes (injected by tests)."""

    def __init__(
        self,
        period: float = 0.01,
        clock: Callable[[], float] = time.perf_counter,
        runqueue: Callable[[], float | None] = runqueue_seconds,
        cpu: Callable[[], float | None] = cpu_seconds,
    ) -> None:
        self.period = period
        self.clock = clock
        self.runqueue = runqueue
        self.cpu = cpu
        self.max_lag = 0.0  # seconds a wake-up came late, at most
        self.runqueue_s: float | None = None  # the loop thread's run-queue wait over the run
        self.cpu_s: float | None = None  # the loop thread's time on a CPU over the run
        self._start = runqueue()
        self._cpu_start = cpu()

    async def run(self) -> None:
        """Until cancelled: wake every ``period`` and keep the worst lateness."""
        try:
            while True:
                before = self.clock()
                await asyncio.sleep(self.period)
                self.max_lag = max(self.max_lag, self.clock() - before - self.period)
        finally:
            now = self.runqueue()
            if now is not None and self._start is not None:
                self.runqueue_s = now - self._start
            ran = self.cpu()
            if ran is not None and self._cpu_start is not None:
                self.cpu_s = ran - self._cpu_start
