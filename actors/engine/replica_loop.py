"""A replica's own engine loop: one thread owns the replica's engine and steps it whenever it
has work; nobody steps it from outside. Colocated replicas (``actors.serving.engine_loop.
EngineLoop``, the request API over this loop) and prefill / decode replicas
(``actors.disagg``) run in it alike.

Other threads talk to the engine only through the loop:

- ``post(fn)`` / ``call(fn)`` run ``fn()`` on the loop thread between two steps (``call``
  returns a future), in the order they were posted, so the engine is never touched by two
  threads;
- ``emit(event)`` (loop thread) appends to the outbox, and ``take(timeout)`` (any thread)
  returns what accumulated, waiting up to ``timeout`` for something to arrive: the
  Conductor's long poll. The outbox has one reader at a time, its owner: ``claim(owner)``
  hands it to another (a new Conductor attached to a shared pool's replica), and from then
  on a ``take`` by any other owner raises ``Superseded`` and takes nothing, so no event
  goes to a reader that does not know its request.

Invariants: a step that raises ends the loop (``error``). Once the loop ends, ``stopping``
is true; with an ``on_exit`` (the engine's shutdown) the loop thread then runs what was
posted, ``on_exit``, and what was posted meanwhile; without one, what was posted before
a ``stop`` still runs.

Cores: ``cpu_cores`` pins the loop thread (and the threads it starts, torch's included,
which inherit the set) and no other thread of the process; ``torch_threads`` caps torch's
intra-op threads. ``disjoint_cores`` splits a node's cores among its replicas;
``split_cores`` gives prefill and decode replicas on one node cores of their own.

Priority: the loop thread runs at nice 0 whatever the process's niceness and carries its
``name`` in ``/proc`` (``thread_priority``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from actors.engine.thread_priority import (
    name_this_thread,
    run_at_normal_priority,
)

log = logging.getLogger(__name__)


class Superseded(Exception):
    """A ``take`` by a reader that no longer owns the outbox (another claimed it)."""


def pin_this_thread(cpu_cores: Sequence[int] | None, torch_threads: int | None) -> None:
    """Bind the calling thread to ``cpu_cores`` (Linux) and cap torch's intra-op threads."""
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    if cpu_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpu_cores))  # 0: the calling thread


def disjoint_cores(count: int, cores: Collection[int] | None = None) -> list[list[int]]:
    """``cores`` (default: the ones this process may run on) as ``count`` disjoint runs of
    consecutive ids, sizes differing by at most one (the first runs take the remainder).
    Empty when there are fewer cores than ``count`` or no affinity API (not Linux)."""
    if cores is None:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    ids = sorted(cores)
    if count < 1 or len(ids) < count:
        return []
    size, extra = divmod(len(ids), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(ids[start:end])
        start = end
    return out


def split_cores(num_prefill: int, num_decode: int) -> dict[str, list[int]]:
    """Cores of this machine for each replica when they share one node: prefill replicas
    share the lower half, decode replicas the upper half, so a prefill never takes a
    decode's core. Empty when the machine has one core."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return {}
    half = len(cores) // 2
    pre, dec = cores[:half], cores[half:]
    out = {f"p{i}": pre for i in range(num_prefill)}
    out.update({f"d{j}": dec for j in range(num_decode)})
    return out


class ReplicaLoop:
    def __init__(
        self,
        step: Callable[[], bool],
        name: str,
        idle_wait_s: float = 0.5,
        cpu_cores: Sequence[int] | None = None,
        torch_threads: int | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """``step()`` runs one iteration if there is work and says whether it ran one;
        without work the loop sleeps up to ``idle_wait_s`` or until something is posted.
        ``on_exit()`` runs on the loop thread once the loop ends (stopped or failed)."""
        self._step = step
        self._idle_wait_s = idle_wait_s
        self._on_exit = on_exit
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._out: list[Any] = []
        self._waking = False  # the outbox holds an ``emit``ted event (not only notes)
        self._out_cond = threading.Condition()
        self._owner: str | None = None  # who may take from the outbox (``claim``)
        self._stop = False
        self._pin = (list(cpu_cores) if cpu_cores else None, torch_threads)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        self._cmds.put(fn)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on the loop thread; its result or exception lands on the future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

        if not self._thread.is_alive():
            fut.set_exception(RuntimeError(f"the replica loop is not running: {self.error}"))
            return fut
        self.post(run)
        return fut

    def wake(self) -> None:
        """End an idle wait now (the next pass runs at once)."""
        self._wake.set()

    def take(self, timeout: float, owner: str | None = None) -> list[Any]:
        """Events emitted or noted since the last take, in order; waits up to ``timeout`` s
        for an emitted one (notes alone do not end the wait). Raises ``Superseded`` (taking
        nothing) when ``owner`` does not own the outbox, also when another claimed it during
        the wait."""
        with self._out_cond:
            if not self._waking and owner == self._owner:
                self._out_cond.wait(timeout)
            if owner != self._owner:
                raise Superseded(f"the events are {self._owner!r}'s, not {owner!r}'s")
            out, self._out, self._waking = self._out, [], False
        return out

    def claim(self, owner: str | None) -> None:
        """``owner`` alone takes events from now on; what the last owner left is dropped."""
        with self._out_cond:
            self._owner, self._out, self._waking = owner, [], False
            self._out_cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop and wait for its thread (``on_exit`` included). Idempotent."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    @property
    def stopping(self) -> bool:
        """``stop`` was called or the loop ended."""
        return self._stop

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop thread --------------------------------------------------------------------
    def emit(self, *events: Any) -> None:
        """Queue ``events`` for the next ``take``, all in one report (never split), and end
        a waiting ``take`` now."""
        with self._out_cond:
            self._out.extend(events)
            self._waking = True
            self._out_cond.notify_all()

    def note(self, *events: Any) -> None:
        """Queue measurements (step times, token gaps) for the next ``take`` without ending
        its wait: they go with the next emitted event, or when the take's timeout ends it.
        A decode replica whose tokens go straight to their ingress emits nothing most steps,
        so its poller makes no call per step."""
        with self._out_cond:
            self._out.extend(events)

    def run_posted(self) -> None:
        """Run what was posted, in order (loop thread only)."""
        while True:
            try:
                fn = self._cmds.get_nowait()
            except queue.Empty:
                return
            fn()

    def _run(self) -> None:
        try:
            name_this_thread(self._thread.name)
            run_at_normal_priority()
            pin_this_thread(*self._pin)
            while not self._stop:
                self._wake.clear()
                self.run_posted()
                if not self._step():
                    self._wake.wait(self._idle_wait_s)
            self.run_posted()
        except BaseException as e:  # a bug: the replica stops; its owner reports it dead
            log.exception("%s failed", self._thread.name)
            self.error = e
            with self._out_cond:
                self._out_cond.notify_all()
        self._stop = True
        if self._on_exit is not None:
            self.run_posted()
            self._on_exit()
            self.run_posted()
