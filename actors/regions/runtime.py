"""Live region balancers: ``policies.region_balancer`` driven on an asyncio loop, with an
availability monitor, over real replicas (an engine in an ``EngineLoop`` each).

One ``BalancerRuntime`` per region. A client calls ``handle(request)`` on its region's
balancer; the request waits in the policy's FCFS queue until ``dispatch`` places it on a
local replica (the runtime streams it there and answers with the output) or forwards it to a
peer balancer (the runtime sleeps the one-way delay, calls the peer's ``handle``, sleeps the
delay back). The monitor probes every local replica's pending count (requests not yet
admitted to its batch) every ``probe_interval`` seconds (100 ms by default), and every peer's
status (free replicas, queue length) over the injected delay, without waiting for the slow
peers before the next local probe. A replica's first token and its finish are fed back at
once (the runtime proxies the stream), so a freed replica takes the next request before the
next probe.

On one machine the regions are groups of replicas in one process, and the delays are
``asyncio.sleep``s (``delay(a, b)``, one way); nothing here needs Ray. The Serve app's
balancer (``actors.regions.serve_balancer``) runs the same policy over Serve replicas; this
runtime is what ``bench/regions.py`` and the in-process failover test drive.

Invariants: every ``handle`` call ends with exactly one answer (an output or an exception);
a forwarded request is handled by the peer's local replicas only (the policy never forwards
it again); after ``close`` the runtime accepts nothing and its monitor is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from actors.engine.events import Delta, Done, Failed
from actors.engine.outputs import RequestOutput
from actors.serving.engine_loop import EngineLoop
from errors import EngineUnavailableError, MeridianError
from policies.region_balancer import (
    BalancedRequest,
    BalancerStatus,
    Placement,
    RegionBalancer,
)
from policies.request import Request

Delay = Callable[[str, str], float]


class BalancerDownError(EngineUnavailableError):
    """The balancer stopped before answering; retry at another region's balancer."""


@dataclass
class RegionOutput:
    """A finished request as the client sees it (times: ``time.monotonic``, one machine)."""

    output: RequestOutput
    replica: str
    region: str  # where it was served
    forwarded: bool
    first_token_at: float  # when the first token reached this balancer's caller


class LocalReplica:
    """One replica of a region: an engine driven by its ``EngineLoop``."""

    def __init__(self, replica_id: str, loop: EngineLoop) -> None:
        self.replica_id = replica_id
        self.loop = loop

    def pending(self) -> int:
        """Requests queued and not yet admitted to the batch (the engine's last stats)."""
        return self.loop.stats().num_waiting

    async def run(self, request: Request, on_first: Callable[[], None]) -> RequestOutput:
        first = True
        async for item in self.loop.stream([request]):
            if isinstance(item, Delta) and first and item.delta.token_ids:
                first = False
                on_first()
            elif isinstance(item, Done):
                return item.output
            elif isinstance(item, Failed):
                raise (EngineUnavailableError if item.retriable else MeridianError)(item.message)
        raise EngineUnavailableError(f"replica {self.replica_id} ended the stream early")


