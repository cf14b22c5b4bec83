"""Links with a bandwidth budget and two traffic classes (DualPath's SNIC / CNIC model).

A node has a storage link (its storage NIC: reads and writes of the KV store) and a
compute link (its compute NIC: model-execution messages and engine-to-engine KV). Each
``Link`` is a token bucket of ``bytes_per_second`` with at most ``burst_bytes`` saved up,
and serves two classes:

    EXEC  model-execution messages (collectives, activations): served first
    KV    KV transfers: in the capacity EXEC leaves, except a floor (``kv_floor``, the
          paper's ~1% reserved lane) that keeps them from starving

KV moves in chunks of at most ``chunk_bytes``, each granted separately, so an EXEC message
waits behind at most one KV chunk. On this machine the
bucket is the budget (an emulated NIC); on a cluster the NIC and its virtual lanes are.

    links = NodeLinks(LinkBudget(storage_bps=..., compute_bps=...))
    links.storage(node).send(nbytes, KV, move)      # move(offset, n) does the real copy
    budgeted = BudgetedTransfer(engine, link)       # a TransferEngine whose ranges pay
    budgeted.read_ranges(remote, local, ranges)     #   the link, chunk by chunk

Thread-safe; one process's links are its own (each emulated node lives in the process
that moves its bytes).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from store.transfer.endpoint import Endpoint, LocalMemory, Ranges


class TrafficClass(enum.Enum):
    EXEC = "exec"  # model-execution messages: first
    KV = "kv"  # KV transfers: in the remaining capacity


EXEC = TrafficClass.EXEC
KV = TrafficClass.KV


class Link:
    def __init__(
        self,
        name: str,
        bytes_per_second: float,
        burst_bytes: int | None = None,
        chunk_bytes: int = 64 << 10,
        kv_floor: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``burst_bytes``: what the bucket saves up (default: 10 ms of traffic, at least
        one chunk); ``chunk_bytes``: the largest single grant (KV is split into these)."""
        if bytes_per_second <= 0:
            raise ValueError(f"link {name!r}: bytes_per_second must be positive")
        if chunk_bytes <= 0 or not 0.0 <= kv_floor < 1.0:
            raise ValueError(f"link {name!r}: need chunk_bytes > 0 and 0 <= kv_floor < 1")
        burst = burst_bytes if burst_bytes is not None else int(bytes_per_second / 100)
        self.name = name
        self.rate = float(bytes_per_second)
        self.chunk_bytes = min(chunk_bytes, burst) if burst_bytes is not None else chunk_bytes
        self.burst = max(burst, self.chunk_bytes)
        self.kv_floor = kv_floor
        self.clock = clock
        self._tokens = float(self.burst)
        self._last = clock()
        self._cond = threading.Condition()
        self._exec_waiting = 0
        self.bytes = {EXEC: 0, KV: 0}  # granted so far, per class
        self.grants = {EXEC: 0, KV: 0}

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def _kv_starving(self) -> bool:
        total = self.bytes[EXEC] + self.bytes[KV]
        return self.bytes[KV] < self.kv_floor * total

    def acquire(self, nbytes: int, cls: TrafficClass) -> None:
        """Block until ``nbytes`` (at most ``burst``) may pass in class ``cls``."""
        if nbytes <= 0:
            return
        if nbytes > self.burst:
            raise ValueError(
                f"link {self.name!r}: one grant of {nbytes} bytes exceeds the burst "
                f"({self.burst}); send() splits larger transfers"
            )
        with self._cond:
            if cls is EXEC:
                self._exec_waiting += 1
            try:
                while True:
                    self._refill()
                    held_back = cls is KV and self._exec_waiting > 0 and not self._kv_starving()
                    if not held_back and self._tokens >= nbytes:
                        self._tokens -= nbytes
                        self.bytes[cls] += nbytes
                        self.grants[cls] += 1
                        return
                    wait = None if held_back else (nbytes - self._tokens) / self.rate
                    self._cond.wait(wait)
            finally:
                if cls is EXEC:
                    self._exec_waiting -= 1
                    self._cond.notify_all()

    def send(
        self, nbytes: int, cls: TrafficClass, move: Callable[[int, int], object] | None = None
    ) -> int:
        """Pass ``nbytes`` through the link in grants of at most ``chunk_bytes`` (EXEC: of
        at most ``burst``); after each grant ``move(offset, n)`` copies those bytes.
        Returns ``nbytes``."""
        step = self.chunk_bytes if cls is KV else self.burst
        for offset in range(0, nbytes, step):
            n = min(step, nbytes - offset)
            self.acquire(n, cls)
            if move is not None:
                move(offset, n)
        return max(0, nbytes)


