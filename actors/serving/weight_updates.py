"""The Serve app's weight updates, held by the router deployment (``router.py``).

One owner for the whole app: the ingress replicas (however many) and every replica of
every group ask it, so all of them agree on the order and number of updates.

- ``WeightUpdateLog.update`` has the log's store (below) read and check an update
  (``models.weight_update``: a bad tensor is refused, naming it, before anything changes)
  and put it in Ray's object store once as ``SharedWeights`` (owned by the store, so the
  data outlives the caller and the router), appends it as the next version, wakes every
  watcher, and returns once every live replica has loaded it. The router does not read or
  check weights: the store's process does (its first check imports torch and builds the
  model on the meta device, ~10 s cold under load), and it outlives a killed router.
- Replicas (``replica_weights.py``) long-poll ``next_version``, fetch the updates they lack
  with ``since`` and say ``loaded``. A replica that starts later loads every update of the
  log before it serves (its first request waits for that).
- Each ingress long-polls ``next_version`` too and hashes new requests at that version, so
  the router's prefix view (block hashes the replicas report at their version) matches.

- Sleep (``set_sleep``): the app's sleep level (None: awake) and a count of its changes;
  replicas follow it on the same long poll (``next_state``), sleep or wake once their
  running requests finish (requests meanwhile wait for the wake), and say ``slept``. A
  replica that starts while the app sleeps follows it to sleep. No update while asleep.

- What must outlive the router (``LogState``: the updates and the sleep state) is saved,
  before anyone sees it, in a ``WeightLogStore``: under Serve a detached named actor of the
  app (``RemoteLogStore``), started by the app's first update or sleep, which also owns
  every update's tensors (it reads, checks and puts them in the object store itself,
  ``keep``), so Serve's replacement of a dead router reads the log back whole and goes on
  from its version and sleep state. The rest (which replica loaded or slept what) is
  rebuilt from the replicas' next reports. The store dies with the app: the router's
  graceful shutdown kills it when Serve is deleting the app (``RemoteLogStore.release``),
  and a store found under the app's name with another model is killed, never read.

Invariants: update ``i`` (1-based) is weight version ``i`` on every replica, across router
restarts (a restarted router's log is the store's, so it never numbers an update a replica
already holds, and a replica that starts after the restart loads the same updates);
updates are applied one at a time, in order (``_lock``); the log only grows. Outside Ray
(``WeightLogStore`` in process, unit tests) the log keeps each update's tensors themselves.
Not covered: the store's own actor dying. The log is then lost (replicas keep their
weights), the next update fails (it cannot be saved), and a router restarted after that
starts an empty store whose versions the replicas already hold: deploy the app again.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
    the object store, owned by the log's store; in process the ``SharedWeights`` itself)
    applied over version ``version - 1``."""

    version: int
    ref: Any
    abort_in_flight: bool


@dataclass(frozen=True)
class LogState:
    """What of the log outlives the router: ``model`` (the app's model folder the updates
    fit; None: the built-in tiny one), the updates, and the sleep state."""

    model: str | None = None
    updates: tuple[WeightUpdate, ...] = ()
    sleep_level: int | None = None
    sleep_changes: int = 0


class WeightLogStore:
    """Holds a ``LogState``: a plain object in process, and the class of the detached actor
    that ``RemoteLogStore`` starts under Serve."""

    def __init__(self, model: str | None = None) -> None:
        self.state = LogState(model)
        self._expected: dict[str, tuple[int, ...]] | None = None

    def read(self) -> LogState:
        return self.state

    async def save(self, state: LogState) -> None:
        self.state = state

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name of the log's model with its shape (what an update may name)."""
        if self._expected is None:
            from models import tiny_model_dir
            from models.loader import expected_tensors

            model = Path(self.state.model) if self.state.model else tiny_model_dir("dense")
            self._expected = expected_tensors(model)
        return self._expected

    async def keep(self, source: Any) -> list[Any]:
        """``source`` (``read_weights``' sources; a Ray object ref comes wrapped in a
        one-item list so it reaches here as a ref) read and checked as the log keeps it, in
        a one-item list: a ``SharedWeights`` in the object store, put by this process
        (which owns it from then on), or itself outside Ray. Raises InvalidRequestError
        (a bad tensor, named). Off the event loop: a checkpoint read takes seconds."""
        return [await asyncio.to_thread(self._checked, source)]

    def _checked(self, source: Any) -> Any:
        import ray

        from models.weight_update import SharedWeights, checked_weights

        if isinstance(source, list) and len(source) == 1:
            source = source[0]
        shared = SharedWeights.of(checked_weights(self.expected(), source))
        return ray.put(shared) if ray.is_initialized() else shared


STORE_NAMESPACE = "meridian-weights"


