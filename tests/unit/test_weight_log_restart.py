"""The Serve app's weight log across a restart of the router deployment: the restarted
router reads the log back from its store and goes on from its version and sleep state
(``actors.serving.weight_updates``), and a replica's weight follower asks a router that
cannot answer again instead of reporting a failed load (``actors.serving.replica_weights``).

No Ray here: the router class is driven directly on an event loop, its store is the
in-process ``WeightLogStore``, and ``RouterLink`` stands in for Serve's handle to the
router deployment (its only role: carry calls to the router of the moment)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest
import torch

from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from actors.serving.metrics import ReplicaMetrics
from actors.serving.replica_weights import WeightFollower
from actors.serving.router import RouterDeployment
from actors.serving.weight_updates import WeightLogStore
from models import write_tiny_model
from policies.replica_stats import ReplicaStats

pytestmark = pytest.mark.timeout(300)  # the tiny model, one engine thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


def norm(seed: int) -> dict[str, torch.Tensor]:
    """A partial update: the final norm's weight (the tiny model's hidden size is 64)."""
    gen = torch.Generator().manual_seed(seed)
    return {"model.norm.weight": 1.0 + 0.1 * torch.randn(64, generator=gen)}


def router_of(model_dir, store: WeightLogStore) -> RouterDeployment:
    return RouterDeployment("least_loaded", block_size=4, model=str(model_dir), weight_store=store)


def test_a_restarted_router_goes_on_from_the_saved_log_and_sleep_state(model_dir):
    store = WeightLogStore(str(model_dir))

    async def before_the_kill() -> None:
        router = router_of(model_dir, store)
        assert await router.update_weights(norm(1)) == 1  # no live replica: done at once
        assert await router.update_weights(norm(2), True) == 2
        assert await router.set_sleep(2) == 0

    async def after_the_restart() -> None:
        router = router_of(model_dir, store)  # Serve's replacement, on the same store
        assert await router.next_weight_version(0, 0.0) == 2
        updates = await router.weight_updates(0)
        assert [(u.version, u.abort_in_flight) for u in updates] == [(1, False), (2, True)]
        # the tensors themselves (in process the log keeps them), for a replica starting now
        kept = updates[1].ref.arrays["model.norm.weight"]
        assert torch.equal(torch.from_numpy(kept.copy()), norm(2)["model.norm.weight"])
        # still asleep, at the change replicas already followed: they wait for the wake
        assert await router.next_app_state(2, 1, 0.0) == (2, 1, 2)
        assert await router.set_sleep(None) == 0
        assert await router.next_app_state(2, 1, 0.0) == (2, 2, None)
        assert await router.update_weights(norm(3)) == 3  # never a version replicas hold

    asyncio.run(before_the_kill())
    asyncio.run(after_the_restart())
    assert [u.version for u in store.read().updates] == [1, 2, 3]
    assert (store.read().sleep_level, store.read().sleep_changes) == (None, 2)


class RouterLink:
    """Stands in for Serve's handle to the Router deployment: ``link.method.remote(*args)
    .result(timeout_s=...)`` runs ``method`` on the router of the moment, on its own event
    loop thread. ``kill`` fails the calls in flight (as Ray does when the actor dies);
    calls made while no router runs wait for the next (``revive``), as Serve's handle
    waits for the replacement replica."""

    def __init__(self, router: RouterDeployment) -> None:
        self._cv = threading.Condition()
        self._in_flight: dict[concurrent.futures.Future, str] = {}  # -> the method
        self.router: RouterDeployment | None = None
        self.revive(router)

    def revive(self, router: RouterDeployment) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True, name="router-loop")
        thread.start()
        with self._cv:
            self.router, self._loop, self._thread = router, loop, thread
            self._cv.notify_all()

    def wait_in_flight(self, name: str, timeout_s: float = 60.0) -> None:
        """Until a call of ``name`` runs on the router of the moment."""
        with self._cv:
            assert self._cv.wait_for(lambda: name in self._in_flight.values(), timeout_s)

    def kill(self) -> None:
        with self._cv:
            self.router, loop, thread = None, self._loop, self._thread
            in_flight, self._in_flight = self._in_flight, {}
        for fut in in_flight:
            if not fut.done():
                fut.set_exception(RuntimeError("ActorDiedError: the Router's actor died"))

        async def die() -> None:  # what the router's process ran ends with it
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(die(), loop)
        thread.join(timeout=30)
        loop.close()

    def call(self, name: str, *args: Any, timeout_s: float = 60.0) -> Any:
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self._cv.wait_for(lambda: self.router is not None, timeout_s):
                raise TimeoutError(f"no router to call {name}")
            inner = asyncio.run_coroutine_threadsafe(getattr(self.router, name)(*args), self._loop)
            self._in_flight[out] = name
            self._cv.notify_all()

        def done(f: concurrent.futures.Future) -> None:
            with self._cv:
                self._in_flight.pop(out, None)
            if out.done():
                return
            if f.exception() is not None:
                out.set_exception(f.exception())  # type: ignore[arg-type]
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)
        return out.result(timeout_s)

    def __getattr__(self, name: str) -> Any:
        link = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                class Response:
                    @staticmethod
                    def result(timeout_s: float = 60.0) -> Any:
                        return link.call(name, *args, timeout_s=timeout_s)

                return Response()

        return Method()


def report(link: RouterLink, replica_id: str) -> None:
    """The replica's routing report, which makes it a live replica of the router."""
    stats = ReplicaStats(0, 0, 0, 64, 64, 0.0, 0.0, time=0.0)
    snap = ReplicaMetrics().snapshot()
    link.call("report", replica_id, "main", stats, snap, [], None, True)


def test_a_replica_follows_a_restarted_router_without_reporting_a_failure(model_dir):
    store = WeightLogStore(str(model_dir))
    link = RouterLink(router_of(model_dir, store))
    loop = EngineLoop(ColocatedEngine.build(model_dir, block_size=4), replica_id="r1")
    follower = WeightFollower(loop, link, "r1")
    try:
        follower.caught_up.result(timeout=60)
        report(link, "r1")
        assert link.call("update_weights", norm(1)) == 1  # returns once r1 loaded it
        assert follower.version == 1

        link.wait_in_flight("next_app_state")
        link.kill()  # r1's long poll fails
        restarted = router_of(model_dir, store)
        link.revive(restarted)
        link.wait_in_flight("next_app_state")  # r1 follows the new router
        report(link, "r1")
        # before: the failed poll reached the new router as a failed load (a 503 here),
        # and the new router numbered this update 1, which r1 skipped
        assert link.call("update_weights", norm(2)) == 2
        assert restarted.weights.loaded["r1"] == 2 and restarted.weights.failed == {}
        assert follower.version == 2
        version = loop.call(lambda engine: engine.weight_version).result(timeout=30)
        assert version == 2
    finally:
        follower.stop()
        link.kill()
        loop.shutdown()
