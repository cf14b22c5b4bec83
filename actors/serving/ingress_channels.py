"""The ingress side of the replicas' event channels (``actors/serving/replica_channel.py``):
one ``events`` stream per replica this ingress has prompts on, fanned out to the prompts.

    channels = IngressChannels(replicas)           # group -> the replica deployment's handle
    stream, first = await channels.open(group, choices, ranking)  # ranking: replica ids
    async for batch in stream: ...                 # lists of events, as the relay reads them
    stream.cancel()                                # an unfinished prompt is aborted

``first`` is the replica's ``Accepted`` or ``Refused``. A replica's events come on its
channel's socket (``channel_socket.py``). When a replica's channel fails (the replica died,
its socket broke, or Serve can no longer route to it), every open stream on it raises
``ReplicaGone``, ``ChannelBroken`` or Ray's error, which the relay answers with a replay.

Invariants: a prompt's queue is registered before its ``start`` call, so no event is lost
to a race with the channel; one pump per replica at a time, and a pump that ends with
prompts still open on its replica subscribes again (the replica keeps their events). Pumps
and aborts run in a context of their own, never as a request's child calls: Serve cancels
a request's child calls when its client leaves, and a pump carries every prompt's events.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import Any

from actors.engine.events import Accepted, Event, Verdict
from actors.serving.channel_socket import channel_batches
from actors.serving.messages import AbortPrompt, OpenChannel, StartPrompt
from actors.serving.replica_channel import WRONG_REPLICA
from actors.serving.router import fresh_serve_internal_request_id
from policies.request import Request

log = logging.getLogger(__name__)


class ReplicaGone(Exception):
    """The replica serving a prompt is gone (its channel cannot be reached)."""


class ChannelStream:
    """One prompt's events: an async iterator of non-empty lists of events, ending after
    its last; what the relay read from a per-request Ray stream before."""

    def __init__(self, owner: IngressChannels, key: str) -> None:
        self.owner = owner
        self.key = key
        self.queue: asyncio.Queue[Event | None | BaseException] = asyncio.Queue()
        self.placed: tuple[str, str] | None = None  # (group, replica id) once accepted
        self.ended = False
        self._error: BaseException | None = None  # raised after the events before it

    def __aiter__(self) -> ChannelStream:
        return self

    async def __anext__(self) -> list[Event]:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self.ended:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        batch: list[Event] = []
        for item in items:
            if isinstance(item, BaseException):
                self.ended = True
                self._error = item
                break
            if item is None:  # after its last event
                self.ended = True
                break
            batch.append(item)
        if batch:
            return batch
        return await self.__anext__()

    def cancel(self) -> None:
        """Stop listening; an unfinished prompt is aborted on its replica."""
        self.owner.forget(self, abort=not self.ended)
        self.ended = True


class IngressChannels:
    def __init__(self, replicas: dict[str, Any]) -> None:
        self.replicas = replicas
        self.ingress_id = uuid.uuid4().hex
        self._streams: dict[str, ChannelStream] = {}  # key -> its stream
        self._pumps: dict[str, asyncio.Task[None]] = {}  # replica id -> its pump
        self._aborts: set[asyncio.Task[None]] = set()

    async def open(
        self, group: str, choices: list[Request], ranking: list[str]
    ) -> tuple[ChannelStream, Verdict]:
        msg = StartPrompt(requests=choices, ingress=self.ingress_id, ranking=tuple(ranking))
        key = msg.key
        stream = ChannelStream(self, key)
        self._streams[key] = stream
        try:
            with fresh_serve_internal_request_id():
                first = await self.replicas[group].start.remote(msg)
        except BaseException:
            self._streams.pop(key, None)
            raise
        if not isinstance(first, Accepted):  # refused: nothing runs
            self._streams.pop(key, None)
            stream.ended = True
            return stream, first
        replica_id = first.replica_id
        stream.placed = (group, replica_id)
        if replica_id not in self._pumps:
            pump = self._pump(group, replica_id)
            self._pumps[replica_id] = asyncio.create_task(pump, context=contextvars.Context())
        return stream, first

    def forget(self, stream: ChannelStream, abort: bool) -> None:
        if self._streams.get(stream.key) is stream:
            del self._streams[stream.key]
        if abort and stream.placed is not None:
            try:
                loop = asyncio.get_running_loop()
                task = loop.create_task(self._abort(stream), context=contextvars.Context())
            except RuntimeError:  # no event loop any more: the process is stopping
                return
            self._aborts.add(task)  # held until done: a dropped task may never run
            task.add_done_callback(self._aborts.discard)

    async def _abort(self, stream: ChannelStream) -> None:
        assert stream.placed is not None
        group, replica_id = stream.placed
        msg = AbortPrompt(ranking=(replica_id,), ingress=self.ingress_id, key=stream.key)
        try:
            with fresh_serve_internal_request_id():
                await asyncio.wait_for(self.replicas[group].abort_prompt.remote(msg), 30)
        except Exception:  # its replica is gone, and the prompt with it
            log.info("could not abort %s on replica %s", stream.key, replica_id, exc_info=True)

    def _open_on(self, replica_id: str) -> list[ChannelStream]:
        return [
            s for s in self._streams.values() if s.placed is not None and s.placed[1] == replica_id
        ]

    async def _pump(self, group: str, replica_id: str) -> None:
        msg = OpenChannel(ranking=(replica_id,), replica_id=replica_id, ingress=self.ingress_id)
        try:
            while True:
                with fresh_serve_internal_request_id():
                    gen = self.replicas[group].options(stream=True).events.remote(msg)
                async for items in channel_batches(gen):
                    for key, item in items:
                        if item == WRONG_REPLICA:
                            raise ReplicaGone(f"replica {replica_id} is gone; retry the request")
                        stream = self._streams.get(key)
                        if stream is not None:
                            stream.queue.put_nowait(item)
                if not self._open_on(replica_id):  # no await since: atomic with open()
                    return
        except Exception as e:  # the replica died: each prompt on it replays
            for stream in self._open_on(replica_id):
                stream.queue.put_nowait(e)
        except asyncio.CancelledError:  # the channel's call, or this pump, was cancelled
            gone = ReplicaGone(f"the event channel of replica {replica_id} was cancelled")
            for stream in self._open_on(replica_id):
                stream.queue.put_nowait(gone)  # each prompt on it replays, none hangs
            raise
        finally:
            self._pumps.pop(replica_id, None)
