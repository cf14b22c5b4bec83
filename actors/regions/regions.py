"""A set of live regions with balancer failover (SkyWalker section 4.2).

``Regions`` wires one ``BalancerRuntime`` per region to every other and is where clients
enter: ``handle(region, request)`` sends the request to the balancer now serving that region.
When a balancer fails (``fail``), its region's replicas move to the nearest surviving
balancer (``policies.region_balancer.nearest_alive`` over the one-way delays), which treats
them as its own until the region's balancer comes back (``restore``: a fresh balancer, the
replicas move back, the stand-in forgets them).

No accepted request is lost: a request the failed balancer held (queued, forwarded or
streaming from a replica) fails with ``BalancerDownError`` when it stops (a stream it
proxied is aborted on the replica, freeing its blocks), and ``handle`` retries it, with the
same request id, at the balancer now serving the region; greedy requests give the same
tokens the second time. Retries are bounded by ``max_retries``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from actors.regions.runtime import BalancerDownError, BalancerRuntime, LocalReplica, RegionOutput
from policies.region_balancer import BalancerConfig, RegionBalancer, nearest_alive
from policies.request import Request


class Regions:
    def __init__(
        self,
        replicas: Mapping[str, list[LocalReplica]],  # region -> its replicas, nearest first
        delay: Mapping[tuple[str, str], float],  # one-way seconds between two regions
        config: BalancerConfig | None = None,
        probe_interval: float = 0.1,
        max_retries: int = 3,
    ) -> None:
        self.delay = dict(delay)
        self.config = config or BalancerConfig()
        self.probe_interval = probe_interval
        self.max_retries = max_retries
        self.home: dict[str, list[LocalReplica]] = {r: list(v) for r, v in replicas.items()}
        self.balancers: dict[str, BalancerRuntime] = {}  # region -> its live balancer
        self.serving: dict[str, str] = {}  # region -> region whose balancer serves it
        self.retries = 0
        for region in self.home:
            self.balancers[region] = self._new_balancer(region)
            self.serving[region] = region
        for lb in self.balancers.values():
            self._connect(lb)

    def one_way(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.delay.get((a, b), self.delay.get((b, a), 0.0))

    def _new_balancer(self, region: str) -> BalancerRuntime:
        policy = RegionBalancer(f"lb-{region}", region, self.config)
        return BalancerRuntime(policy, self.home[region], self.one_way, self.probe_interval)

    def _connect(self, lb: BalancerRuntime) -> None:
        for other in self.balancers.values():
            if other is not lb:
                lb.connect(other)
                other.connect(lb)

    def start(self) -> None:
        for lb in self.balancers.values():
            lb.start()

    async def close(self) -> None:
        for lb in list(self.balancers.values()):
            await lb.close()

    # -- clients ---------------------------------------------------------------------------
    def balancer_for(self, region: str) -> BalancerRuntime:
        return self.balancers[self.serving[region]]

    async def handle(
        self, region: str, request: Request, session_id: str | None = None
    ) -> RegionOutput:
        """Serve ``request`` for a client of ``region``, retrying at the region's current
        balancer when the one it reached failed."""
        for attempt in range(self.max_retries + 1):
            lb = self.balancer_for(region)
            try:
                return await lb.handle(request, session_id)
            except BalancerDownError:
                if attempt == self.max_retries:
                    raise
                self.retries += 1
                await asyncio.sleep(self.probe_interval)  # let the failover land
        raise AssertionError("unreachable")

    # -- failover --------------------------------------------------------------------------
    async def fail(self, region: str) -> str:
        """Stop ``region``'s balancer (as if it died) and hand its replicas to the nearest
        surviving balancer; returns that balancer's region."""
        dead = self.balancers.pop(region)
        alive = [(lb.name, r) for r, lb in self.balancers.items()]
        name = nearest_alive(region, alive, self.delay)
        if name is None:
            self.balancers[region] = dead
            raise RuntimeError("no surviving balancer to take the region over")
        stand_in_region = next(r for r, lb in self.balancers.items() if lb.name == name)
        stand_in = self.balancers[stand_in_region]
        for lb in self.balancers.values():
            lb.disconnect(dead.name)
        # Requests served by the dead balancer's replicas are the stand-in's from now on.
        for regions, serving in list(self.serving.items()):
            if serving == region:
                self.serving[regions] = stand_in_region
        for replica in dead.replicas.values():
            stand_in.add_replica(replica)
        await dead.close()
        return stand_in_region

    async def restore(self, region: str) -> None:
        """Bring ``region``'s balancer back: a fresh one takes its replicas back."""
        if region in self.balancers:
            return
        stand_in = self.balancer_for(region)
        lb = self._new_balancer(region)
        for replica in self.home[region]:
            stand_in.remove_replica(replica.replica_id)
        self.balancers[region] = lb
        self.serving[region] = region
        self._connect(lb)
        lb.start()
