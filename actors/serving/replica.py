"""Model replicas on Ray: the Serve replica deployment, and a plain Ray actor for the
Python API and rollouts. Both run one engine in an ``EngineLoop`` thread: a
``ReplicaController`` (``ColocatedEngine``), or for a disaggregated group of the Serve
config a ``PDCluster`` of prefill and decode replica actors (``PDEngine``) that the Serve
replica owns and shuts down when it stops.

Replica -> router: a reporter thread pushes the replica's block stored/evicted events,
stats and metrics to the router deployment every ``report_interval_s`` (sooner never,
later only if the router is slow). Each push waits for the previous one, so the router
applies one replica's events in the order they happened.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from actors.engine.sampling import SamplingParams
from actors.serving.config import ReplicaGroupConfig, ServeConfig
from actors.serving.engine_loop import ColocatedEngine, EngineLoop, ServingEngine
from errors import InvalidRequestError, MeridianError

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # an idle replica still reports this often (the router expires the silent)


def _params(raw: list[dict[str, Any]]) -> list[SamplingParams]:
    return [SamplingParams(**p) for p in raw]


def _engine(model: str | None, group: ReplicaGroupConfig, replica_id: str) -> ServingEngine:
    if group.disaggregated:
        from actors.disagg.engine import PDEngine

        return PDEngine.for_group(model, group, replica_id)
    return ColocatedEngine(model, **group.engine_options())


class ReplicaServer:
    """The Serve replica deployment (one per replica group).

    ``generate(payload)`` is a streaming method; the payload is a dict with
    ``prompt_token_ids``, ``params`` (SamplingParams fields per choice), ``salt`` and
    ``ranking`` (read by ``RankedRequestRouter``). It yields ``("accepted", replica id)``
    once the engine took the request, then the ``EngineLoop`` items; a request the replica
    refuses yields one ``("refused", http status, message, retry_after seconds or None)``
    item instead (400 bad input, 429 overloaded or rejected by the Conductor, 503 failed).
    """

    def __init__(self, config: dict[str, Any], group: str, router: Any) -> None:
        from ray import serve

        cfg = ServeConfig.model_validate(config)
        (g,) = [x for x in cfg.groups if x.name == group]
        self.group = group
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = _engine(cfg.model, g, self.replica_id)
        self.loop = EngineLoop(self.engine, cfg.limits.max_waiting_per_replica)
        self.router = router
        self.interval = cfg.report_interval_s
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_forever, daemon=True)
        self._reporter.start()

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[tuple]:
        try:
            params = _params(payload["params"])
            stream = self.loop.stream(payload["prompt_token_ids"], params, payload.get("salt"))
            first = await stream.__anext__()  # validates and queues, or raises
        except MeridianError as e:  # bad input (400), overloaded (429), failed (503)
            yield ("refused", e.http_status, str(e), getattr(e, "retry_after", None))
            return
        assert first[0] == "accepted"
        yield ("accepted", self.replica_id)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # aborts whatever still runs (client gone, cancelled)

    async def check_blocks(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Blocks in use per pool (0 everywhere when idle), read on the engine thread."""
        fut = self.loop.call(lambda engine: engine.check_blocks())
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    def check_health(self) -> None:
        if not self.loop.is_alive():
            raise RuntimeError("the engine thread died")
        if not self._reporter.is_alive():
            raise RuntimeError("the reporter thread died")

    def __del__(self) -> None:
        """Serve calls this when the replica stops (Python may again later): the engine
        thread fails what still runs and shuts the engine down (a PDCluster's actors too)."""
        self._stop.set()
        if hasattr(self, "loop"):  # not when __init__ failed before the engine started
            self.loop.shutdown()

    # -- reporting (its own thread: blocking handle calls never touch the event loop) -----
    def _report_forever(self) -> None:
        first, last_stats, last_push = True, None, 0.0
        while not self._stop.is_set():
            self._stop.wait(self.interval)
            resync, events = self.loop.take_events()
            stats = self.loop.stats()
            counters = {k: v for k, v in stats.items() if k != "time"}
            idle = not events and resync is None and counters == last_stats
            if idle and time.monotonic() - last_push < HEARTBEAT_S:
                continue  # nothing new: only a heartbeat every HEARTBEAT_S
            last_stats, last_push = counters, time.monotonic()
            try:
                need_resync = self.router.report.remote(
                    self.replica_id,
                    self.group,
                    stats,
                    self.loop.metrics_snapshot(),
                    events,
                    resync,
                    first,
                ).result(timeout_s=30)
                first = False
                if need_resync:
                    self.loop.request_resync()
            except Exception:  # the router restarts: resend the whole set when it is back
                log.warning("router report failed; will resync", exc_info=True)
                self.loop.request_resync()


class ReplicaActor:
    """A replica as a plain Ray actor (``LLM(model, num_replicas=k)``, rollouts). The
    caller owns routing: it pulls ``take_events`` / ``stats`` into its own RouterState."""

    def __init__(
        self, model: str | None, engine_options: dict[str, Any], max_waiting: int = 1 << 20
    ) -> None:
        self.engine = ColocatedEngine(model, **engine_options)
        self.loop = EngineLoop(self.engine, max_waiting)

    def ready(self) -> dict[str, Any]:
        return {"block_size": self.engine.block_size, "total_blocks": self.engine.num_blocks}

    def validate(self, token_lists: list[list[int]], params: list[SamplingParams]) -> None:
        """Raise InvalidRequestError naming the first prompt that can never run here."""
        for i, (tokens, p) in enumerate(zip(token_lists, params, strict=True)):
            try:
                self.engine.validate(tokens, p)
            except InvalidRequestError as e:
                raise type(e)(f"prompt {i}: {e}") from None

    async def generate(
        self, prompt_token_ids: list[int], params: list[SamplingParams], salt: str | None
    ) -> list[Any]:
        return await self.loop.generate(prompt_token_ids, params, salt)

    async def report(self) -> tuple[dict[str, Any], list[tuple[str, int]], list[int] | None]:
        resync, events = self.loop.take_events()
        return self.loop.stats(), events, resync

    def shutdown(self) -> None:
        self.loop.shutdown()
