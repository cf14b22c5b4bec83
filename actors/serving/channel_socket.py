"""An event channel's bytes on a TCP socket of its own, beside the Serve call that opened it.

A Serve streaming call costs both processes about 0.8 ms of CPU per item in Serve's and Ray's
streaming path (two Serve replicas at 60 items a second: 0.04-0.06 cores each above idle);
the same items framed on a socket cost nothing measurable above idle. So a replica's
``events`` call yields one item only, ``[("", ChannelAddress)]``; the ingress connects to
it, and the channel's batches follow on that connection, each one frame: a 4-byte
big-endian length, then the batch pickled. The Serve call stays open as the channel's
lifetime: it ends after the replica closed the socket (idle end), and it fails when the
replica dies; cancelling it aborts what the channel carried.

    replica:  listener = await ChannelListener.open(host)
              yield [("", listener.address)]
              writer = await listener.accept()          # the ingress's connection
              writer.write(encode(batch)) ...           # any thread pickles: ``encode``
              await listener.wait_closed()              # the ingress closed it (or went)
              listener.close()
    ingress:  async for batch in channel_batches(stream): ...

Invariants: a listener accepts one connection, the one that presents its token first; a
batch is read whole or the channel fails (``ChannelBroken``); the reader sees the
socket's end only after every batch sent before it; a call's stream that carries batches
itself (no address) is read as it is.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from actors.engine.direct_return import FRAME_LENGTH, TOKEN_BYTES

ACCEPT_TIMEOUT_S = 30.0  # the ingress connects right after it reads the address


class ChannelBroken(Exception):
    """The channel's socket closed in the middle of a batch, or could not be reached."""


@dataclass(frozen=True)
class ChannelAddress:
    host: str
    port: int
    token: bytes  # what the ingress sends first, so no other connection takes the channel


class ChannelListener:
    """One channel's server socket: accepts the ingress's one connection."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.token = uuid.uuid4().hex.encode()
        assert len(self.token) == TOKEN_BYTES
        self._conn: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )
        self._server: asyncio.Server | None = None
        self.address: ChannelAddress | None = None

    @classmethod
    async def open(cls, host: str) -> ChannelListener:
        listener = cls(host)
        listener._server = await asyncio.start_server(listener._connected, host, 0)
        port = int(listener._server.sockets[0].getsockname()[1])
        listener.address = ChannelAddress(host, port, listener.token)
        return listener

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), ACCEPT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            token = b""
        if token != self.token or self._conn.done():
            writer.close()
            return
        self._conn.set_result((reader, writer))
        if self._server is not None:
            self._server.close()  # one connection per channel

    async def accept(self) -> asyncio.StreamWriter:
        """The ingress's connection; ``ChannelBroken`` if none came in time."""
        try:
            _, writer = await asyncio.wait_for(asyncio.shield(self._conn), ACCEPT_TIMEOUT_S)
        except TimeoutError as e:
            raise ChannelBroken(f"no ingress connected within {ACCEPT_TIMEOUT_S} s") from e
        return writer

    async def wait_closed(self) -> None:
        """Until the ingress closes its end of the accepted connection (it sends nothing
        after its token) or the connection fails."""
        reader, _ = await asyncio.shield(self._conn)
        try:
            while await reader.read(1 << 12):
                pass
        except ConnectionError:
            pass

    def close(self) -> None:
        """Stop listening and close the connection (what was sent is still delivered)."""
        if self._server is not None:
            self._server.close()
        if self._conn.done() and not self._conn.cancelled():
            self._conn.result()[1].close()
        else:
            self._conn.cancel()


async def _read_socket(address: ChannelAddress) -> AsyncIterator[list[Any]]:
    try:
        reader, writer = await asyncio.open_connection(address.host, address.port)
    except OSError as e:
        raise ChannelBroken(f"cannot reach the channel at {address.host}:{address.port}") from e
    try:
        writer.write(address.token)
        while True:
            try:
                head = await reader.readexactly(FRAME_LENGTH.size)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise ChannelBroken("the channel closed inside a frame") from e
                return  # the replica closed it between batches
            (size,) = FRAME_LENGTH.unpack(head)
            try:
                data = await reader.readexactly(size)
            except asyncio.IncompleteReadError as e:
                raise ChannelBroken("the channel closed inside a frame") from e
            yield pickle.loads(data)
    except ConnectionError as e:
        raise ChannelBroken(f"the channel's connection failed: {e}") from e
    finally:
        writer.close()


async def channel_batches(stream: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
    """The batches of an ``events`` call's ``stream``: from the socket its first item names,
    or as the stream carries them. Ends when the call ends; raises what the call raises."""
    first = await anext(stream, None)
    if first is None:
        return
    address = first[0][1] if len(first) == 1 and first[0][0] == "" else None
    if not isinstance(address, ChannelAddress):
        yield first
        async for batch in stream:
            yield batch
        return
    # The rest of the call runs beside the socket: its end, or its error, comes after.
    rest = asyncio.ensure_future(anext(stream, None))
    rest.add_done_callback(_retrieve)
    try:
        async for batch in _read_socket(address):
            yield batch
        if await rest is not None:
            raise ChannelBroken("an events call sent a stream item after its socket's address")
    finally:
        # Not awaited here: an await on a cancelled task in an async generator's ``finally``
        # while it closes leaves it marked running on Python 3.11. Cancelling ``rest``
        # cancels the call (a Serve call's request; a local generator's ``finally``).
        rest.cancel()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen by the reader above if it waited; never logged as lost