class RemoteLogStore:
    """The app's ``WeightLogStore`` as a detached actor named ``<app>/weight-log`` in
    ``STORE_NAMESPACE``, started by the first update or sleep (an app that never updates
    its weights runs no such process; the first update pays its start). A
    restarted router attaches to the one its app had, if any; it owns the updates'
    tensors in the object store."""

    def __init__(self, app: str, model: str | None) -> None:
        import ray

        self.app = app
        self.model = model
        self.name = f"{app}/weight-log"
        self.owner: Any = None  # None: no update or sleep saved yet, the log is empty
        self.state = LogState(model)
        try:
            found: Any = ray.get_actor(self.name, namespace=STORE_NAMESPACE)
        except ValueError:
            return
        state = ray.get(found.read.remote())
        if state.model != model:  # another app's log under this name: never read it
            log.warning("replacing the weight log of %s (model %s)", self.name, state.model)
            ray.kill(found)
            return
        self.owner, self.state = found, state

    def _started(self) -> Any:
        import ray

        if self.owner is None:
            actor: Any = ray.remote(WeightLogStore)
            self.owner = actor.options(
                name=self.name,
                namespace=STORE_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=1,
            ).remote(self.model)
        return self.owner

    def read(self) -> LogState:
        return self.state

    async def save(self, state: LogState) -> None:
        await self._started().save.remote(state)
        self.state = state

    async def keep(self, source: Any) -> list[Any]:
        """``WeightLogStore.keep`` in the store's process, which owns the tensors from then
        on (a ref owned by the router would die with it). A refused update raises its own
        MeridianError here."""
        import ray

        try:
            return list(await self._started().keep.remote(source))
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, MeridianError):
                raise e.cause from None
            raise

    def release(self) -> None:
        """The router stops gracefully: kill the store if Serve is deleting the app (kept
        through a redeploy of the router; a router that dies never gets here)."""
        import ray
        from ray import serve

        if self.owner is None:
            return
        try:
            app = serve.status().applications.get(self.app)
            deleting = app is None or str(app.status).endswith("DELETING")
        except Exception:  # Serve itself shutting down
            deleting = True
        if deleting:
            try:
                ray.kill(self.owner)
            except Exception:
                log.warning("could not stop the weight log %s", self.name, exc_info=True)


class WeightUpdateLog:
    """``model_dir``: the app's model (None: the built-in tiny one), whose tensor names and
    shapes an update must fit. ``live_replicas``: the replica ids the router routes to now
    (they must load an update before it is done). ``store``: where the log's ``LogState``
    is saved and read back by a restarted router (default: in process only)."""

    def __init__(
        self,
        model_dir: str | None,
        live_replicas: Callable[[], set[str]],
        store: WeightLogStore | RemoteLogStore | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.live_replicas = live_replicas
        self.store = store if store is not None else WeightLogStore(model_dir)
        saved = self.store.read()
        self.updates: list[WeightUpdate] = list(saved.updates)
        self.loaded: dict[str, int] = {}  # replica id -> the version it has loaded
        self.failed: dict[str, str] = {}  # replica id -> why its last load failed
        self._changed = asyncio.Condition()  # a new version or sleep state, a load, a failure
        self._lock = asyncio.Lock()  # one update (or sleep change) at a time
        self.sleep_level: int | None = saved.sleep_level  # the app's level; None: awake
        self.sleep_changes = saved.sleep_changes  # sleeps and wakes so far
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
            try:
                (ref,) = await self.store.keep(source)
            except MeridianError:
                raise
            except Exception as e:
                raise EngineUnavailableError(f"the app's weight log is unreachable: {e}") from e
            version = self.version + 1
            update = WeightUpdate(version, ref, abort_in_flight)
            await self._save(updates=(*self.updates, update))
            async with self._changed:
                self.updates.append(update)
                self._changed.notify_all()
            await self._wait_loaded(version)
            return version

    async def _save(self, **changes: Any) -> None:
        """Save the log's state with ``changes`` before anyone sees them (a restarted
        router reads it back). EngineUnavailableError when the store cannot be reached."""
        state = dataclasses.replace(
            self.store.read(),
            updates=tuple(self.updates),
            sleep_level=self.sleep_level,
            sleep_changes=self.sleep_changes,
        )
        try:
            await self.store.save(dataclasses.replace(state, **changes))
        except Exception as e:
            raise EngineUnavailableError(f"the app's weight log could not be saved: {e}") from e

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
        replicas that failed or did not follow in
        ``LOAD_TIMEOUT_S``; the app's state stays as set, replicas retry on their next
        change."""
        if level not in (1, 2, None):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", "level")
        async with self._lock:
            await self._save(sleep_level=level, sleep_changes=self.sleep_changes + 1)
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
        from store.hashing import weight_version_salt

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
