"""Model replicas on Ray: the Serve replica deployment, and a plain Ray actor for the
Python API and rollouts. Both run one ``ReplicaController`` in an ``EngineLoop`` thread.

Replica -> router: a reporter thread pushes the replica's block stored/evicted events,
stats and metrics to the router deployment every ``report_interval_s`` (sooner never,
later only if the router is slow). Each push waits for the previous one, so the router
applies one replica's events in the order they happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from actors.replica_controller import ReplicaController
from actors.sampling import SamplingParams
from actors.serve_config import ServeConfig
from actors.serve_engine import EngineLoop, OverloadedError
from errors import InvalidRequestError

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0  # an idle replica still reports this often (the router expires the silent)


def _params(raw: list[dict[str, Any]]) -> list[SamplingParams]:
    return [SamplingParams(**p) for p in raw]


class ReplicaServer:
    """The Serve replica deployment (one per replica group).

    ``generate(payload)`` is a streaming method; the payload is a dict with
    ``prompt_token_ids``, ``params`` (SamplingParams fields per choice), ``salt`` and
    ``ranking`` (read by ``RankedRequestRouter``). It yields ``("accepted", replica id)``
    first, then the ``EngineLoop`` items; a request refused before queueing yields one
    ``("refused", http status, message)`` item instead.
    """

    def __init__(self, config: dict[str, Any], group: str, router: Any) -> None:
        from ray import serve

        cfg = ServeConfig.model_validate(config)
        (g,) = [x for x in cfg.groups if x.name == group]
        self.group = group
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = ReplicaController(cfg.model, **g.engine_options())
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
        except InvalidRequestError as e:
            yield ("refused", 400, str(e))
            return
        except OverloadedError as e:
            yield ("refused", 429, str(e))
            return
        assert first[0] == "accepted"
        yield ("accepted", self.replica_id)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # aborts whatever still runs (client gone, cancelled)

    def check_health(self) -> None:
        if not self.loop._thread.is_alive():
            raise RuntimeError("the engine thread died")
        if not self._reporter.is_alive():
            raise RuntimeError("the reporter thread died")

    def __del__(self) -> None:
        self._stop.set()
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
        self.engine = ReplicaController(model, **engine_options)
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
