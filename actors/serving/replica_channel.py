"""A replica's event channels: one event stream per ingress, not one per request.

A stream item costs the replica's Python threads (Serve's loops and Ray's serializer) about
the same whatever it carries, and they hold the GIL the engine thread needs between
operators: with one stream per request, 32 streams at one item per engine step slowed a
decode step from 19-21 ms to 25-28 ms here. A channel carries the events of every prompt
one ingress started on this replica: it is that ingress's ``Outlet`` (``open_prompt.py``),
so each engine step hands it one batch, which the engine thread pickles into one frame and
the event loop writes on the channel's socket as is.

    start(StartPrompt)  queue a prompt's choices; answers Accepted or Refused. Its events
                        then go to the channel of its ``ingress``: each frame holds
                        ``(key, events)`` per prompt with events in that step (key: its
                        first choice's request id), the list after its last event ending
                        with None.
    events(OpenChannel) the channel: its frames on a socket of its own
                        (``channel_socket.py``: the call yields the socket's address, then
                        stays open while the frames go on the socket). It ends by itself
                        once nothing of that ingress is live here for ``IDLE_END_S`` (so
                        Serve's graceful drain, which waits for ongoing calls, ends);
                        frames made meanwhile wait for the next ``events`` call. If the
                        call is dropped or the ingress closes its socket, its prompts abort.
    abort_prompt(AbortPrompt)  abort one prompt (its client left).
(The messages: ``messages.py``.)

Invariants: each event of a started prompt is put on its channel exactly once, in order;
None follows its last; a prompt aborted here sends nothing made after the
abort. The prompts'
state is their ``OpenPrompt`` records; a channel only indexes them by key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from actors.engine.direct_return import encode
from actors.engine.events import Refused, Verdict
from actors.serving.channel_socket import ChannelListener
from actors.serving.engine_loop import EngineLoop
from actors.serving.loop_mailbox import LoopMailbox, mailbox_of
from actors.serving.messages import AbortPrompt, OpenChannel, StartPrompt
from actors.serving.open_prompt import Entry, OpenPrompt
from errors import MeridianError

IDLE_END_S = 2.0
WRONG_REPLICA = "wrong-replica"  # an ``events`` call that Serve routed to another replica


class _Channel:
    """One ingress's outlet: its prompts by key, and its frames until a socket takes them."""

    def __init__(self, box: LoopMailbox) -> None:
        self.box = box
        self.prompts: dict[str, OpenPrompt] = {}  # the loop's records, by key
        self.frames: list[bytes] = []  # made while no socket was attached
        self.writer: asyncio.StreamWriter | None = None
        self.wrote = False  # a frame came since the last ``live`` check

    def send(self, batch: list[Entry]) -> None:
        """The engine thread: one step's batch, pickled here, written on the loop."""
        self.box.post(self._write, encode(batch))

    def _write(self, data: bytes) -> None:
        self.wrote = True
        if self.writer is not None:
            self.writer.write(data)
        else:
            self.frames.append(data)

    def attach(self, writer: asyncio.StreamWriter | None) -> None:
        self.writer = writer
        if writer is not None and self.frames:
            writer.write(b"".join(self.frames))
            self.frames = []

    def live(self) -> bool:
        """Whether a prompt of this ingress is still open here (ended ones are dropped from
        the index), or a frame came since the last check."""
        for key in [k for k, p in self.prompts.items() if p.ended]:
            del self.prompts[key]
        wrote, self.wrote = self.wrote, False
        return wrote or bool(self.prompts)


class ReplicaChannels:
    def __init__(self, loop: EngineLoop, replica_id: str, host: str = "127.0.0.1") -> None:
        self.loop = loop
        self.replica_id = replica_id
        self.host = host  # where the channels' sockets listen: this node's address
        self._channels: dict[str, _Channel] = {}

    def _channel(self, ingress: str) -> _Channel:
        channel = self._channels.get(ingress)
        if channel is None:
            box = mailbox_of(asyncio.get_running_loop())  # one wake-up per burst of frames
            channel = self._channels[ingress] = _Channel(box)
        return channel

    async def start(self, msg: StartPrompt) -> Verdict:
        channel = self._channel(msg.ingress)
        aio = asyncio.get_running_loop()
        verdict: asyncio.Future[Verdict] = aio.create_future()
        prompt = OpenPrompt(
            msg.requests,
            channel,
            lambda v: aio.call_soon_threadsafe(verdict.set_result, v),
            reply=msg.reply,
        )
        # Indexed before the engine can answer: its first frames may be written before this
        # coroutine resumes with the verdict.
        channel.prompts[prompt.key] = prompt
        try:
            self.loop.submit(prompt)
        except MeridianError as e:
            channel.prompts.pop(prompt.key, None)
            return Refused.of(e)
        try:
            answer = await verdict
        except BaseException:  # the caller gave up waiting: take it back
            await self.abort_prompt(AbortPrompt(ingress=msg.ingress, key=prompt.key))
            raise
        if isinstance(answer, Refused):  # nothing of it was queued, so no event follows
            channel.prompts.pop(prompt.key, None)
        return answer

    async def abort_prompt(self, msg: AbortPrompt) -> None:
        """No-op for an ended prompt."""
        channel = self._channels.get(msg.ingress)
        prompt = channel.prompts.pop(msg.key, None) if channel is not None else None
        if prompt is not None and not prompt.ended:
            prompt.dropped = True
            self.loop.abort(prompt.ids)

    async def events(self, msg: OpenChannel) -> AsyncIterator[list[tuple[str, Any]]]:
        if msg.replica_id != self.replica_id:
            yield [("", WRONG_REPLICA)]
            return
        channel = self._channel(msg.ingress)
        ended_idle = False
        listener = await ChannelListener.open(self.host)
        writer = None
        try:
            yield [("", listener.address)]
            writer = await listener.accept()
            channel.attach(writer)
            closed = asyncio.ensure_future(listener.wait_closed())
            try:
                while True:
                    done, _ = await asyncio.wait([closed], timeout=IDLE_END_S)
                    if done:  # the ingress closed its end: nobody reads this channel
                        return
                    if not channel.live():
                        ended_idle = True
                        return
            finally:
                closed.cancel()
        finally:
            if writer is not None and channel.writer is writer:  # not a later call's
                channel.attach(None)
            listener.close()
            if not ended_idle and self._channels.get(msg.ingress) is channel:
                for prompt in channel.prompts.values():  # nobody reads them any more
                    prompt.dropped = True
                    self.loop.abort(prompt.ids)
                del self._channels[msg.ingress]