@dataclass(frozen=True)
class LinkBudget:
    """Per-node budgets in bytes per second (None: that link is not limited)."""

    storage_bps: float | None = None
    compute_bps: float | None = None
    chunk_bytes: int = 64 << 10

    def share(self, processes: int) -> LinkBudget:
        """One of ``processes`` equal shares of each link (a node's processes that each
        hold their own ``NodeLinks``, e.g. a replica's workers, together get the node's)."""
        if processes < 1:
            raise ValueError("processes must be at least 1")

        def part(bps: float | None) -> float | None:
            return None if bps is None else bps / processes

        return replace(self, storage_bps=part(self.storage_bps), compute_bps=part(self.compute_bps))


class NodeLinks:
    """Each node's storage and compute ``Link`` under one ``LinkBudget`` (made on first use)."""

    def __init__(self, budget: LinkBudget) -> None:
        self.budget = budget
        self._links: dict[tuple[str, str], Link | None] = {}
        self._lock = threading.Lock()

    def _get(self, node: str, kind: str, bps: float | None) -> Link | None:
        with self._lock:
            key = (node, kind)
            if key not in self._links:
                self._links[key] = (
                    None
                    if bps is None
                    else Link(f"{kind}:{node}", bps, chunk_bytes=self.budget.chunk_bytes)
                )
            return self._links[key]

    def storage(self, node: str) -> Link | None:
        return self._get(node, "storage", self.budget.storage_bps)

    def granted(self, node: str) -> dict[str, dict[str, int]]:
        """Bytes granted so far on ``node``'s limited links: kind ("storage", "compute")
        -> class ("exec", "kv") -> bytes."""
        with self._lock:
            links = {k: link for (n, k), link in self._links.items() if n == node and link}
        return {k: {c.value: link.bytes[c] for c in TrafficClass} for k, link in links.items()}

    def compute(self, node: str) -> Link | None:
        return self._get(node, "compute", self.budget.compute_bps)


def split_ranges(ranges: Ranges, chunk_bytes: int) -> Iterator[list[tuple[int, int, int]]]:
    """``(remote offset, local offset, nbytes)`` ranges cut into groups of at most
    ``chunk_bytes`` bytes each (a range longer than a chunk is cut into pieces)."""
    group: list[tuple[int, int, int]] = []
    size = 0
    for remote, local, n in ranges:
        done = 0
        while done < n:
            take = min(n - done, chunk_bytes - size)
            group.append((remote + done, local + done, take))
            size += take
            done += take
            if size == chunk_bytes:
                yield group
                group, size = [], 0
    if group:
        yield group


class BudgetedTransfer:
    """A ``TransferEngine``'s range moves paid through a ``Link`` (None: unlimited), chunk
    by chunk: each chunk's bytes are granted, then copied."""

    def __init__(self, engine: object, link: Link | None, cls: TrafficClass = KV) -> None:
        self.engine = engine
        self.link = link
        self.cls = cls

    def _move(
        self,
        op: Callable[[Endpoint, LocalMemory, Ranges], int],
        remote: Endpoint,
        local: LocalMemory,
        ranges: Ranges,
    ) -> int:
        if self.link is None:
            return op(remote, local, ranges)
        moved = 0
        for group in split_ranges(ranges, self.link.chunk_bytes):
            self.link.acquire(sum(n for _, _, n in group), self.cls)
            moved += op(remote, local, group)
        return moved

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        return self._move(self.engine.read_ranges, remote, local, ranges)  # type: ignore[attr-defined]

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        return self._move(self.engine.write_ranges, remote, local, ranges)  # type: ignore[attr-defined]
