"""A region's balancer as a Ray Serve deployment (``Balancer-<region>``), for a ``ServeConfig``
with a ``regions`` section.

The ingress asks its client's region balancer to ``place`` each prompt; the answer is the
Serve replica (and its group) to pin the request to, after the request waited its turn in
the balancer's FCFS queue (``policies.region_balancer``). A placement on a peer region is
the peer's answer to ``place`` with the request marked forwarded (after the injected
one-way delay each way). The ingress then reports the request's first token
(``prefilled``) and its end (``finished``) to the balancer that placed it.

The availability monitor runs every ``probe_interval_s``: it reads every replica's latest
stats from the router deployment (replicas push them there every ``report_interval_s``),
keeps the replicas of this region's groups as its own (Serve replicas that come and go
join and leave), and counts their waiting requests; it probes each peer balancer's
``status`` over the injected delay. On a real cluster each region's balancer would get its
replicas' stats directly and regions would be node labels; on one machine the router is
the one stats feed and the delays are sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from actors.serving.config import ServeConfig
from actors.serving.region_entry import PlaceAnswer
from policies.region_balancer import (
    BalancedRequest,
    BalancerConfig,
    BalancerStatus,
    Placement,
    RegionBalancer,
)
from policies.residency import ResidencyPolicy
from policies.target_choice import MeasuredPrefixChoice


def balancer_name(region: str) -> str:
    return f"Balancer-{region}"


class RegionBalancerDeployment:
    def __init__(self, cfg: ServeConfig, region: str, router: Any) -> None:
        if cfg.regions is None:
            raise ValueError("a region balancer needs the config's regions section")
        self.section = sec = cfg.regions
        (mine,) = [r for r in sec.regions if r.name == region]
        self.region = region
        self.own_groups = set(mine.groups)
        self.groups_of = {r.name: set(r.groups) for r in sec.regions}
        self.adopted: set[str] = set()  # regions whose balancer is down, served from here
        self.router = router
        self.measured = MeasuredPrefixChoice()  # the "index" local view's lengths
        self.policy = RegionBalancer(
            balancer_name(region),
            region,
            BalancerConfig(
                push=sec.push,
                outstanding_cap=sec.outstanding_cap,
                remote_max_queue=sec.remote_max_queue,
                forward=sec.forward,
                choice=sec.choice,
            ),
            ResidencyPolicy(sec.residency),
            local_choice=self.measured if sec.local_view == "index" else None,
        )
        self.peer_region = {balancer_name(r.name): r.name for r in sec.regions if r.name != region}
        for name, r in self.peer_region.items():
            self.policy.add_remote(name, r)
        self.group_of: dict[str, str] = {}  # replica id -> group, for this region's replicas
        self._waiting: dict[str, asyncio.Future[PlaceAnswer]] = {}
        self._handles: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None

    # -- the ingress's calls ---------------------------------------------------------------
    async def place(self, request: BalancedRequest) -> PlaceAnswer:
        self._ensure_monitor()
        rid = request.request_id
        if rid in self._waiting:
            raise ValueError(f"request {rid!r} is already queued here")
        if self.section.local_view == "index":
            lengths = await self.router.prefix_lengths.remote(list(request.block_hashes))
            self.measured.measured[rid] = lengths
        fut: asyncio.Future[PlaceAnswer] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self.policy.submit(request, time.monotonic())
        self._pump()
        return await fut

    async def prefilled(self, request_id: str) -> None:
        self.policy.on_prefilled(request_id, time.monotonic())
        self._pump()

    async def finished(self, request_id: str) -> None:
        self.policy.on_finished(request_id, time.monotonic())
        self._pump()

    async def status(self) -> tuple[int, int]:
        self._ensure_monitor()
        s = self.policy.status(time.monotonic())
        return s.free_replicas, s.queue_len

    async def adopt(self, region: str) -> None:
        """Serve ``region``'s replicas as this balancer's own (its balancer is down); they
        join at the next probe."""
        if region != self.region and region in self.groups_of:
            self.adopted.add(region)
            await self._probe_replicas()

    async def release(self, region: str) -> None:
        """``region``'s balancer is back: its replicas leave at the next probe."""
        self.adopted.discard(region)

    @property
    def groups(self) -> set[str]:
        return self.own_groups.union(*(self.groups_of[r] for r in self.adopted))

    async def stats(self) -> dict[str, Any]:
        self._ensure_monitor()
        return {
            "region": self.region,
            "adopted": sorted(self.adopted),
            "replicas": sorted(self.group_of),
            "placed_local": self.policy.placed_local,
            "forwarded": self.policy.forwarded,
            "queued": len(self.policy.queue),
            "free_replicas": self.policy.status(time.monotonic()).free_replicas,
        }

    # -- placement -------------------------------------------------------------------------
    def _pump(self) -> None:
        for p in self.policy.dispatch(time.monotonic()):
            self.measured.measured.pop(p.request.request_id, None)  # used, or not needed
            fut = self._waiting.pop(p.request.request_id, None)
            if fut is None or fut.done():
                continue
            if p.kind == "local":
                fut.set_result((p.target, self.group_of[p.target], self.region, 0.0))
            else:
                self._spawn(self._forward(p, fut))

    async def _forward(self, p: Placement, fut: asyncio.Future[PlaceAnswer]) -> None:
        d = self.section.delay_s(self.region, self.peer_region[p.target])
        try:
            await asyncio.sleep(d)
            rid, group, served, further = await self._peer(p.target).place.remote(p.request)
            await asyncio.sleep(d)
        except Exception:
            # The peer died (or refused): it is unavailable until it answers a probe again,
            # and the request goes back to the head of this balancer's queue, unforwarded.
            self.policy.on_remote_probe(
                p.target, BalancerStatus(0, 0), time.monotonic(), time.monotonic()
            )
            if not fut.done():
                rid = p.request.request_id
                self._waiting[rid] = fut
                self.policy.queue.appendleft(dataclasses.replace(p.request, forwarded=False))
                self._pump()
            return
        if not fut.done():
            fut.set_result((rid, group, served, d + further))

    def _peer(self, name: str) -> Any:
        if name not in self._handles:
            from ray import serve

            app = serve.get_replica_context().app_name
            self._handles[name] = serve.get_deployment_handle(name, app_name=app)
        return self._handles[name]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the availability monitor ----------------------------------------------------------
    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_forever())

    async def _monitor_forever(self) -> None:
        while True:
            try:
                await self._probe_replicas()
            except Exception:  # the router restarting: keep the last view, try again
                pass
            now = time.monotonic()
            for name in self.peer_region:
                self._spawn(self._probe_peer(name, now))
            self._pump()
            await asyncio.sleep(self.section.probe_interval_s)

    async def _probe_replicas(self) -> None:
        snap = await self.router.snapshot.remote()
        now = time.monotonic()
        mine = {rid: sample for rid, sample in snap.items() if sample.group in self.groups}
        for rid in list(self.group_of):
            if rid not in mine:
                self.policy.remove_replica(rid)
                del self.group_of[rid]
        for rid, sample in mine.items():
            if rid not in self.group_of:
                self.group_of[rid] = sample.group
                self.policy.add_replica(rid)
            # Stats lag behind this balancer's pushes: a probe never clears them (``-inf``);
            # a push counts until its first token, its end, or its ttl.
            self.policy.on_replica_probe(rid, sample.stats.num_waiting, float("-inf"), now)

    async def _probe_peer(self, name: str, sent: float) -> None:
        d = self.section.delay_s(self.region, self.peer_region[name])
        try:
            await asyncio.sleep(d)
            free, queued = await self._peer(name).status.remote()
            await asyncio.sleep(d)
        except Exception:  # a peer down or starting: unavailable until it answers
            self.policy.on_remote_probe(name, BalancerStatus(0, 0), sent, time.monotonic())
            return
        self.policy.on_remote_probe(name, BalancerStatus(free, queued), sent, time.monotonic())
        self._pump()
