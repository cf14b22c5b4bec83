"""From the ingress to a replica and back: route one prompt (through the client's region
balancer when the config has regions, else the router's ranking), start its choices on the
chosen replica and relay its events (from the replica's event channel for this ingress,
``ingress_channels.py``), replaying the prompt on another replica when its replica dies
mid-request (``StreamLedger``: every token at most once).

    relay = ReplicaRelay(cfg, router, replicas, balancers)
    stream = relay.start(choices, session, region)  # Accepted, then lists of events
    async for pi, events in merge_prompts(streams): ...  # one response's prompts

After ``Accepted``, each item is the events one frame of the replica's channel carried
for this prompt, less what the ledger already passed on: the list the ingress writes.
"""

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from actors.engine.events import Accepted, Delta, Event, Failed, Refused
from actors.engine.stream_ledger import ReplayDiverged
from actors.serving import openai_protocol as oai
from actors.serving.channel_socket import ChannelBroken
from actors.serving.config import ServeConfig
from actors.serving.ingress_channels import IngressChannels, PromptStream, ReplicaGone
from actors.serving.region_entry import RegionEntry
from policies.region_balancer import BalancedRequest
from policies.request import Request
from policies.routing import RouteRequest

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # per prompt: the first run and two replays on another replica
# died mid-request, or its channel broke
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaGone, ChannelBroken)


