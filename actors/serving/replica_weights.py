"""A Serve replica's side of the app's weight updates (the log: ``weight_updates.py``, held
by the router deployment).

    follower = WeightFollower(loop, router, replica_id)  # right after the EngineLoop starts

- Catch-up: the first thing queued on the engine loop (``EngineLoop.when_drained``, so every
  request waits behind it) loads every update the log holds, in order. A replica that
  Serve starts later (autoscaling, or a replacement after a crash) therefore serves its
  first request on the app's current weights.
- Then a thread long-polls the router for a newer version; for each update it lacks it
  has the engine load it once the requests running now finish (or aborts them, retriable,
  when the update asks), holding new requests meanwhile, and tells the router which
  version it has loaded (or why it failed). The same poll carries the app's sleep state:
  the replica sleeps or wakes once its running requests finish (``_follow_sleep``); one
  that starts while the app sleeps follows it to sleep after its catch-up.

- A router call that fails (the router's process died and Serve is starting another) is
  asked again, with backoff, until the router answers (``_ask``); it is never reported as a
  failed load. The router is told an error only when loading an update itself failed.

Invariant: ``version`` is the weight version the engine runs (set on the engine thread
after each load), and updates are loaded one at a time in the log's order.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from actors.serving.engine_loop import EngineLoop
from actors.serving.weight_updates import POLL_S, WeightUpdate

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 120.0  # any other router call
BACKOFF_S = (0.25, 5.0)  # a router call that failed is asked again after this, doubling


class _Stopped(Exception):
    """The follower was stopped while it waited for the router."""


class WeightFollower:
    def __init__(self, loop: EngineLoop, router: Any, replica_id: str) -> None:
        self.loop = loop
        self.router = router
        self.replica_id = replica_id
        self.version = 0
        self.sleep_changes = 0  # the app's sleeps and wakes this replica has followed
        self._stop = threading.Event()
        # the log so far, fetched by the follower thread: a Serve handle call made on the
        # engine thread would start Ray's threads there, and they would inherit its name
        self._log: concurrent.futures.Future = concurrent.futures.Future()
        self.caught_up: concurrent.futures.Future = loop.when_drained(self._catch_up)
        self._thread = threading.Thread(target=self._follow, daemon=True, name="meridian-weights")
        self._thread.start()

    def failed(self) -> str | None:
        """Why the catch-up failed (the replica must not serve: ``check_health``)."""
        fut = self.caught_up
        if fut.done() and fut.exception() is not None:
            return f"loading the app's weight updates failed: {fut.exception()}"
        return None

    def stop(self) -> None:
        self._stop.set()

    def _catch_up(self, engine: Any) -> None:
        """On the engine thread, before any request: every update of the log."""
        for update in self._log.result(timeout=2 * CALL_TIMEOUT_S):
            self._load(update, engine)

    def _load(self, update: WeightUpdate, engine: Any) -> None:
        engine.update_weights(update.ref, update.version)  # colocated or P/D: same call
        self.version = update.version

    def _follow(self) -> None:
        try:
            self._follow_router()
        except _Stopped:
            pass

    def _follow_router(self) -> None:
        try:
            self._log.set_result(self._ask(lambda: self.router.weight_updates.remote(0)))
        except _Stopped:
            self._log.set_exception(RuntimeError("the replica stopped before its catch-up"))
            raise
        try:
            self.caught_up.result()
        except Exception:
            log.exception("replica %s could not load the app's weight updates", self.replica_id)
            return
        self._tell_router(None)
        while not self._stop.is_set():
            latest, changes, level = self._ask(
                lambda: self.router.next_app_state.remote(self.version, self.sleep_changes, POLL_S),
                POLL_S + CALL_TIMEOUT_S,
            )
            if latest > self.version:
                updates = self._ask(lambda: self.router.weight_updates.remote(self.version))
                error = self._load_all(updates)
                self._tell_router(error)
                if error is not None:  # loaded again on the next poll
                    self._stop.wait(1.0)
                    continue
            if changes > self.sleep_changes:
                self._follow_sleep(changes, level)

    def _load_all(self, updates: list[WeightUpdate]) -> str | None:
        """Load ``updates`` in order, each once the engine drained; why one failed, or None."""
        try:
            for update in updates:
                load = functools.partial(self._load, update)
                self.loop.when_drained(load, abort_in_flight=update.abort_in_flight).result()
        except Exception as e:
            log.warning("weight update on replica %s failed", self.replica_id, exc_info=True)
            return f"{type(e).__name__}: {e}"
        return None

    def _ask(self, call: Callable[[], Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """The answer of the router call ``call`` makes, asked again with backoff while the
        router cannot answer (Serve restarting it). Raises _Stopped once stopped."""
        wait = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                return call().result(timeout_s=timeout_s)
            except Exception as e:
                log.warning(
                    "replica %s: the router did not answer (%s: %s); asking again in %.2g s",
                    self.replica_id,
                    type(e).__name__,
                    e,
                    wait,
                )
                self._stop.wait(wait)
                wait = min(2 * wait, BACKOFF_S[1])
        raise _Stopped

    def _follow_sleep(self, changes: int, level: int | None) -> None:
        """Sleep at ``level`` (None: wake) once the running requests finish (requests
        arriving meanwhile wait for the wake), then tell the router (an error too: this
        change is not retried; the next one is followed)."""
        freed, error = 0, None
        try:
            if level is None:
                self.loop.when_drained(lambda engine: engine.wake_up(), sleep=False).result()
            else:
                drained = self.loop.when_drained(lambda engine: engine.sleep(level), sleep=True)
                freed = int(drained.result())
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self.sleep_changes = changes
        self._ask(lambda: self.router.slept.remote(self.replica_id, changes, freed, error))

    def _tell_router(self, error: str | None) -> None:
        """The version loaded now and, when loading failed, why (asked until it arrives)."""
        version = self.version
        self._ask(lambda: self.router.weights_loaded.remote(self.replica_id, version, error))
