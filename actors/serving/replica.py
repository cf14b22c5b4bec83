"""Model replicas on Ray: the Serve replica deployment, and a plain Ray actor for the
Python API and rollouts. Both run one engine in an ``EngineLoop`` thread: a
``ReplicaController`` (``ColocatedEngine``), or for a disaggregated group of the Serve
config a ``PDCluster`` of prefill and decode replica actors (``PDEngine``) that the Serve
replica owns and shuts down when it stops.

Replica -> router: a reporter thread pushes the replica's block stored/evicted events,
stats and metrics to the router deployment every ``cfg.report_interval()`` (sooner never,
later only if the router is slow). Each push waits for the previous one, so the router
applies one replica's events in the order they happened. The first push makes the router
route to a new replica; the last, when the replica stops, is ``leave``.

Router -> replica: weight updates (``replica_weights.py``): the replica loads every update
of the app's log before its first request, then each new one as the router announces it.

Serve -> replica: ``record_autoscaling_stats`` (an autoscaled group) reports the load that
``policies.autoscaling`` scales on. When Serve removes a replica it stops routing to it and
waits until its ongoing calls end (graceful shutdown); ``__del__`` then waits until the
engine holds nothing, tells the router it left, and only then stops the engine.

The engines (and torch) are imported where one is built: Serve's build of the app imports
this module, and needs none of them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from actors.engine.config import EngineConfig
from actors.engine.outputs import RequestOutput
from actors.engine.request_limits import RequestLimits
from actors.engine.thread_priority import run_process_at_normal_priority
from actors.ray_nodes import alive_nodes
from actors.serving.config import ReplicaGroupConfig, ServeConfig
from actors.serving.core_plan import replica_cores
from actors.serving.engine_loop import EngineLoop, ServingEngine
from actors.serving.messages import ReplicaCall
from actors.serving.replica_channel import ReplicaChannels
from actors.serving.replica_weights import WeightFollower
from policies.autoscaling import ReplicaLoad
from policies.replica_stats import ReplicaStats
from policies.request import Request

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # an idle replica still reports this often (the router expires the silent)
DRAIN_TIMEOUT_S = 30.0  # a stopping replica's wait for its engine, when the group sets none


def _engine(
    model: str | None,
    group: ReplicaGroupConfig,
    replica_id: str,
    config: EngineConfig,
    pin: dict[str, float],
    app: str,
) -> ServingEngine:
    """``config``: the group's engine config as the Serve config makes it (with its
    region's node resource for the workers); ``pin``: that resource alone, which every
    actor of a disaggregated group's cluster reserves; ``app``: the Serve application,
    whose name a shared pool's actors carry (a P/D group's; a colocated group's store
    shards, ``<app>/<group>``, shared by every replica of the group)."""
    if group.disaggregated:
        from actors.disagg.engine import PDEngine
        from actors.serving.pd_group import pd_cluster_config, shared_pool_name

        pool = shared_pool_name(app, group, model)
        return PDEngine.for_config(pd_cluster_config(model, group, replica_id, pin, pool))
    slo = group.admission.ttft_slo if group.admission is not None else None
    store = group.store
    if store is None:
        from actors.serving.colocated_engine import ColocatedEngine

        return ColocatedEngine.build(model, config, ttft_slo=slo)
    from actors.serving.store_engine import store_engine

    return store_engine(
        model,
        config,
        f"{app}/{group.name}",
        replica_id,
        store.min_load_tokens,
        store.dram_bytes,
        store.ssd_bytes,
        store.ssd_dir,
        store.num_shards,
        ttft_slo=slo,
        placement=store.placement_for(disaggregated=False),
        tenant_retained_share=store.tenant_retained_share,
    )


class ReplicaServer:
    """The Serve replica deployment (one per replica group).

    The ingress's relay starts a prompt with ``start(StartPrompt)`` (``messages.py``: the
    ``Request`` of each choice, built by the ingress, the ``ranking`` that
    ``RankedRequestRouter`` follows, and the ingress's id). It answers
    ``Accepted(replica id)`` once the engine took the prompt, or ``Refused`` (400 bad
    input, 429 overloaded or rejected by the Conductor, 503 failed). The prompt's events
    then come on that ingress's one ``events`` stream (``replica_channel.py``): one stream
    item per engine step for all of an ingress's requests, not one per request;
    ``abort_prompt`` drops one. ``start``, ``events`` and ``abort_prompt`` are its
    ``ReplicaChannels``' own methods.
    ``limits()``: what a request must fit here, for the ingress's builder.
    """

    def __init__(self, cfg: ServeConfig, group: str, router: Any) -> None:
        import ray
        from ray import serve

        run_process_at_normal_priority()  # all of this process, as RAY_worker_niceness=0
        (g,) = [x for x in cfg.groups if x.name == group]
        self.group = group
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        pin = cfg.regions.group_resources(group) if cfg.regions is not None else {}
        engine_config = cfg.group_engine_config(g)
        self.engine = _engine(cfg.model, g, self.replica_id, engine_config, pin, context.app_name)
        cores = engine_config.cpu_cores or replica_cores(
            cfg, g, context.rank.local_rank, len(alive_nodes())
        )
        threads = len(cores) if cores and engine_config.cpu_cores is None else None
        self.loop = EngineLoop(
            self.engine, cfg.limits.max_waiting_per_replica, cores, threads, self.replica_id
        )
        # first on the loop: the app's weight updates so far, before any request runs
        self.weights = WeightFollower(self.loop, router, self.replica_id)
        host = ray.util.get_node_ip_address()  # the channels' sockets listen here
        self.channels = ReplicaChannels(self.loop, self.replica_id, host)
        # the relay's calls go straight to the channels (Serve looks a deployment's methods
        # up on the instance)
        self.start = self.channels.start
        self.events = self.channels.events
        self.abort_prompt = self.channels.abort_prompt
        self.router = router
        self.interval = cfg.report_interval()
        scaling = g.autoscaling
        self.drain_timeout_s = scaling.drain_timeout_s if scaling else DRAIN_TIMEOUT_S
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_forever, daemon=True)
        self._reporter.start()
        self._closed = False

    async def limits(self) -> RequestLimits:
        return self.engine.limits

    async def check_blocks(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Blocks in use per pool (0 everywhere when idle), read on the engine thread."""
        fut = self.loop.call(lambda engine: engine.check_blocks())
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    async def blocks_report(self, call: ReplicaCall) -> tuple[str, dict[str, int]]:
        """(this replica's id, ``check_blocks()``); ``call.ranking`` pins the call to one
        replica (``RankedRequestRouter``), so a caller can read each replica in turn."""
        return self.replica_id, await self.check_blocks()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (polled only in an autoscaled group): what
        ``policies.autoscaling.LLMAutoscalingPolicy`` scales on."""
        return ReplicaLoad.of(self.loop.stats()).as_metrics()

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("the engine thread died")
        if not self._reporter.is_alive():
            raise RuntimeError("the reporter thread died")
        failed = self.weights.failed()
        if failed is not None:
            raise RuntimeError(failed)

    def __del__(self) -> None:
        """Serve calls this when the replica stops, after its graceful-shutdown drain (no
        call ongoing, no new ones routed here); Python may call it again later. The engine
        first finishes what it still holds (at most ``drain_timeout_s``), the reporter sends
        its last push and ``leave``s the router, then the engine thread fails whatever is
        left and shuts the engine down (a PDCluster's actors too)."""
        if getattr(self, "_closed", True):  # a second call, or __init__ failed early
            if hasattr(self, "loop"):
                self.loop.shutdown()
            return
        self._closed = True
        if not self.loop.drain(self.drain_timeout_s):
            log.warning("replica %s stops with requests unfinished", self.replica_id)
        self._stop.set()
        self.weights.stop()
        self._reporter.join(timeout=10)
        self.loop.shutdown()

    # -- reporting (its own thread: blocking handle calls never touch the event loop) -----
    def _report_forever(self) -> None:
        first, last_stats, last_metrics, last_push = True, None, None, 0.0
        last_recovering = False
        while not self._stop.is_set():
            self._stop.wait(self.interval)
            resync, events = self.loop.take_events()
            stats = self.loop.stats()
            counters = stats.counters()
            metrics = self.loop.metrics_snapshot()  # a finished request changes only these
            # its worker group restarting (read off the engine thread, which is busy with it)
            recovering = bool(getattr(self.engine, "recovering", False))
            idle = (
                not events
                and resync is None
                and counters == last_stats
                and metrics == last_metrics
                and recovering == last_recovering
            )
            if idle and time.monotonic() - last_push < HEARTBEAT_S:
                continue  # nothing new: only a heartbeat every HEARTBEAT_S
            last_stats, last_metrics, last_push = counters, metrics, time.monotonic()
            last_recovering = recovering
            try:
                need_resync = self.router.report.remote(
                    self.replica_id,
                    self.group,
                    stats,
                    metrics,
                    events,
                    resync,
                    first,
                    recovering,
                ).result(timeout_s=30)
                first = False
                if need_resync:
                    self.loop.request_resync()
            except Exception:  # the router restarts: resend the whole set when it is back
                log.warning("router report failed; will resync", exc_info=True)
                self.loop.request_resync()
        try:  # stopping: the router forgets this replica now, not after its timeout
            self.router.leave.remote(self.replica_id).result(timeout_s=10)
        except Exception:
            log.warning("could not tell the router that %s left", self.replica_id, exc_info=True)


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica actor's caller needs to build and route requests for it."""

    block_size: int
    total_blocks: int
    limits: RequestLimits


class ReplicaActor:
    """A replica as a plain Ray actor (``LLM(model, num_replicas=k)``, rollouts). The
    caller builds the requests and owns routing: it pulls ``report`` (stats and block
    events) into its own RouterState."""

    def __init__(self, model: str | None, config: EngineConfig, max_waiting: int = 1 << 20) -> None:
        from actors.serving.colocated_engine import ColocatedEngine

        self.engine = ColocatedEngine.build(model, config)
        self.loop = EngineLoop(self.engine, max_waiting, config.cpu_cores)

    def ready(self) -> ReplicaInfo:
        e = self.engine
        return ReplicaInfo(e.block_size, e.kv.num_total_blocks, e.limits)

    def placement(self) -> tuple[str, list[str]]:
        """(this actor's Ray node id, its worker actors' node ids by world rank; none for
        a single-worker replica, whose worker runs in this process)."""
        import ray

        workers = getattr(self.engine.executor, "node_ids", [])
        return ray.get_runtime_context().get_node_id(), list(workers)

    async def generate(self, request: Request) -> RequestOutput:
        (out,) = await self.loop.generate([request])
        return out

    async def report(self) -> tuple[ReplicaStats, list[tuple[str, int]], list[int] | None]:
        resync, events = self.loop.take_events()
        return self.loop.stats(), events, resync

    async def update_weights(self, weights: list[Any], abort_in_flight: bool = False) -> int:
        """Load ``weights[0]`` (a list, so that an object ref in it reaches the engine as a
        ref) once the requests running now finish (or end, retriable, with
        ``abort_in_flight``); requests arriving meanwhile wait and run on the new weights.
        Returns the bytes received."""
        (source,) = weights
        fut = self.loop.when_drained(
            lambda engine: engine.update_weights(source), abort_in_flight=abort_in_flight
        )
        return int(await asyncio.wrap_future(fut))

    async def sleep(self, level: int = 1) -> int:
        """Free the KV cache (and the weights, level 2) once the running requests finish;
        requests arriving while asleep wait for ``wake_up``. Returns the bytes freed."""
        fut = self.loop.when_drained(lambda engine: engine.sleep(level), sleep=True)
        return int(await asyncio.wrap_future(fut))

    async def wake_up(self) -> None:
        await asyncio.wrap_future(self.loop.when_drained(lambda e: e.wake_up(), sleep=False))

    def shutdown(self) -> None:
        self.loop.shutdown()
