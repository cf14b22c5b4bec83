"""The Serve app's weight updates, held by the router deployment (``router.py``).

One owner for the whole app: the ingress replicas (however many) and every replica of
every group ask it, so all of them agree on the order and number of updates.

- ``WeightUpdateLog.update`` reads and checks an update (``models.weight_update``: a bad
  tensor is refused, naming it, before anything changes), puts it in Ray's object store
  once as ``SharedWeights`` (``ray.put`` by the router, so the data outlives the caller),
  appends it as the next version, wakes every watcher, and returns once every live replica
  has loaded it.
- Replicas (``replica_weights.py``) long-poll ``next_version``, fetch the updates they lack
  with ``since`` and say ``loaded``. A replica that starts later loads every update of the
  log before it serves (its first request waits for that).
- Each ingress long-polls ``next_version`` too and hashes new requests at that version, so
  the router's prefix view (block hashes the replicas report at their version) matches.

- Sleep (``set_sleep``): the app's sleep level (None: awake) and a count of its changes;
  replicas follow it on the same long poll (``next_state``), sleep or wake once their
  running requests finish (requests meanwhile wait for the wake), and say ``slept``. A
  replica that starts while the app sleeps follows it to sleep. No update while asleep.

Invariants: update ``i`` (1-based) is weight version ``i`` on every replica; updates are
applied one at a time, in order (``_lock``); the log only grows, and its object refs are
owned by the router's process. If the router's process dies the log is lost with it
(replicas keep their weights; docs/serving.md says so).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from errors import EngineUnavailableError, InvalidRequestError, MeridianError

log = logging.getLogger(__name__)
POLL_S = 10.0  # one long poll of the version (short: the router's drain waits on it)
LOAD_TIMEOUT_S = 600.0  # every live replica loads an update within this, or the call fails


@dataclass(frozen=True)
class WeightUpdate:
    """One update of the log: weight version ``version`` is ``ref`` (a ``SharedWeights`` in
    the object store, owned by the router) applied over version ``version - 1``."""

    version: int
    ref: Any
    abort_in_flight: bool


class WeightUpdateLog:
    """``model_dir``: the app's model (None: the built-in tiny one), whose tensor names and
    shapes an update must fit. ``live_replicas``: the replica ids the router routes to now
    (they must load an update before it is done)."""

    def __init__(self, model_dir: str | None, live_replicas: Callable[[], set[str]]) -> None:
        self.model_dir = model_dir
        self.live_replicas = live_replicas
        self.updates: list[WeightUpdate] = []
        self.loaded: dict[str, int] = {}  # replica id -> the version it has loaded
        self.failed: dict[str, str] = {}  # replica id -> why its last load failed
        self._changed = asyncio.Condition()  # a new version or sleep state, a load, a failure
        self._lock = asyncio.Lock()  # one update (or sleep change) at a time
        self.sleep_level: int | None = None  # the app's sleep level; None: awake
        self.sleep_changes = 0  # sleeps and wakes so far
        self.slept: dict[str, tuple[int, int]] = {}  # replica -> (changes followed, freed)
        self.sleep_failed: dict[str, tuple[int, str]] = {}  # replica -> (change, why it failed)

    @property
    def version(self) -> int:
        return len(self.updates)

    async def update(self, source: Any, abort_in_flight: bool) -> int:
        """Append ``source`` (``read_weights``' sources; a Ray object ref comes wrapped in a
        one-item list so it reaches here as a ref) as the next version once checked, and
        wait until every live replica loaded it. Returns the new version. Raises
        InvalidRequestError (nothing changed), EngineUnavailableError (a replica failed to
        load it, or did not within ``LOAD_TIMEOUT_S``; the update stays in the log)."""
        async with self._lock:
            if self.sleep_level is not None:
                raise InvalidRequestError("the app is asleep; call wake_up() before an update")
            ref = await asyncio.to_thread(self._checked_ref, source)
            version = self.version + 1
            async with self._changed:
                self.updates.append(WeightUpdate(version, ref, abort_in_flight))
                self._changed.notify_all()
            await self._wait_loaded(version)
            return version

    def _checked_ref(self, source: Any) -> Any:
        """The checked tensors of ``source`` in the object store (off the event loop: a
        checkpoint read takes seconds and routing goes on meanwhile)."""
        import ray

        from models import tiny_model_dir
        from models.loader import expected_tensors
        from models.weight_update import SharedWeights, checked_weights

        if isinstance(source, list) and len(source) == 1:
            source = source[0]
        model = Path(self.model_dir) if self.model_dir else tiny_model_dir("dense")
        tensors = checked_weights(expected_tensors(model), source)
        return ray.put(SharedWeights.of(tensors))

    async def _wait_loaded(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOAD_TIMEOUT_S
        async with self._changed:
            while True:
                live = self.live_replicas()
                failed = {r: why for r, why in self.failed.items() if r in live}
                if failed:
                    raise EngineUnavailableError(
                        f"weight version {version}: replicas failed to load it: {failed}"
                    )
                behind = sorted(r for r in live if self.loaded.get(r, 0) < version)
                if not behind:
                    return
                left = deadline - loop.time()
                if left <= 0:
                    raise EngineUnavailableError(
                        f"weight version {version}: replicas {behind} did not load it within "
                        f"{LOAD_TIMEOUT_S:g} s (it stays in the log; they load it when free)"
                    )
                # woken by a load; at least once a second, as replicas leave or expire
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:
                    pass

    async def next_version(self, after: int, timeout_s: float) -> int:
        """The log's version as soon as it is above ``after``, or after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.version > after), timeout_s
                )
            except TimeoutError:
                pass
            return self.version

    async def set_sleep(self, level: int | None) -> int:
        """Put every replica to sleep at ``level`` (1: KV cache, 2: and weights) or wake
        them (None), once each finishes what it runs; returns the bytes freed by all (0 for
        a wake) once every live replica followed. EngineUnavailableError names the
        replicas that failed (a P/D group sleeps at level 2 only) or did not follow in
        ``LOAD_TIMEOUT_S``; the app's state stays as set, replicas retry on their next
        change."""
        if level not in (1, 2, None):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", "level")
        async with self._lock:
            async with self._changed:
                self.sleep_level = level
                self.sleep_changes += 1
                changes = self.sleep_changes
                self._changed.notify_all()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LOAD_TIMEOUT_S
            async with self._changed:
                while True:
                    live = self.live_replicas()
                    failed = {
                        r: why
                        for r, (change, why) in self.sleep_failed.items()
                        if r in live and change == changes
                    }
                    if failed:
                        raise EngineUnavailableError(f"replicas could not follow: {failed}")
                    behind = sorted(r for r in live if self.slept.get(r, (0, 0))[0] < changes)
                    if not behind:
                        return sum(self.slept[r][1] for r in live)
                    left = deadline - loop.time()
                    if left <= 0:
                        raise EngineUnavailableError(
                            f"replicas {behind} did not follow within {LOAD_TIMEOUT_S:g} s"
                        )
                    try:
                        await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                    except TimeoutError:
                        pass

    async def next_state(
        self, version: int, changes: int, timeout_s: float
    ) -> tuple[int, int, int | None]:
        """``(version, sleep changes, sleep level)`` as soon as either count is above the
        caller's, or after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: self.version > version or self.sleep_changes > changes
                    ),
                    timeout_s,
                )
            except TimeoutError:
                pass
            return self.version, self.sleep_changes, self.sleep_level

    async def on_slept(self, replica_id: str, changes: int, freed: int, error: str | None) -> None:
        async with self._changed:
            if error is None:
                self.slept[replica_id] = (changes, freed)
                self.sleep_failed.pop(replica_id, None)
            else:
                self.sleep_failed[replica_id] = (changes, error)
            self._changed.notify_all()

    def since(self, version: int) -> list[WeightUpdate]:
        """The updates after ``version``, oldest first."""
        return self.updates[version:]

    async def on_loaded(self, replica_id: str, version: int, error: str | None) -> None:
        async with self._changed:
            if error is None:
                self.loaded[replica_id] = version
                self.failed.pop(replica_id, None)
            else:
                self.failed[replica_id] = error
            self._changed.notify_all()

    def forget(self, replica_id: str) -> None:
        """A replica left the app (its versions no longer matter)."""
        self.loaded.pop(replica_id, None)
        self.failed.pop(replica_id, None)
        self.slept.pop(replica_id, None)
        self.sleep_failed.pop(replica_id, None)


class VersionWatch:
    """An ingress replica's view of the log: the version it hashes new requests at
    (``salt``), kept current by a long poll of the router (``follow``, started on the
    ingress's event loop), and the way its update calls reach the router."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.version = 0
        self._task: asyncio.Task[None] | None = None

    def follow(self) -> None:
        """Start following the router's version (once; call on the ingress's loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def salt(self, tenant: str | None) -> str | None:
        """The block-hash salt of a request built now: the tenant's at this version, as the
        replicas hash it. A replica hashes a request of another version again at its own
        (``RequestBuilder.at_weight_version``), so a stale version here costs the router's
        prefix matches for a moment, never a wrong reuse of KV."""
        from models.weight_update import weight_version_salt

        return weight_version_salt(tenant, self.version) if self.version else tenant

    async def update(self, weights: Any, abort_in_flight: bool) -> int:
        """``RouterDeployment.update_weights``, its error re-raised as the MeridianError it
        is (Ray wraps it)."""
        try:
            version = int(await self.router.update_weights.remote(weights, abort_in_flight))
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, MeridianError):
                raise cause from None
            raise EngineUnavailableError(f"the weight update failed: {cause}") from None
        self.version = max(self.version, version)
        return version

    async def set_sleep(self, level: int | None) -> int:
        """``RouterDeployment.set_sleep``, its error re-raised as the MeridianError it is."""
        try:
            return int(await self.router.set_sleep.remote(level))
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, MeridianError):
                raise cause from None
            raise EngineUnavailableError(f"sleep/wake failed: {cause}") from None

    async def _watch(self) -> None:
        while True:
            try:
                v = await self.router.next_weight_version.remote(self.version, POLL_S)
                self.version = max(self.version, int(v))
            except Exception:  # the router restarting: ask again shortly
                log.warning("could not read the app's weight version", exc_info=True)
                await asyncio.sleep(1.0)
