"""Where the ingress places a prompt when the config has regions, with balancer failover.

``RegionEntry.place(request, region)`` asks the client's region balancer (a
``RegionBalancerDeployment`` handle) for a replica. A watcher asks every balancer for its
``status`` every ``check_s``; one that does not answer within ``health_timeout_s`` is marked
down (Serve holds calls to a deployment whose only replica died until it has restarted it:
they do not fail, they wait). When a region is down, or its ``place`` call fails, the call is
placed at the nearest live balancer (``policies.region_balancer.nearest_alive`` over the configured
delays), which first ``adopt``s the region's replica groups and treats them as its own. New
prompts of a down region go straight to that stand-in. After ``recheck_s`` the region's own
balancer is asked for its ``status`` (Serve restarts a dead replica); once it answers, it
serves its region again and the stand-in ``release``s the groups.

No accepted request is lost to a balancer's death: a prompt the dead balancer held fails
its ``place`` call and is placed again elsewhere with the same request id; a prompt already
streaming never passes through a balancer (the ingress streams from the replica), and
the first-token and finish reports it owes a dead balancer are dropped.

This is the ingress's side of regions, so it lives with the ingress: the balancers
(``actors.regions``) build on serving, and serving never imports them.

``NamedHandle`` is how a region's own ingress (an application of its own, with its own route
prefix: ``serve_app.build_region_ingress``) reaches the main application's router, replicas
and balancers: bound handles only join deployments of one application.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from policies.region_balancer import BalancedRequest, nearest_alive

# A balancer's answer to ``place``: (replica id, group, region served in, one-way delay from
# the client's region in seconds).
PlaceAnswer = tuple[str, str, str, float]


class NamedHandle:
    """A Serve deployment handle found by name (``deployment`` of application ``app``) where it
    is first used; pickles as the two names. Attribute access is the handle's."""

    def __init__(self, deployment: str, app: str) -> None:
        self.deployment = deployment
        self.app = app
        self._handle: Any = None

    def __getstate__(self) -> dict[str, str]:
        return {"deployment": self.deployment, "app": self.app}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["deployment"], state["app"])  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not the handle's: pickling and copying probe these
            raise AttributeError(name)
        if self._handle is None:
            from ray import serve

            self._handle = serve.get_deployment_handle(self.deployment, app_name=self.app)
        return getattr(self._handle, name)


class RegionEntry:
    def __init__(
        self,
        balancers: dict[str, Any],  # region -> its balancer's handle
        delay_s: dict[tuple[str, str], float],
        recheck_s: float = 2.0,
        health_timeout_s: float = 1.0,
        check_s: float = 0.5,
    ) -> None:
        if not balancers:
            raise ValueError("need at least one region balancer")
        self.balancers = balancers
        self.delay_s = delay_s
        self.recheck_s = recheck_s
        self.health_timeout_s = health_timeout_s
        self.down: dict[str, float] = {}  # region -> when its balancer was last seen failing
        self.stand_in: dict[str, str] = {}  # down region -> the region serving it
        self.failovers = 0  # times a balancer was found down
        self.check_s = check_s
        self._watcher: asyncio.Task | None = None

    @property
    def default_region(self) -> str:
        return next(iter(self.balancers))

    def _nearest(self, region: str, skip: set[str]) -> str | None:
        """The nearest other balancer not in ``skip``: one seen up if any, else one marked
        down (a health check that timed out under load is not proof it is gone)."""
        others = [r for r in self.balancers if r != region and r not in skip]
        up = [(r, r) for r in others if r not in self.down]
        return nearest_alive(region, up or [(r, r) for r in others], self.delay_s)

    async def _home_back(self, region: str) -> bool:
        """Whether a down region's balancer answers again (checked every ``recheck_s``)."""
        if time.monotonic() - self.down[region] < self.recheck_s:
            return False
        try:
            await asyncio.wait_for(
                self.balancers[region].status.remote(), timeout=self.health_timeout_s
            )
        except Exception:
            self.down[region] = time.monotonic()
            return False
        await self._mark_up(region)
        return True

    async def _mark_up(self, region: str) -> None:
        """``region``'s balancer answered: it serves its region again, its stand-in lets go."""
        self.down.pop(region, None)
        stand_in = self.stand_in.pop(region, None)
        if stand_in is not None:
            with contextlib.suppress(Exception):
                await self.balancers[stand_in].release.remote(region)

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _check(self, region: str) -> None:
        try:
            await asyncio.wait_for(
                self.balancers[region].status.remote(), timeout=self.health_timeout_s
            )
        except Exception:
            if region not in self.down:
                self.failovers += 1
            self.down[region] = time.monotonic()

    async def _watch(self) -> None:
        while True:
            up = [r for r in self.balancers if r not in self.down]
            await asyncio.gather(*(self._check(r) for r in up))
            await asyncio.sleep(self.check_s)

    async def place(self, request: BalancedRequest, region: str) -> PlaceAnswer:
        self._ensure_watcher()
        tried: set[str] = set()
        while True:
            target = region
            if region in self.down and not await self._home_back(region):
                target = self.stand_in.get(region) or ""
                if not target or target in self.down or target in tried:
                    nearest = self._nearest(region, tried)
                    if nearest is None:
                        raise RuntimeError(f"no live balancer can serve region {region!r}")
                    target = self.stand_in[region] = nearest
            if target in tried:
                raise RuntimeError(f"every balancer that could serve region {region!r} failed")
            tried.add(target)
            try:
                if target != region:
                    await self.balancers[target].adopt.remote(region)
                answer = await self.balancers[target].place.remote(request)
                if target in self.down:  # it answered, whatever a timed-out check said
                    await self._mark_up(target)
                if target != region and self.stand_in.get(region) != target:
                    # the home balancer came back (and released the stand-in) while this
                    # adopt was in flight: release again, or the stand-in keeps the region
                    with contextlib.suppress(Exception):
                        await self.balancers[target].release.remote(region)
                return answer
            except Exception:
                if target not in self.down:
                    self.failovers += 1
                self.down[target] = time.monotonic()

    async def report(self, region: str, method: str, request_id: str) -> None:
        """``prefilled`` or ``finished`` to the balancer that placed the request; a dead one
        is skipped (its replacement starts with nothing to account)."""
        with contextlib.suppress(Exception):
            await getattr(self.balancers[region], method).remote(request_id)
