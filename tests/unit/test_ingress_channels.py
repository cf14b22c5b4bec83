"""The ingress's event channels (``actors/serving/ingress_channels.py``) when a replica's
channel call ends abnormally: every prompt open on it gets an error (the relay replays it),
none waits forever. The replica deployment is a stand-in whose ``events`` stream the test
ends by hand; Serve cancelling that call is what happened live (a client leaving)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.engine.events import Accepted
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
