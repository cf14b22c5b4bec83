"""The ingress side of the replicas' event channels (``actors/serving/replica_channel.py``):
one ``events`` stream per replica this ingress has prompts on, split by prompt.

    channels = IngressChannels(replicas)           # group -> the replica deployment's handle
    prompt = PromptStream(num_choices)             # the one record of an open prompt here
    first = await channels.open(prompt, group, choices, ranking)  # ranking: replica ids
    async for events in prompt: ...                # its part of each frame, as it came
    prompt.cancel()                                # an unfinished attempt is aborted

``first`` is the replica's ``Accepted`` or ``Refused``. A replica's frames come on its
channel's socket (``channel_socket.py``); each frame is one engine step's batch for this
ingress, already one list per prompt, and each list goes to its prompt's queue as it
came: the only queue between the socket and the HTTP response. When a replica's channel fails (the
replica died, its socket broke, or Serve can no longer route to it), every open prompt on
it raises ``ReplicaGone``, ``ChannelBroken`` or Ray's error, which the relay answers with a
replay: ``open`` again with the same record, whose ledger spans the attempts.

A disaggregated group's decode replicas send a prompt's tokens and ``Done``s here
directly (``actors.engine.direct_return``): each ``StartPrompt`` names this ingress's
``ReturnListener``, whose entries go to their prompt's queue too. An entry of an older
Conductor attempt at a choice than one already seen is dropped; a newer attempt's start
makes the ledger count that choice's tokens from its first again (``StreamLedger.restart``),
so a re-placed choice's replayed tokens are dropped as for any replay. Such a prompt's
channel never sends its end: a prompt ends when each of its choices ended (``Done`` or
``Failed``), whichever way that came.

Invariants: a prompt is registered before its ``start`` call, so no event is lost to a
race with the channel; one pump per replica at a time, and a pump that ends with prompts
still open on its replica subscribes again (the replica keeps their frames). Pumps and
aborts run in a context of their own, never as a request's child calls: Serve cancels a
request's child calls when its client leaves, and a pump carries every prompt's events.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from actors.engine.direct_return import ReturnEntry
from actors.engine.events import Accepted, Done, Event, Failed, Verdict
from actors.engine.stream_ledger import StreamLedger
from actors.serving.channel_socket import channel_batches
from actors.serving.messages import AbortPrompt, OpenChannel, StartPrompt
from actors.serving.replica_channel import WRONG_REPLICA
from actors.serving.return_listener import ReturnListener
from actors.serving.router import fresh_serve_internal_request_id
from policies.request import Request

log = logging.getLogger(__name__)


class ReplicaGone(Exception):
    """The replica serving a prompt is gone (its channel cannot be reached)."""


@dataclass(frozen=True)
class _Restart:
    """Choice ``index`` runs again from its first token (a newer Conductor attempt)."""

    index: int


class PromptStream:
    """One open prompt of this ingress, over every attempt at it: which of its choices are
    still open and what its consumer was sent (``ledger``), where the current attempt runs
    and its events. Iterating gives the attempt's events, one list per frame that carried
    any, and ends after its last (or raises the channel's failure)."""

    def __init__(self, num_choices: int) -> None:
        self.num_choices = num_choices
        self.ledger = StreamLedger(num_choices)
        self.owner: IngressChannels | None = None
        self.key = ""  # the current attempt's key (its first choice's request id)
        self.queue: asyncio.Queue[list[Event | _Restart | None] | BaseException] = asyncio.Queue()
        self.placed: tuple[str, str] | None = None  # (group, replica id) once accepted
        self.ended = True  # the current attempt ended (or none started)
        self._closed: set[int] = set()  # choices the current attempt ended
        self._runs: dict[int, int] = {}  # choice -> the newest Conductor attempt seen

    def attempt(self, owner: IngressChannels, key: str) -> None:
        """A new attempt, under ``key``: what the last one left is dropped."""
        self.owner, self.key, self.placed, self.ended = owner, key, None, False
        self.queue = asyncio.Queue()
        self._closed, self._runs = set(), {}

    def direct(self, entry: ReturnEntry) -> None:
        """Events of one choice sent straight here by the replica that made them."""
        newest = self._runs.get(entry.index, 0)
        if entry.attempt < newest:
            return  # an attempt given up on: a newer one runs
        items: list[Event | _Restart | None] = list(entry.events)
        if newest and entry.attempt > newest:
            items.insert(0, _Restart(entry.index))
        self._runs[entry.index] = entry.attempt
        self.queue.put_nowait(items)

    def __aiter__(self) -> PromptStream:
        return self

    async def __anext__(self) -> list[Event]:
        while not self.ended:
            items = await self.queue.get()
            if isinstance(items, BaseException):
                self.ended = True
                raise items
            if items[-1] is None:  # its last event came
                self.ended = True
                items.pop()
            events = self._take(items)
            if events:
                return events
        raise StopAsyncIteration

    def _take(self, items: list[Event | _Restart | None]) -> list[Event]:
        """The events of ``items`` (restarts applied to the ledger); the attempt ends once
        each choice ended."""
        events: list[Event] = []
        for item in items:
            if isinstance(item, _Restart):
                self.ledger.restart(item.index)
                continue
            assert item is not None  # only last, popped
            if isinstance(item, Done | Failed):
                self._closed.add(item.index)
                self.ended = self.ended or len(self._closed) == self.num_choices
            events.append(item)
        return events

    def cancel(self) -> None:
        """Stop listening; an unfinished attempt is aborted on its replica."""
        if self.owner is not None:
            self.owner.forget(self, abort=not self.ended)
        self.ended = True


class IngressChannels:
    def __init__(self, replicas: dict[str, Any], host: str = "127.0.0.1") -> None:
        """``host``: this node's address, where replicas reach ``returns``."""
        self.replicas = replicas
        self.ingress_id = uuid.uuid4().hex
        self.returns = ReturnListener(host, self._direct)
        self._streams: dict[str, PromptStream] = {}  # attempt key -> its prompt
        self._pumps: dict[str, asyncio.Task[None]] = {}  # replica id -> its pump
        self._aborts: set[asyncio.Task[None]] = set()

    async def open(
        self, stream: PromptStream, group: str, choices: list[Request], ranking: list[str]
    ) -> Verdict:
        """Start an attempt of ``stream``'s prompt (``choices``, as built) on ``group``."""
        reply = await self.returns.address()
        msg = StartPrompt(
            requests=choices, ingress=self.ingress_id, ranking=tuple(ranking), reply=reply
        )
        key = msg.key
        stream.attempt(self, key)
        self._streams[key] = stream
        try:
            with fresh_serve_internal_request_id():
                first = await self.replicas[group].start.remote(msg)
        except BaseException:
            self._streams.pop(key, None)
            stream.ended = True
            raise
        if not isinstance(first, Accepted):  # refused: nothing runs
            self._streams.pop(key, None)
            stream.ended = True
            return first
        replica_id = first.replica_id
        stream.placed = (group, replica_id)
        if replica_id not in self._pumps:
            pump = self._pump(group, replica_id)
            self._pumps[replica_id] = asyncio.create_task(pump, context=contextvars.Context())
        return first

    def _direct(self, entry: ReturnEntry) -> None:
        stream = self._streams.get(entry.prompt)
        if stream is not None:  # else ended, or an attempt given up on
            stream.direct(entry)

    def forget(self, stream: PromptStream, abort: bool) -> None:
        if self._streams.get(stream.key) is stream:
            del self._streams[stream.key]
        if abort and stream.placed is not None:
            try:
                loop = asyncio.get_running_loop()
                aborting = self._abort(stream.key, stream.placed)
                task = loop.create_task(aborting, context=contextvars.Context())
            except RuntimeError:  # no event loop any more: the process is stopping
                return
            self._aborts.add(task)  # held until done: a dropped task may never run
            task.add_done_callback(self._aborts.discard)

    async def _abort(self, key: str, placed: tuple[str, str]) -> None:
        group, replica_id = placed
        msg = AbortPrompt(ranking=(replica_id,), ingress=self.ingress_id, key=key)
        try:
            with fresh_serve_internal_request_id():
                await asyncio.wait_for(self.replicas[group].abort_prompt.remote(msg), 30)
        except Exception:  # its replica is gone, and the prompt with it
            log.info("could not abort %s on replica %s", key, replica_id, exc_info=True)

    def _open_on(self, replica_id: str) -> list[PromptStream]:
        return [
            s for s in self._streams.values() if s.placed is not None and s.placed[1] == replica_id
        ]

    async def _pump(self, group: str, replica_id: str) -> None:
        msg = OpenChannel(ranking=(replica_id,), replica_id=replica_id, ingress=self.ingress_id)
        try:
            while True:
                with fresh_serve_internal_request_id():
                    gen = self.replicas[group].options(stream=True).events.remote(msg)
                async for batch in channel_batches(gen):
                    for key, events in batch:  # one entry per prompt
                        if events == WRONG_REPLICA:
                            raise ReplicaGone(f"replica {replica_id} is gone; retry the request")
                        stream = self._streams.get(key)
                        if stream is not None:
                            stream.queue.put_nowait(events)
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