async def merge_prompts(
    streams: list[AsyncIterator[Accepted | list[Event]]],
) -> AsyncGenerator[tuple[int, list[Event]], None]:
    """(prompt index, events) as each prompt's relay gives them, after their ``Accepted``;
    a prompt whose relay raises ends with ``Failed(-1, why)``. One prompt (the usual case)
    is read directly; several share one queue, the only one between them and the response."""
    if len(streams) == 1:
        try:
            async for events in streams[0]:
                if isinstance(events, list):
                    yield 0, events
        except Exception as e:
            yield 0, [Failed(-1, str(e))]
        return
    q: asyncio.Queue[tuple[int, list[Event] | None]] = asyncio.Queue()

    async def pump(pi: int, s: AsyncIterator[Accepted | list[Event]]) -> None:
        try:
            async for item in s:
                if isinstance(item, list):
                    q.put_nowait((pi, item))
        except Exception as e:
            q.put_nowait((pi, [Failed(-1, str(e))]))
        finally:
            q.put_nowait((pi, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            pi, got = await q.get()
            if got is None:
                live -= 1
            else:
                yield pi, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class _Placed:
    """Where a region balancer placed one attempt of a prompt."""

    request_id: str
    replica_id: str
    group: str
    region: str  # the region that serves it (the client's, or a peer's)
    delay: float  # one-way injected delay to that region, seconds


def retry_after_header(seconds: float | None, cfg: ServeConfig) -> str:
    """Whole seconds, rounded up, at least 1; the config's default when none was given."""
    if seconds is None:
        return str(cfg.limits.retry_after_s)
    return str(max(1, math.ceil(seconds)))


class ReplicaRelay:
    def __init__(
        self,
        cfg: ServeConfig,
        router: Any,
        replicas: dict[str, Any],
        balancers: dict[str, Any] | None = None,  # region -> its balancer (regions section)
        host: str = "127.0.0.1",  # this node's address: where replicas send direct events
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.replicas = replicas
        self.balancers = balancers or {}
        self.channels = IngressChannels(replicas, host)
        self.entry = (
            RegionEntry(self.balancers, cfg.regions.delays())
            if self.balancers and cfg.regions
            else None
        )

    async def start(
        self, choices: list[Request], session: str | None, region: str | None = None
    ) -> AsyncIterator[Accepted | list[Event]]:
        """Route one prompt (the built request of each of its choices) and relay its replica
        stream; the first item is ``Accepted``, then non-empty lists of events.

        A replica that dies mid-request (or fails a choice retriably) costs a replay, not
        the request: the prompt is routed again, up to ``MAX_ATTEMPTS`` in all, and the
        replay continues each stream where its consumer stopped (``StreamLedger``: no
        token twice, and a replay that differs ends its choices with a retriable error).
        With regions, each attempt's balancer hears when it prefilled and when it ended.

        Raises APIError (before the first yield) when the replica refuses it."""
        prompt = PromptStream(len(choices))
        first, placed = await self._open(prompt, choices, session, region)
        ledger = prompt.ledger
        attempt = 1
        while True:
            reason = None
            prefilled = placed is None
            passed: list[Event] = []  # of the frame being read: what the consumer gets
            try:
                if attempt == 1:
                    yield first  # in the try: a consumer that stops here aborts the prompt
                async for events in prompt:  # this prompt's part of one channel frame
                    for item in events:
                        if not prefilled and isinstance(item, Delta) and item.delta.token_ids:
                            prefilled = True
                            assert placed is not None
                            await asyncio.sleep(placed.delay)  # the way back
                            await self._report(placed, "prefilled")
                        if isinstance(item, Failed) and item.retriable and attempt < MAX_ATTEMPTS:
                            reason = item.message
                            break
                        if ledger.admit(item) is not None:
                            passed.append(item)
                    if passed:
                        yield passed
                        passed = []
                    if reason is not None:
                        break
            except REPLICA_GONE as e:
                if attempt >= MAX_ATTEMPTS:
                    raise
                reason = f"{type(e).__name__}: {e}"
            except ReplayDiverged as e:
                yield [
                    *passed,
                    *(Failed(i, f"{e}; retry the request") for i in ledger.open_choices()),
                ]
                return
            finally:
                prompt.cancel()  # no-op when ended; aborts the replica's attempt otherwise
                if placed is not None:
                    await self._report(placed, "finished")
            if reason is None or not ledger.open_choices():
                return
            attempt += 1
            log.warning("replaying %s (attempt %d): %s", choices[0].request_id, attempt, reason)
            retry = [c.with_id(f"{c.request_id}#{attempt}") for c in choices]
            try:
                _, placed = await self._open(prompt, retry, session, region)
            except oai.APIError as e:
                why = f"its replica failed and a retry was refused: {e.message}"
                yield [Failed(i, why) for i in ledger.open_choices()]
                return
            ledger.begin_replay()

    async def _open(
        self, prompt: PromptStream, choices: list[Request], session: str | None, region: str | None
    ) -> tuple[Accepted, _Placed | None]:
        """Route the choices of one prompt (through the client's region balancer when the
        config has regions) and start them on a replica as an attempt of ``prompt``: (its
        ``Accepted``, where a balancer placed it). Raises APIError when refused."""
        first_choice = choices[0]
        placed = await self._place(first_choice, session, region) if self.balancers else None
        if placed is None:
            route_req = RouteRequest(
                first_choice.request_id,
                first_choice.block_hashes,
                first_choice.num_prompt_tokens,
                session,
            )
            pairs = await self.router.route.remote(route_req)
            group = pairs[0][1] if pairs else self.cfg.groups[0].name
            ranking = [rid for rid, g in pairs if g == group]
        else:  # a region's balancer queued it and chose the replica (maybe in a peer region)
            group, ranking = placed.group, [placed.replica_id]
            await asyncio.sleep(placed.delay)  # the injected way to the serving region
        try:
            first = await self.channels.open(prompt, group, choices, ranking)
        except BaseException:
            if placed is not None:
                await self._report(placed, "finished")
            else:
                self._tell_router(route_req, ranking, None)
            raise
        if placed is None:
            runs_on = first.replica_id if isinstance(first, Accepted) else None
            self._tell_router(route_req, ranking, runs_on)
        if isinstance(first, Refused):
            if placed is not None:
                await self._report(placed, "finished")
            headers = None
            if first.status == 429:
                headers = {"Retry-After": retry_after_header(first.retry_after, self.cfg)}
            param = "prompt" if first.status == 400 else None
            raise oai.APIError(first.status, first.message, param, headers=headers)
        return first, placed

    def _tell_router(self, request: RouteRequest, ranking: list[str], runs_on: str | None) -> None:
        """The router recorded ``request`` on ``ranking[0]``. When it runs on another replica
        (the replica deployment's ``RankedRequestRouter`` passed over a full first) or
        nowhere (refused, or its start failed), the router moves or drops that record now.
        Not awaited, and outside the request's context: it neither delays the request nor
        is cancelled when the client leaves."""
        if ranking and runs_on != ranking[0]:
            contextvars.Context().run(self.router.moved.remote, request, ranking[0], runs_on)

    async def _place(self, request: Request, session: str | None, region: str | None) -> _Placed:
        """Where the client's region balancer (``X-Meridian-Region``; default: the first
        region) placed the request."""
        assert self.entry is not None
        region = region or self.entry.default_region
        if region not in self.balancers:
            raise oai.APIError(
                400,
                f"unknown region {region!r} in X-Meridian-Region; regions: "
                f"{', '.join(self.balancers)}",
                "X-Meridian-Region",
            )
        meta = BalancedRequest(
            request.request_id,
            tuple(request.block_hashes),
            time.monotonic(),
            session,
            request.tenant,
            region,
        )
        replica_id, group, served_in, delay = await self.entry.place(meta, region)
        return _Placed(request.request_id, replica_id, group, served_in, delay)

    async def _report(self, placed: _Placed, event: str) -> None:
        assert self.entry is not None
        await self.entry.report(placed.region, event, placed.request_id)
