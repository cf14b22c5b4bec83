"""A serving engine driven by its own thread, with an asyncio-facing request API.

An engine (``ServingEngine``: a ``ReplicaController`` as ``ColocatedEngine``
(``actors.serving.colocated_engine``), or a
``PDCluster`` as ``actors.disagg.engine.PDEngine``) blocks for a whole iteration in ``step()``
and is not thread-safe, so it never runs on an event loop: the engine thread of a
``ReplicaLoop`` (``actors.engine.replica_loop``, the loop every replica runs in) owns it
(every call into it but ``validate``, which reads immutable sizes, happens on that thread,
placement and ``shutdown`` included), and other threads talk to it through the loop's
command queue. A prompt is
submitted as its one record (``OpenPrompt``, ``open_prompt.py``); results flow back
through its outlet: after each engine step (or posted command), every outlet that has
events gets them in one batch, so a step costs one hand-off per outlet (an ingress's event
channel), not one per request.

Invariants:
- A submitted prompt is answered first with exactly one ``Accepted`` or ``Refused``
  (``actors.engine.events``), decided on the engine thread (``add_request`` of every choice
  succeeded, or none of them is left in the engine). An engine may defer the
  verdict (a P/D engine whose request waits for decode room: ``waiting``), then a later
  step gives it (``refusal``: the 429 of one that waited past its bound). An accepted
  request then
  ends with exactly one ``Done`` or ``Failed`` per choice, and is released from the engine
  (its blocks freed) when it does.
- Requests arrive built (``RequestBuilder`` at the edge): the loop never validates or
  hashes them again.
- ``take_events`` returns the engine's stored/evicted block events in the order they
  happened, each exactly once; after a resync, the returned full set plus later events is
  the exact cached set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

from actors.engine.direct_return import ReturnRoute
from actors.engine.events import Accepted, Delta, Done, Event, Failed, Refused, Verdict
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_loop import ReplicaLoop
from actors.engine.request_limits import RequestLimits
from actors.serving.loop_mailbox import LoopMailbox, mailbox_of
from actors.serving.metrics import MetricsSnapshot, ReplicaMetrics
from actors.serving.open_prompt import Entry, OpenPrompt, Outlet
from errors import (
    EngineUnavailableError,
    InvalidRequestError,
    MeridianError,
    OverloadedError,
)
from policies.replica_stats import ReplicaStats
from policies.request import Request

log = logging.getLogger(__name__)

MAX_BUFFERED_EVENTS = 1 << 20  # beyond this, drop the deltas and resync the whole set
IDLE_RELEASE_S = 2.0  # idle this long: let the workers stop polling
WORKER_CHECK_S = 1.0  # an idle engine checks its workers this often (``check_workers``)


class ServingEngine(Protocol):
    """What ``EngineLoop`` drives. ``limits`` and ``block_size`` are immutable (any
    thread); everything else is called on the engine thread."""

    block_size: int

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit (an edge ``RequestBuilder`` checks it)."""
        ...

    def add_request(self, request: Request) -> str:
        """Queue a built request; raises InvalidRequestError or OverloadedError (not queued)."""
        ...

    def step(self) -> list[StreamDelta]: ...
    def abort(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> RequestOutput: ...
    def has_unfinished(self) -> bool: ...
    def on_idle(self) -> None: ...
    def shutdown(self) -> None: ...

    def serving_stats(self) -> ReplicaStats:
        """The replica's counters, stamped with the wall clock."""
        ...

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the engine can serve a hit from (for a full resync)."""
        ...

    def drain_cache_events(self) -> list[tuple[str, int]]:
        """("stored" | "evicted", hash) events since the last drain, in order."""
        ...

    def check_blocks(self) -> dict[str, int]:
        """Blocks in use per KV rank after the integrity check (all 0 when idle)."""
        ...


class EngineLoop:
    def __init__(
        self,
        engine: ServingEngine,
        max_waiting: int = 256,
        cpu_cores: Sequence[int] | None = None,
        torch_threads: int | None = None,
        replica_id: str = "",
    ) -> None:
        """``cpu_cores``: the engine thread runs only on these cores (``EngineConfig``, or
        the Serve app's default, ``core_plan``); ``torch_threads``: torch's intra-op
        threads (None: as the process has them); ``replica_id``: the id each ``Accepted``
        names (the Serve replica's, which the ingress reports to the router)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self._accepted = Accepted(replica_id)  # every verdict that accepts: immutable
        # a disaggregated engine (PDEngine) also reports its transfer and store counters
        self.metrics = ReplicaMetrics(getattr(engine, "pd_counters", None), min_interval_s=0.2)
        # and the gaps between tokens its decode replicas measured (``last_token_gaps``)
        self._last_token_gaps = getattr(engine, "last_token_gaps", None)
        # engine thread only: each running choice's prompt and index
        self._open: dict[str, tuple[OpenPrompt, int]] = {}
        # what the outlets get at the end of this pass (engine thread only)
        self._batches: dict[int, tuple[Outlet, dict[str, list[Event | None]]]] = {}
        # prompts added whose verdict the engine deferred (engine thread only); an engine
        # that defers provides ``waiting(id) -> bool`` and ``refusal(id) -> error | None``
        self._pending: list[OpenPrompt] = []
        self._early: dict[str, list[StreamDelta]] = {}  # their deltas, until the verdict
        self._lock = threading.Lock()  # guards the published fields below
        self._events: list[tuple[str, int]] = []
        self._resync: list[int] | None = None
        self._want_resync = False
        self._stats: ReplicaStats = engine.serving_stats()
        self._metrics: MetricsSnapshot = self.metrics.snapshot()
        self._submitted = 0  # requests queued but not yet seen by the engine thread
        self._held = 0  # requests the engine thread holds (published with the stats)
        self._last_publish = 0.0
        self._idle_since: float | None = None  # engine thread only
        self._workers_checked = 0.0  # engine thread only: monotonic time of the last check
        # engine thread only: ``when_drained`` calls waiting for the engine to drain, the
        # submissions held until they ran (or, asleep, until the wake), and whether it sleeps
        self._exclusive: list[tuple[Callable[[Any], Any], concurrent.futures.Future, Any]] = []
        self._held_back: list[OpenPrompt] = []
        self._asleep = False
        self._loop = ReplicaLoop(
            self._iterate,
            "meridian-engine",
            cpu_cores=cpu_cores,
            torch_threads=torch_threads,
            on_exit=self._stopped,
        )

    # -- any thread -----------------------------------------------------------------------
    def submit(self, prompt: OpenPrompt) -> None:
        """Queue the choices of one prompt; the engine thread answers it ``Accepted`` or
        ``Refused`` first, then its events go to its outlet.

        Raises OverloadedError (the queue is full; nothing queued), EngineUnavailableError
        (the engine thread has stopped)."""
        if not self._loop.is_alive():
            raise EngineUnavailableError("the engine thread is not running; retry the request")
        with self._lock:
            waiting = self._stats.num_waiting + self._submitted
            if waiting + len(prompt.requests) > self.max_waiting:
                raise OverloadedError(
                    f"the replica has {waiting} queued requests (limit {self.max_waiting})"
                )
            self._submitted += len(prompt.requests)
        self._loop.post(lambda: self._add(prompt))

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._loop.post(functools.partial(self._abort_if_held, rid))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception
        lands on the returned future."""
        if not self._loop.is_alive():
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_exception(EngineUnavailableError("the engine thread is not running"))
            return fut
        return self._loop.call(lambda: fn(self.engine))

    def when_drained(
        self, fn: Callable[[Any], Any], *, abort_in_flight: bool = False, sleep: bool | None = None
    ) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread once it holds no request (a weight update,
        sleep, wake). Requests submitted from now on are held, not refused, and run after
        it (or, while asleep, after the wake). ``abort_in_flight``: end what runs now with
        a retriable failure instead of letting it finish. ``sleep``: the engine sleeps
        (True) or wakes (False) after ``fn``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._loop.is_alive():
            fut.set_exception(EngineUnavailableError("the engine thread is not running"))
            return fut

        def queue() -> None:
            self._exclusive.append((fn, fut, sleep))
            if abort_in_flight:
                self._fail_all("the weights were updated while it ran; retry the request")

        self._loop.post(queue)
        return fut

    async def stream(self, requests: Sequence[Request]) -> AsyncGenerator[Accepted | Event, None]:
        """Yield ``Accepted`` once the engine took every choice, then ``Delta`` events and
        one ``Done`` or ``Failed`` per choice. Closing the iterator early aborts what is
        still running. Raises (before any yield) the refusal: InvalidRequestError,
        OverloadedError or EngineUnavailableError."""
        q: asyncio.Queue[Verdict | list[Entry]] = asyncio.Queue()
        box = mailbox_of(asyncio.get_running_loop())  # one loop wake-up per burst
        outlet = _QueueOutlet(box, q)
        prompt = OpenPrompt(list(requests), outlet, lambda v: box.post(q.put_nowait, v))
        self.submit(prompt)
        ended = False
        try:
            verdict = await q.get()
            if isinstance(verdict, Refused):
                ended = True  # the engine holds none of them
                raise verdict.error()
            assert isinstance(verdict, Accepted)
            yield verdict
            while not ended:
                batch = await q.get()
                assert isinstance(batch, list)  # one verdict, the first item
                for _, events in batch:  # this prompt's only
                    for item in events:
                        if item is None:
                            ended = True
                        else:
                            yield item
        finally:
            if not ended:
                prompt.dropped = True
                self.abort(prompt.ids)

    async def generate(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """The final output of every choice; a failed choice raises EngineUnavailableError
        (retriable) or MeridianError."""
        outs: list[Any] = [None] * len(requests)
        async for item in self.stream(requests):
            if isinstance(item, Done):
                outs[item.index] = item.output
            elif isinstance(item, Failed):
                raise (EngineUnavailableError if item.retriable else MeridianError)(item.message)
        return outs

    def stats(self) -> ReplicaStats:
        with self._lock:
            return self._stats

    def metrics_snapshot(self) -> MetricsSnapshot:
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
        self._loop.wake()

    def is_alive(self) -> bool:
        return self._loop.is_alive()

    def drain(self, timeout: float) -> bool:
        """Wait (blocking) until the engine holds no request and none is queued for it, at
        most ``timeout`` seconds; True when it drained. New requests are still taken: the
        caller stops sending them first (Serve stops routing to a replica it removes)."""
        deadline = time.monotonic() + timeout
        while self._loop.is_alive():
            with self._lock:
                if self._held == 0 and self._submitted == 0:
                    return True
            if time.monotonic() >= deadline:
                return False
            self._loop.wake()  # an idle engine thread publishes at once
            time.sleep(0.02)
        return True  # a dead engine thread holds nothing any more

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; it fails what still runs and shuts the engine down.
        Idempotent."""
        self._loop.stop(timeout)

    # -- the engine thread ----------------------------------------------------------------
    def _iterate(self) -> bool:
        """One pass of the loop: a step if the engine has work (True), else publish and
        let idle workers stop polling (False: the loop waits); then each outlet gets the
        pass's events (and those of the commands run before it) in one batch. An exception
        outside the step is a bug: the loop ends and ``_stopped`` fails what runs."""
        try:
            return self._pass()
        finally:
            self._send_batches()

    def _pass(self) -> bool:
        if self._exclusive and not self.engine.has_unfinished() and not self._pending:
            self._run_exclusive()
        if not self.engine.has_unfinished():
            self._publish(force=True)
            if self._idle_since is None:
                self._idle_since = time.monotonic()
            elif time.monotonic() - self._idle_since > IDLE_RELEASE_S:
                self.engine.on_idle()  # compiled-graph workers stop spinning a core
                self._check_workers()
            return False
        self._idle_since = None
        try:
            deltas = self.engine.step()
            self.metrics.on_deltas(deltas, time.monotonic())
            if self._last_token_gaps is not None:
                self.metrics.on_gaps(self._last_token_gaps())
        except Exception as e:  # a bug or a dead worker: fail what runs, keep serving
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {e}; retry the request")
            self._publish(force=True)
            return True
        for d in deltas:
            if d.request_id in self._early:  # a placed choice of a request still pending
                self._early[d.request_id].append(d)
            else:
                self._deliver(d)
        if self._pending:
            self._answer_pending()
        self._publish()
        return True

    def _check_workers(self) -> None:
        """Idle: every ``WORKER_CHECK_S``, an engine with worker actors restarts a group that
        lost one (``ReplicaController.check_workers``; engines without it are skipped)."""
        check = getattr(self.engine, "check_workers", None)
        now = time.monotonic()
        if check is None or now - self._workers_checked < WORKER_CHECK_S:
            return
        self._workers_checked = now
        if check():
            log.warning("an idle engine lost a worker: its worker group was restarted")

    def _emit(self, prompt: OpenPrompt, item: Event) -> None:
        """Queue ``item`` for the prompt's outlet; after its last choice's end, the end. A
        direct prompt's ``Delta``s and ``Done``s went to its ingress from where they were
        made: only its ``Failed``s go on the outlet, and no end."""
        if not isinstance(item, Delta):  # Done or Failed: one choice ended
            prompt.remaining -= 1
            prompt.ended = prompt.remaining == 0
        if prompt.dropped or (prompt.direct and not isinstance(item, Failed)):
            return
        entry = self._batches.get(id(prompt.outlet))
        if entry is None:
            entry = self._batches[id(prompt.outlet)] = (prompt.outlet, {})
        events = entry[1].get(prompt.key)
        if events is None:
            events = entry[1][prompt.key] = []
        events.append(item)
        if prompt.ended and not prompt.direct:
            events.append(None)

    def _send_batches(self) -> None:
        batches, self._batches = self._batches, {}
        for outlet, by_prompt in batches.values():
            try:
                outlet.send(list(by_prompt.items()))
            except Exception:  # a bug in one outlet: its prompts' callers time out
                log.exception("an outlet failed to take its batch")

    def _deliver(self, d: StreamDelta) -> None:
        entry = self._open.get(d.request_id)
        if entry is None:
            return
        self._emit(entry[0], Delta(entry[1], d))
        if d.finished:
            # The loop's own aborts never come back as deltas: an aborted one here
            # was lost by the engine (a replica died), so it is a retriable error.
            lost = d.finish_reason == "abort"
            error = "the request was lost; retry it" if lost else None
            try:
                self._finish(d.request_id, error)
            except Exception as e:  # a bug: fail this request, never the thread
                log.exception("could not finish %s", d.request_id)
                self._abort(d.request_id, f"the request failed: {e}; retry it")

    def _stopped(self) -> None:
        """The loop ended (``stopping``: from now on ``_add`` refuses; the loop runs what
        was submitted before and after this): fail what runs, shut the engine down."""
        self._fail_all("the replica is shutting down; retry the request")
        held, self._held_back = self._held_back, []
        for prompt in held:
            self._add(prompt)  # stopping: refused, retriable
        for _, fut, _ in self._exclusive:
            fut.set_exception(EngineUnavailableError("the replica is shutting down"))
        self._exclusive = []
        self._send_batches()
        try:
            self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    def _abort_if_held(self, rid: str) -> None:
        if rid in self._open:
            self._abort(rid)
            return
        for prompt in self._held_back:  # its caller left while it was held
            if rid in prompt.ids:
                self._held_back.remove(prompt)
                with self._lock:
                    self._submitted -= len(prompt.requests)
                return
        for prompt in self._pending:  # its caller left before the verdict: take it back
            if rid in prompt.ids:
                self._pending.remove(prompt)
                self._take_back(prompt.ids)
                return

    def _run_exclusive(self) -> None:
        """Run the queued ``when_drained`` calls, then the requests held for them."""
        while self._exclusive:
            fn, fut, sleep = self._exclusive.pop(0)
            try:
                fut.set_result(fn(self.engine))
                if sleep is not None:
                    self._asleep = sleep
            except Exception as e:  # the caller hears it; the engine keeps serving
                fut.set_exception(e)
        if not self._asleep:
            held, self._held_back = self._held_back, []
            for prompt in held:
                self._add(prompt)

    def _add(self, prompt: OpenPrompt) -> None:
        """Every choice is added, or none is left in the engine and the prompt is refused.
        While a ``when_drained`` call waits, or the engine sleeps, it is held until then."""
        if (self._exclusive or self._asleep) and not self._loop.stopping:
            self._held_back.append(prompt)
            return
        requests = prompt.requests
        with self._lock:
            self._submitted -= len(requests)
            self._held += len(requests)  # until the next publish counts the open choices
        added: list[str] = []
        refusal: MeridianError | None = None
        if self._loop.stopping:
            refusal = EngineUnavailableError("the replica is shutting down; retry the request")
        routed = getattr(self.engine, "add_routed", None) if prompt.reply else None
        prompt.direct = routed is not None
        for i, request in enumerate(requests):
            if refusal is not None:
                break
            try:
                if routed is not None:
                    assert prompt.reply is not None
                    route = ReturnRoute(prompt.reply, prompt.key, i, request.request_id)
                    added.append(routed(request, route))
                else:
                    added.append(self.engine.add_request(request))
            except (InvalidRequestError, OverloadedError) as e:
                refusal = e
            except Exception as e:  # a dead actor or a bug: the request was not taken
                log.exception("add_request failed")
                refusal = EngineUnavailableError(f"the replica failed to take it: {e}; retry")
        if refusal is None:
            decided, refusal = self._verdict(added)
            if not decided:
                self._pending.append(prompt)  # a later step answers it
                self._early.update((rid, []) for rid in added)
                return
        self._answer(prompt, refusal, added)

    def _verdict(self, ids: list[str]) -> tuple[bool, MeridianError | None]:
        """(decided, the refusal if refused) for the added choices ``ids``."""
        waiting = getattr(self.engine, "waiting", None)
        refusal_of = getattr(self.engine, "refusal", None)
        if waiting is None or refusal_of is None:
            return True, None
        for rid in ids:
            refusal = refusal_of(rid)
            if refusal is not None:
                return True, refusal
        return not any(waiting(rid) for rid in ids), None

    def _answer_pending(self) -> None:
        for prompt in list(self._pending):
            decided, refusal = self._verdict(prompt.ids)
            if decided:
                self._pending.remove(prompt)
                self._answer(prompt, refusal)

    def _answer(
        self, prompt: OpenPrompt, refusal: MeridianError | None, added: list[str] | None = None
    ) -> None:
        """Accept every choice, or take back those ``added`` (default: all) and refuse."""
        ids = prompt.ids
        if refusal is not None:
            self._take_back(ids if added is None else added)
            self.metrics.on_refused(refusal)
            prompt.ended = True
            prompt.answer(Refused.of(refusal))
            return
        for i, rid in enumerate(ids):
            self._open[rid] = (prompt, i)
        prompt.remaining = len(ids)
        prompt.answer(self._accepted)
        for rid in ids:
            for d in self._early.pop(rid, ()):
                self._deliver(d)

    def _take_back(self, ids: list[str]) -> None:
        for rid in ids:
            self._early.pop(rid, None)
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:
                log.exception("could not take back %s", rid)

    def _finish(self, rid: str, error: str | None = None) -> None:
        out = self.engine.release(rid)  # first: if it raises, the choice is still open
        prompt, index = self._open.pop(rid)
        self.metrics.on_finished(out)
        self._emit(prompt, Failed(index, error) if error else Done(index, out))

    def _abort(self, rid: str, error: str | None = None) -> None:
        """Abort and release one request; its prompt hears the end even if the engine fails."""
        try:
            self.engine.abort(rid)
            self._finish(rid, error)
        except Exception:
            log.exception("could not abort %s", rid)
            entry = self._open.pop(rid, None)
            if entry is not None:
                failed = Failed(entry[1], error or "the request could not be aborted")
                self._emit(entry[0], failed)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._open):
            self._abort(rid, message)
        pending, self._pending = self._pending, []
        for prompt in pending:
            self._answer(prompt, EngineUnavailableError(message))

    def _publish(self, force: bool = False) -> None:
        self._send_batches()  # first: a drained count never precedes its requests' ends
        now = time.monotonic()
        events = self.engine.drain_cache_events()
        if not force and not events and now - self._last_publish < 0.05:
            return
        self._last_publish = now
        stats = self.engine.serving_stats()
        metrics = self.metrics.snapshot()
        with self._lock:
            self._stats, self._metrics = stats, metrics
            self._held = len(self._open) + sum(len(p.requests) for p in self._pending)
            if self._want_resync or len(self._events) > MAX_BUFFERED_EVENTS:
                self._want_resync = False
                self._resync = self.engine.cached_block_hashes()  # includes ``events``
                self._events = []
            else:
                self._events.extend(events)


class _QueueOutlet:
    """``EngineLoop.stream``'s outlet: each batch onto one asyncio queue, through the
    event loop's mailbox (one wake-up per burst)."""

    def __init__(self, box: LoopMailbox, q: asyncio.Queue[Any]) -> None:
        self.box = box
        self.q = q

    def send(self, batch: list[Entry]) -> None:
        self.box.post(self.q.put_nowait, batch)
