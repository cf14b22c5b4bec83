"""Per-layer loads of stored KV into a prefill replica's paged cache while its prefill runs
(DualPath's layer-wise prefill; Mooncake loads the whole prefix first).

A load reads a request's stored prefix one layer at a time on a background thread
(``read_layer(l)`` copies layer ``l``'s K and V of every block), layer 0 first; the worker's
step hook calls ``before_layer(l)`` before layer ``l`` computes, which waits until every
load started so far has layer ``l`` in the cache. So the read of layer ``l + 1`` overlaps
the compute of layer ``l``, and the request queues at once instead of after its whole
prefix arrived. A step waits only for the loads writing blocks it reads
(``begin_step``), so a request whose prefix is in does not wait for another's.

A load that fails (the source died) still releases every waiting layer, so no step hangs,
and records why: the replica then recomputes every request that may have read its blocks
(``take_finished`` hands back finished loads, failed or not, on the loop thread).

``timeline`` (when ``record``): ``(event, layer, time.perf_counter())`` with events
``load-start``, ``load-end``, ``compute-start``, ``compute-end``, for tests and the bench.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerLoad:
    key: str  # the request that started it
    num_layers: int
    read_layer: Callable[[int], int]  # copies one layer; returns bytes moved
    on_done: Callable[[], None]  # runs on the loader thread once every layer is read
    context: Any = None  # the replica's own bookkeeping (blocks, hashes)
    blocks: frozenset[int] = frozenset()  # the cache blocks it writes (empty: unknown)
    done: list[threading.Event] = field(default_factory=list)  # per layer: in the cache
    complete: threading.Event = field(default_factory=threading.Event)  # on_done ran too
    error: str | None = None
    bytes_read: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.done = [threading.Event() for _ in range(self.num_layers)]

    @property
    def finished(self) -> bool:
        return self.complete.is_set()


class LayerLoader:
    def __init__(self, record: bool = False) -> None:
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="kv-layer-load")
        self._lock = threading.Lock()
        self._loads: list[LayerLoad] = []
        self.record = record
        self.timeline: list[tuple[str, int, float]] = []
        self._needed: list[LayerLoad] | None = None  # this step's loads (None: all)

    def _mark(self, event: str, layer: int) -> None:
        if self.record:
            self.timeline.append((event, layer, time.perf_counter()))

    def start(self, load: LayerLoad) -> None:
        with self._lock:
            self._loads.append(load)
        self._threads.submit(self._run, load)

    def _run(self, load: LayerLoad) -> None:
        start = time.perf_counter()
        for layer in range(load.num_layers):
            if load.error is None:
                self._mark("load-start", layer)
                try:
                    load.bytes_read += load.read_layer(layer)
                except Exception as e:  # the source died: recompute, never hang a step
                    load.error = f"{type(e).__name__}: {e}"
                self._mark("load-end", layer)
            load.done[layer].set()
        load.seconds = time.perf_counter() - start
        try:
            load.on_done()
        except Exception as e:
            load.error = load.error or f"{type(e).__name__}: {e}"
        load.complete.set()

    def begin_step(self, blocks: set[int] | None) -> None:
        """The step about to run reads cache ``blocks`` (None: unknown): its layers wait
        only for the loads writing any of them (a load with unknown blocks: always)."""
        with self._lock:
            loads = list(self._loads)
        if blocks is None:
            self._needed = None
        else:
            self._needed = [x for x in loads if not x.blocks or not blocks.isdisjoint(x.blocks)]

    def before_layer(self, layer: int) -> None:
        """Block until every load this step needs (``begin_step``; else every load started
        so far) holds ``layer``."""
        with self._lock:
            loads = list(self._loads) if self._needed is None else list(self._needed)
        for load in loads:
            if layer < load.num_layers:
                load.done[layer].wait()
        self._mark("compute-start", layer)

    def after_layer(self, layer: int) -> None:
        self._mark("compute-end", layer)

    def take_finished(self) -> list[LayerLoad]:
        """Loads whose every layer was read (or failed), removed from the waiting set. A
        step that ran every layer saw them all: such loads are always taken (their
        ``on_done``, which only posts, is waited for), so a failure is known before the
        step's requests finish."""
        with self._lock:
            done = [x for x in self._loads if not x.done or x.done[-1].is_set()]
            self._loads = [x for x in self._loads if all(x is not y for y in done)]
        for x in done:
            x.complete.wait()
        return done

    def wait_all(self) -> None:
        """Block until every load started so far has read its last layer (or failed)."""
        with self._lock:
            loads = list(self._loads)
        for load in loads:
            if load.done:
                load.done[-1].wait()

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
