"""The ingress's event channels (``actors/serving/ingress_channels.py``) when a replica's
channel call ends abnormally: every prompt open on it gets an error (the relay replays it),
none waits forever. The replica deployment is a stand-in whose ``events`` stream the test
ends by hand; Serve cancelling that call is what happened live (a client leaving)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.disagg.return_links import ReturnLinks
from actors.engine.direct_return import ReturnEntry, ReturnRoute
from actors.engine.events import Accepted, Delta, Done
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.ingress_channels import IngressChannels, PromptStream, ReplicaGone
from policies.request import Request, SamplingParams


class Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, msg: Any) -> Any:
        return self.fn(msg)


class StandInReplica:
    """``start`` accepts; ``events`` yields what ``feed`` gets, until ``end`` raises."""

    def __init__(self) -> None:
        self.feed: asyncio.Queue[Any] = asyncio.Queue()
        self.start = Call(self._start)
        self.events = Call(self._events)
        self.abort_prompt = Call(self._abort)
        self.aborted: list[str] = []

    def options(self, **_: Any) -> StandInReplica:
        return self

    async def _start(self, msg: Any) -> Accepted:
        return Accepted("r0")

    async def _events(self, msg: Any) -> Any:
        while True:
            item = await self.feed.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _abort(self, msg: Any) -> None:
        self.aborted.append(msg.key)


def request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), 0, 16, [])


@pytest.mark.parametrize("end", [asyncio.CancelledError, RuntimeError])
def test_a_channel_call_ending_abnormally_fails_its_open_prompts(end):
    async def run() -> list[Any]:
        replica = StandInReplica()
        channels = IngressChannels({"g": replica})
        a, b = PromptStream(1), PromptStream(1)
        await channels.open(a, "g", [request("a")], ["r0"])
        await channels.open(b, "g", [request("b")], ["r0"])
        replica.feed.put_nowait([("a", ["event-1"])])
        first = await asyncio.wait_for(a.__anext__(), 5)
        replica.feed.put_nowait(end())  # the channel's call ends: cancelled, or failed
        outcomes = []
        for stream in (a, b):
            try:
                outcomes.append(await asyncio.wait_for(stream.__anext__(), 5))
            except (ReplicaGone, RuntimeError) as e:
                outcomes.append(type(e))
        return [first, *outcomes]

    first, a_after, b_after = asyncio.run(run())
    assert first == ["event-1"]
    want = ReplicaGone if end is asyncio.CancelledError else RuntimeError
    assert a_after is want and b_after is want  # an error to replay on, not a hang


# -- the direct way back (actors.engine.direct_return) ------------------------------------------
def delta(i: int, *tokens: int) -> Delta:
    return Delta(i, StreamDelta("a", list(tokens), "".join(map(str, tokens)), False))


def done(i: int, *tokens: int) -> Done:
    return Done(i, RequestOutput("a", [1, 2, 3], list(tokens), "", True, "length"))


async def passed_on(stream: PromptStream) -> list[Any]:
    """What the relay would pass on: the stream's events less what the ledger has sent."""
    out: list[Any] = []
    async for events in stream:
        out += [e for e in events if stream.ledger.admit(e) is not None]
    return out


def test_a_replaced_decode_attempt_replays_once_and_an_older_one_is_dropped():
    """Choice 1's first Conductor attempt streams 5, 6 and dies; the second replays 5, 6 and
    goes on; a late event of the first is dropped. The prompt ends once both choices ended,
    with no end marker from the replica's channel."""

    async def run() -> list[Any]:
        channels = IngressChannels({})
        stream = PromptStream(2)
        stream.attempt(channels, "a")
        for index, attempt, events in [
            (1, 1, [delta(1, 5), delta(1, 6)]),
            (0, 1, [delta(0, 9), done(0, 9)]),
            (1, 2, [delta(1, 5)]),
            (1, 1, [delta(1, 66)]),  # the first attempt's, late
            (1, 2, [delta(1, 6), delta(1, 7), done(1, 5, 6, 7)]),
        ]:
            stream.direct(ReturnEntry("a", index, attempt, events))
        return await asyncio.wait_for(passed_on(stream), 5)

    got = asyncio.run(run())
    deltas = [e for e in got if isinstance(e, Delta)]
    tokens = {i: [t for e in deltas if e.index == i for t in e.delta.token_ids] for i in (0, 1)}
    assert tokens == {0: [9], 1: [5, 6, 7]}
    assert [e.index for e in got if isinstance(e, Done)] == [0, 1]


def test_a_decode_replica_writes_frames_straight_to_the_ingress_listener():
    """``ReturnLinks`` (the decode replica's side, blocking, its own thread) writes one
    frame per step to the ingress's ``ReturnListener``; the entries reach their prompt.
    Once the ingress is gone, a write fails and names every request routed there."""

    async def run() -> tuple[list[Any], set[str]]:
        channels = IngressChannels({})
        stream = PromptStream(1)
        stream.attempt(channels, "a")
        channels._streams["a"] = stream
        address = await channels.returns.address()
        links = ReturnLinks(timeout=5)
        route = ReturnRoute(address, "a", 0, "a")
        links.add("a#1", route)
        links.add("b#1", ReturnRoute(address, "b", 0, "b"))  # reserved, nothing sent yet
        out = RequestOutput("a#1", [1, 2, 3], [4, 5], "45", True, "length")
        steps = [
            ([StreamDelta("a#1", [4], "4", False)], {}),
            ([StreamDelta("a#1", [5], "5", True, "length")], {"a#1": out}),
        ]
        for deltas, ends in steps:
            assert await asyncio.to_thread(links.send, deltas, ends) == set()
        got = await asyncio.wait_for(passed_on(stream), 5)
        channels.returns.close()
        await asyncio.sleep(0.1)
        lost: set[str] = set()
        for _ in range(50):  # the closed peer is noticed on a later write
            lost = await asyncio.to_thread(links.send, steps[0][0], {})
            if lost:
                break
        links.close()
        return got, lost

    got, lost = asyncio.run(run())
    assert [e.delta.token_ids for e in got if isinstance(e, Delta)] == [[4], [5]]
    assert all(e.delta.request_id == "a" for e in got if isinstance(e, Delta))
    (end,) = [e for e in got if isinstance(e, Done)]
    assert end.output.request_id == "a" and end.output.token_ids == [4, 5]
    assert lost == {"a#1", "b#1"}
