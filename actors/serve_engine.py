"""A ReplicaController driven by its own thread, with an asyncio-facing request API.

``ReplicaController.step()`` blocks for a whole model iteration, so it never runs on an
event loop: one engine thread owns the controller (every call into it happens on that
thread), and other threads talk to it through a command queue. Results flow back through
per-request sinks (``loop.call_soon_threadsafe``), so the event loop only ever waits on
``asyncio.Queue``s.

Invariants:
- Every submitted request ends with exactly one ``("done", ...)`` or ``("error", ...)`` item
  on its sink, and is released from the controller (its blocks freed) when it does.
- ``take_events`` returns the pool's stored/evicted block events in the order they happened,
  each exactly once; after a resync, the returned full set plus later events is the exact
  cached set.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from actors.outputs import RequestOutput
from actors.replica_controller import ReplicaController
from actors.sampling import SamplingParams
from actors.serve_metrics import ReplicaMetrics
from errors import InvalidRequestError, MeridianError

log = logging.getLogger(__name__)

Sink = Callable[[tuple], None]
MAX_BUFFERED_EVENTS = 1 << 20  # beyond this, drop the deltas and resync the whole set
IDLE_RELEASE_S = 2.0  # idle this long: let the workers stop polling


class OverloadedError(MeridianError):
    """The replica's queue is full; retry after a moment (HTTP 429)."""

    http_status = 429


# -- small accessors into the controller (read on the engine thread only) --------------------
def replica_stats(engine: ReplicaController) -> dict[str, Any]:
    """The counters a router needs, plus KV usage and the prefix cache hit ratio (summed
    over the KV-parallel ranks' pools)."""
    pools = engine.pools
    total = sum(p.num_blocks for p in pools)
    return {
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "queued_prefill_tokens": engine.scheduler.queued_prefill_tokens(),
        "free_blocks": sum(p.num_free for p in pools),
        "total_blocks": total,
        "kv_usage": sum(p.num_in_use for p in pools) / total,
        "cache_hit_ratio": engine.kv.hit_ratio,
        "time": time.time(),
    }


def cached_block_hashes(engine: ReplicaController) -> list[int]:
    """Every block hash the pools can serve a hit from (for a full resync)."""
    return sorted({h for pool in engine.pools for h in pool.cached_hashes()})


def drain_cache_events(engine: ReplicaController) -> list[tuple[str, int]]:
    return [e for pool in engine.pools for e in pool.drain_events()]


class EngineLoop:
    def __init__(self, engine: ReplicaController, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = ReplicaMetrics()
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[Sink, int]] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the published fields below
        self._events: list[tuple[str, int]] = []
        self._resync: list[int] | None = None
        self._want_resync = False
        self._stats: dict[str, Any] = replica_stats(engine)
        self._metrics: dict[str, Any] = self.metrics.snapshot()
        self._submitted = 0  # requests queued but not yet seen by the engine thread
        self._stop = False
        self._last_publish = 0.0
        self._thread = threading.Thread(target=self._run, name="meridian-engine", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: Sequence[SamplingParams],
        salt: str | None,
        sink: Sink,
    ) -> list[str]:
        """Queue one request per params (choice i is tagged ``i`` on the sink).

        Raises InvalidRequestError (never queued) or OverloadedError (queue full)."""
        for p in params:
            self.engine.validate(prompt_token_ids, p)  # reads immutable sizes only
        with self._lock:
            waiting = self._stats["num_waiting"] + self._submitted
            if waiting + len(params) > self.max_waiting:
                raise OverloadedError(
                    f"the replica has {waiting} queued requests (limit {self.max_waiting})"
                )
            self._submitted += len(params)
        ids = [f"r-{uuid.uuid4().hex[:16]}" for _ in params]
        now = time.monotonic()
        for i, (rid, p) in enumerate(zip(ids, params, strict=True)):
            self._cmds.put(("add", rid, list(prompt_token_ids), p, salt, now, sink, i))
        self._wake.set()
        return ids

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._cmds.put(("abort", rid))
        self._wake.set()

    async def stream(
        self, prompt_token_ids: list[int], params: Sequence[SamplingParams], salt: str | None
    ) -> AsyncGenerator[tuple, None]:
        """Yield ("accepted", request ids) once queued, then ("delta", i, StreamDelta) items
        and one ("done", i, RequestOutput) or ("error", i, message) per choice. Closing the
        iterator early aborts what is still running. Raises (before any yield)
        InvalidRequestError or OverloadedError."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple] = asyncio.Queue()

        def sink(item: tuple) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)

        ids = self.submit(prompt_token_ids, params, salt, sink)
        remaining = len(ids)
        try:
            yield ("accepted", ids)
            while remaining:
                item = await q.get()
                if item[0] != "delta":
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(ids)

    async def generate(
        self, prompt_token_ids: list[int], params: Sequence[SamplingParams], salt: str | None
    ) -> list[RequestOutput]:
        outs: list[Any] = [None] * len(params)
        async for item in self.stream(prompt_token_ids, params, salt):
            if item[0] == "done":
                outs[item[1]] = item[2]
            elif item[0] == "error":
                raise MeridianError(str(item[2]))
        return outs

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    def metrics_snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._metrics

    def take_events(self) -> tuple[list[int] | None, list[tuple[str, int]]]:
        """(full cached set if a resync is due, else None; events since the last take)."""
        with self._lock:
            resync, events = self._resync, self._events
            self._resync, self._events = None, []
        return resync, events

    def request_resync(self) -> None:
        with self._lock:
            self._want_resync = True
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        idle_since: float | None = None
        while not self._stop:
            self._wake.clear()
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._publish(force=True)
                if idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_RELEASE_S:
                    self.engine.on_idle()  # compiled-graph workers stop spinning a core
                self._wake.wait(0.5)
                continue
            idle_since = None
            try:
                deltas = self.engine.step()
            except Exception as e:  # a bug or a dead worker: fail what runs, keep serving
                log.exception("engine step failed")
                for rid in list(self._sinks):
                    self.engine.abort(rid)
                    self._finish(rid, error=f"engine step failed: {e}; retry the request")
                self._publish(force=True)
                continue
            for d in deltas:
                entry = self._sinks.get(d.request_id)
                if entry is None:
                    continue
                entry[0](("delta", entry[1], d))
                if d.finished:
                    self._finish(d.request_id)
            self._publish()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, tokens, params, salt, arrival, sink, index = cmd
                with self._lock:
                    self._submitted -= 1
                try:
                    self.engine.add_request(tokens, params, rid, arrival_time=arrival, salt=salt)
                except InvalidRequestError as e:
                    sink(("error", index, str(e)))
                    continue
                self._sinks[rid] = (sink, index)
            elif cmd[0] == "abort" and cmd[1] in self._sinks:
                self.engine.abort(cmd[1])
                self._finish(cmd[1])

    def _finish(self, rid: str, error: str | None = None) -> None:
        sink, index = self._sinks.pop(rid)
        out = self.engine.release(rid)
        self.metrics.on_finished(out)
        sink(("error", index, error) if error else ("done", index, out))

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        events = drain_cache_events(self.engine)
        if not force and not events and now - self._last_publish < 0.05:
            return
        self._last_publish = now
        stats = replica_stats(self.engine)
        metrics = self.metrics.snapshot()
        with self._lock:
            self._stats, self._metrics = stats, metrics
            if self._want_resync or len(self._events) > MAX_BUFFERED_EVENTS:
                self._want_resync = False
                self._resync = cached_block_hashes(self.engine)  # includes ``events``
                self._events = []
            else:
                self._events.extend(events)