class BalancerRuntime:
    def __init__(
        self,
        policy: RegionBalancer,
        replicas: list[LocalReplica],
        delay: Delay,
        probe_interval: float = 0.1,
    ) -> None:
        if probe_interval <= 0:
            raise ValueError("probe_interval must be positive")
        self.policy = policy
        self.delay = delay
        self.probe_interval = probe_interval
        self.replicas: dict[str, LocalReplica] = {}
        for r in replicas:
            self.add_replica(r)
        self.peers: dict[str, BalancerRuntime] = {}
        self._waiting: dict[str, tuple[Request, asyncio.Future[RegionOutput]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self.closed = False
        self.probes = 0

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def region(self) -> str:
        return self.policy.region

    # -- membership ------------------------------------------------------------------------
    def add_replica(self, replica: LocalReplica) -> None:
        self.replicas[replica.replica_id] = replica
        self.policy.add_replica(replica.replica_id)

    def remove_replica(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self.policy.remove_replica(replica_id)

    def connect(self, peer: BalancerRuntime) -> None:
        self.peers[peer.name] = peer
        self.policy.add_remote(peer.name, peer.region)

    def disconnect(self, peer_name: str) -> None:
        self.peers.pop(peer_name, None)
        self.policy.remove_remote(peer_name)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the availability monitor (on the running loop); probe once at once."""
        self._probe_local(time.monotonic())
        self._monitor = asyncio.get_running_loop().create_task(self._monitor_forever())

    async def close(self) -> None:
        """Stop: the monitor ends, queued and in-flight requests fail with
        ``BalancerDownError`` (their clients retry elsewhere)."""
        self.closed = True
        if self._monitor is not None:
            self._monitor.cancel()
        for task in list(self._tasks):
            task.cancel()
        for _, fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(BalancerDownError(f"balancer {self.name} stopped"))
        self._waiting.clear()
        self.policy.drain()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._monitor is not None:
            await asyncio.gather(self._monitor, return_exceptions=True)

    # -- requests --------------------------------------------------------------------------
    async def handle(
        self, request: Request, session_id: str | None = None, forwarded: bool = False
    ) -> RegionOutput:
        if self.closed:
            raise BalancerDownError(f"balancer {self.name} is down")
        fut: asyncio.Future[RegionOutput] = asyncio.get_running_loop().create_future()
        rid = request.request_id
        if rid in self._waiting:
            raise ValueError(f"request {rid!r} is already queued here")
        self._waiting[rid] = (request, fut)
        meta = BalancedRequest(
            rid,
            tuple(request.block_hashes),
            time.monotonic(),
            session_id,
            request.tenant,
            self.region,
            forwarded,
        )
        self.policy.submit(meta, time.monotonic())
        self._pump()
        return await fut

    def status(self) -> tuple[int, int]:
        s = self.policy.status(time.monotonic())
        return s.free_replicas, s.queue_len

    def _pump(self) -> None:
        if self.closed:
            return
        for p in self.policy.dispatch(time.monotonic()):
            task = asyncio.get_running_loop().create_task(self._execute(p))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _execute(self, p: Placement) -> None:
        rid = p.request.request_id
        request, fut = self._waiting.pop(rid)
        try:
            if p.kind == "local":
                result = await self._run_local(p.target, request)
            else:
                result = await self._forward(p, request)
        except asyncio.CancelledError:
            if not fut.done():
                fut.set_exception(BalancerDownError(f"balancer {self.name} stopped"))
            raise
        except Exception as e:
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(result)

    async def _run_local(self, replica_id: str, request: Request) -> RegionOutput:
        first_at: list[float] = []
        rid = request.request_id

        def on_first() -> None:
            first_at.append(time.monotonic())
            self.policy.on_prefilled(rid, first_at[0])
            self._pump()

        try:
            out = await self.replicas[replica_id].run(request, on_first)
        finally:
            self.policy.on_finished(rid, time.monotonic())
            self._pump()
        return RegionOutput(out, replica_id, self.region, False, first_at[0])

    async def _forward(self, p: Placement, request: Request) -> RegionOutput:
        peer = self.peers[p.target]
        d = self.delay(self.region, peer.region)
        await asyncio.sleep(d)
        result = await peer.handle(request, p.request.session_id, forwarded=True)
        await asyncio.sleep(d)
        result.first_token_at += d  # the first token travels back the same way
        result.forwarded = True
        return result

    # -- the availability monitor ----------------------------------------------------------
    def _probe_local(self, now: float) -> None:
        # The engine publishes its stats after a step, and a request submitted during that
        # step is not in them although the snapshot is newer: a probe never clears this
        # balancer's own pushes (``sent_at`` -inf). A push stops counting when its first
        # token arrives (``on_prefilled``), it finishes, or its ttl passes.
        for rid, replica in self.replicas.items():
            self.policy.on_replica_probe(rid, replica.pending(), float("-inf"), now)
        self.probes += 1

    async def _probe_peer(self, peer: BalancerRuntime, sent: float) -> None:
        d = self.delay(self.region, peer.region)
        await asyncio.sleep(d)
        if peer.closed:
            return
        free, queued = peer.status()
        await asyncio.sleep(d)
        if peer.name in self.peers:
            self.policy.on_remote_probe(
                peer.name, BalancerStatus(free, queued), sent, time.monotonic()
            )
            self._pump()

    async def _monitor_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            now = time.monotonic()
            self._probe_local(now)
            for peer in list(self.peers.values()):
                task = loop.create_task(self._probe_peer(peer, now))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._pump()
            await asyncio.sleep(self.probe_interval)
