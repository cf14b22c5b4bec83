"""An event channel's socket (``actors/serving/channel_socket.py``) with real TCP
connections on this machine: batches arrive whole and in order, a connection without the
token does not take the channel, a socket cut inside a frame or a call that fails after
its socket closed fails the reader, a call that carries its batches itself is read as it
is, and closing the reader closes the call."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.engine.direct_return import encode
from actors.serving.channel_socket import ChannelBroken, ChannelListener, channel_batches

pytestmark = pytest.mark.timeout(60)


async def replica_call(
    batches: list[list[Any]], after: BaseException | None = None, cut: bool = False
) -> AsyncIterator[list[Any]]:
    """What a replica's ``events`` call does: the address, then ``batches`` on the socket;
    ``cut`` sends half a frame last; ``after`` is raised once the socket is closed."""
    listener = await ChannelListener.open("127.0.0.1")
    try:
        assert listener.address is not None
        yield [("", listener.address)]
        writer = await listener.accept()
        for batch in batches:
            writer.write(encode(batch))
            await writer.drain()
        if cut:
            writer.write(struct.pack("!I", 100) + b"half")
            await writer.drain()
    finally:
        listener.close()
    if after is not None:
        await asyncio.sleep(0.05)
        raise after


async def read_all(stream: AsyncIterator[list[Any]]) -> list[list[Any]]:
    return [b async for b in channel_batches(stream)]


def test_batches_arrive_whole_and_in_order():
    batches = [[("k1", i), ("k2", "x" * (i * 1000))] for i in range(50)]
    assert asyncio.run(read_all(replica_call(batches))) == batches


def test_a_connection_without_the_token_does_not_take_the_channel():
    async def main() -> list[list[Any]]:
        stream = replica_call([[("k", 1)], [("k", 2)]])
        first = await anext(stream)
        address = first[0][1]
        _, stranger = await asyncio.open_connection(address.host, address.port)
        stranger.write(b"0" * 32)  # the wrong token
        await stranger.drain()

        async def again() -> AsyncIterator[list[Any]]:
            yield first
            async for b in stream:
                yield b

        got = await read_all(again())
        stranger.close()
        return got

    assert asyncio.run(main()) == [[("k", 1)], [("k", 2)]]


def test_a_socket_cut_inside_a_frame_fails_the_reader():
    async def main() -> list[list[Any]]:
        got = []
        with pytest.raises(ChannelBroken, match="inside a frame"):
            async for b in channel_batches(replica_call([[("k", 1)]], cut=True)):
                got.append(b)
        return got

    assert asyncio.run(main()) == [[("k", 1)]]  # what came whole before the cut


def test_a_call_that_fails_after_its_socket_closed_fails_the_reader():
    async def main() -> list[list[Any]]:
        got = []
        call = replica_call([[("k", 1)]], RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            async for b in channel_batches(call):
                got.append(b)
        return got

    assert asyncio.run(main()) == [[("k", 1)]]


def test_a_call_carrying_its_batches_is_read_as_it_is():
    async def inline() -> AsyncIterator[list[Any]]:
        yield [("", "wrong-replica")]
        yield [("k", 3)]

    assert asyncio.run(read_all(inline())) == [[("", "wrong-replica")], [("k", 3)]]


def test_closing_the_reader_closes_the_call():
    async def main() -> bool:
        closed = asyncio.Event()

        async def call() -> AsyncIterator[list[Any]]:
            try:
                async for b in replica_call([[("k", i)] for i in range(3)]):
                    yield b
                await asyncio.sleep(30)  # the channel stays open: nothing more to send
            finally:
                closed.set()

        reader = channel_batches(call())
        assert await anext(reader) == [("k", 0)]
        await reader.aclose()
        await asyncio.wait_for(closed.wait(), 5)
        return closed.is_set()

    assert asyncio.run(main())
