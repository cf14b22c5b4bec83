"""A replica's event channels: one event stream per ingress, not one per request.

A stream item costs the replica's Python threads (Serve's loops and Ray's serializer) about
the same whatever it carries, and they hold the GIL the engine thread needs between
operators: with one stream per request, 32 streams at one item per engine step slowed a
decode step from 19-21 ms to 25-28 ms here. A channel carries the events of every request
one ingress started on this replica, one item per wake-up of the event loop.

    start(StartPrompt)  queue a prompt's choices; answers Accepted or Refused. Its events
                        then go to the channel of its ``ingress``, tagged with the prompt's
                        key (its first choice's request id), and its last event is
                        followed by ``(key, None)``.
    events(OpenChannel) the channel: lists of ``(key, event)``, one per loop wake-up, on a
                        socket of its own (``channel_socket.py``: the call yields the
                        socket's address, then stays open while the lists go on the
                        socket). It ends by itself once nothing of that ingress is live
                        here for ``IDLE_END_S`` (so Serve's graceful drain, which waits
                        for ongoing calls, ends); events queued meanwhile wait for the
                        next ``events`` call. If the call is dropped or its socket fails
                        otherwise (the ingress died), its requests abort.
    abort(AbortPrompt)  abort one prompt (its client left).
(The messages: ``messages.py``.)

Invariants: each event of a started prompt is put on its channel exactly once, in order;
``(key, None)`` follows its last; a prompt aborted here sends nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from actors.engine.events import Accepted, Delta, Event, Refused, Verdict
from actors.serving.channel_socket import ChannelListener, send_batch
from actors.serving.engine_loop import EngineLoop
from actors.serving.loop_mailbox import mailbox_of
from actors.serving.messages import AbortPrompt, OpenChannel, StartPrompt
from errors import MeridianError

IDLE_END_S = 2.0
WRONG_REPLICA = "wrong-replica"  # an ``events`` call that Serve routed to another replica


@dataclass
class _Channel:
    queue: asyncio.Queue[tuple[str, Event]] = field(default_factory=asyncio.Queue)
    live: dict[str, list[str]] = field(default_factory=dict)  # key -> its request ids
    remaining: dict[str, int] = field(default_factory=dict)  # key -> choices not ended


class ReplicaChannels:
    def __init__(self, loop: EngineLoop, replica_id: str, host: str = "127.0.0.1") -> None:
        self.loop = loop
        self.replica_id = replica_id
        self.host = host  # where the channels' sockets listen: this node's address
        self._channels: dict[str, _Channel] = {}

    def _channel(self, ingress: str) -> _Channel:
        return self._channels.setdefault(ingress, _Channel())

    async def start(self, msg: StartPrompt) -> Verdict:
        requests, key = msg.requests, msg.key
        channel = self._channel(msg.ingress)
        aio = asyncio.get_running_loop()
        box = mailbox_of(aio)  # one loop wake-up per burst of events, for every request
        verdict: asyncio.Future[Verdict] = aio.create_future()

        def sink(item: Verdict | Event) -> None:  # the engine thread
            if isinstance(item, Accepted | Refused):
                aio.call_soon_threadsafe(verdict.set_result, item)
            else:
                box.post(channel.queue, (key, item))

        # Live before the engine can answer: its first events may reach ``events`` before
        # this coroutine resumes with the verdict (a mailbox flush scheduled earlier).
        channel.live[key] = [r.request_id for r in requests]
        channel.remaining[key] = len(requests)
        try:
            self.loop.submit(requests, sink)
        except MeridianError as e:
            channel.live.pop(key, None)
            channel.remaining.pop(key, None)
            return Refused.of(e)
        try:
            answer = await verdict
        except BaseException:  # the caller gave up waiting: take it back
            self.abort(AbortPrompt(ingress=msg.ingress, key=key))
            raise
        if isinstance(answer, Refused):  # nothing of it was queued, so no event follows
            channel.live.pop(key, None)
            channel.remaining.pop(key, None)
        return answer

    def abort(self, msg: AbortPrompt) -> None:
        """No-op for an ended prompt."""
        channel = self._channels.get(msg.ingress)
        if channel is not None and msg.key in channel.live:
            channel.remaining.pop(msg.key, None)
            self.loop.abort(channel.live.pop(msg.key))

    async def events(self, msg: OpenChannel) -> AsyncIterator[list[tuple[str, Any]]]:
        if msg.replica_id != self.replica_id:
            yield [("", WRONG_REPLICA)]
            return
        channel = self._channel(msg.ingress)
        ended_idle = False
        listener = await ChannelListener.open(self.host)
        try:
            yield [("", listener.address)]
            writer = await listener.accept()
            while True:
                try:
                    first = await asyncio.wait_for(channel.queue.get(), IDLE_END_S)
                except TimeoutError:
                    if not channel.live and channel.queue.empty():
                        ended_idle = True
                        return
                    continue
                ready = [first]
                while not channel.queue.empty():
                    ready.append(channel.queue.get_nowait())
                out: list[tuple[str, Event | None | str]] = []
                for key, item in ready:
                    if key not in channel.remaining:
                        continue  # aborted here: its client is gone
                    out.append((key, item))
                    if not isinstance(item, Delta):  # Done or Failed: one choice ended
                        channel.remaining[key] -= 1
                        if channel.remaining[key] == 0:
                            del channel.remaining[key]
                            del channel.live[key]
                            out.append((key, None))
                if out:
                    await send_batch(writer, out)
        finally:
            listener.close()
            if not ended_idle:  # nobody reads this channel any more
                for ids in channel.live.values():
                    self.loop.abort(ids)
                self._channels.pop(msg.ingress, None)
