"""A replica's own engine loop: one thread owns the replica's engine and steps it whenever
it has work; nobody steps it from outside.

Other threads (the actor's method calls) talk to it only through the loop:

- ``post(fn)`` / ``call(fn)`` run ``fn()`` on the loop thread between two steps (``call``
  returns a future), so the engine is never touched by two threads;
- ``emit(event)`` (loop thread) appends to the outbox, and ``take(timeout)`` (any thread)
  returns what accumulated, waiting up to ``timeout`` for something to arrive: the
  Conductor's long poll.

``pin(cpus, threads)`` binds the loop (and the torch threads it starts) to some cores, so a
prefill replica and a decode replica on one machine do not share a core.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def pin(cpus: list[int] | None, threads: int | None) -> None:
    """Bind every thread of this process to ``cpus`` and cap torch's intra-op threads."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    if cpus and hasattr(os, "sched_setaffinity"):
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass  # a thread that just ended


def split_cores(num_prefill: int, num_decode: int) -> dict[str, list[int]]:
    """Cores of this machine for each replica when they share one node: prefill replicas
    on the lower half, decode replicas on the upper half, so a prefill never takes a
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
        cpus: list[int] | None = None,
        threads: int | None = None,
    ) -> None:
        """``step()`` runs one iteration if there is work and says whether it ran one."""
        self._step = step
        self._idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._out: list[Any] = []
        self._out_cond = threading.Condition()
        self._stop = False
        self._pin = (cpus, threads)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        self._cmds.put(fn)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
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

    def take(self, timeout: float) -> list[Any]:
        """Events emitted since the last take; waits up to ``timeout`` s for the first."""
        with self._out_cond:
            if not self._out:
                self._out_cond.wait(timeout)
            out, self._out = self._out, []
        return out

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop thread --------------------------------------------------------------------
    def emit(self, *events: Any) -> None:
        """Queue ``events`` for the next ``take``, all in one report (never split)."""
        with self._out_cond:
            self._out.extend(events)
            self._out_cond.notify_all()

    def _apply(self) -> None:
        while True:
            try:
                fn = self._cmds.get_nowait()
            except queue.Empty:
                return
            fn()

    def _run(self) -> None:
        pin(*self._pin)
        try:
            while not self._stop:
                self._wake.clear()
                self._apply()
                if not self._step():
                    self._wake.wait(self._idle_wait_s)
            self._apply()
        except BaseException as e:  # a bug: the replica stops; its actor reports it dead
            log.exception("replica loop failed")
            self.error = e
            with self._out_cond:
                self._out_cond.notify_all()
