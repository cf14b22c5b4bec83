"""The engine thread of a replica survives what one request does to it: a request the
engine cannot release fails alone (retriable) while the next one is served; a bug that
escapes the loop fails every request it held and refuses new ones, never leaving a stream
waiting forever."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from engine_doubles import QuietEngineParts

from actors.engine.events import Done, Failed
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.engine_loop import EngineLoop
from errors import EngineUnavailableError


class FakeEngine(QuietEngineParts):
    """Each request finishes after one step with one token; ``bad_release`` ids raise in
    ``release``; ``explode`` makes ``has_unfinished`` raise (a bug in the loop's path)."""

    block_size = 16
    limits: Any = None

    def __init__(self) -> None:
        self.running: list[str] = []
        self.done: set[str] = set()
        self.bad_release: set[str] = set()
        self.explode = False
        self.stall = False  # steps produce nothing: requests stay running
        self.shut_down = False

    def add_request(self, request: Any) -> str:
        self.running.append(request.request_id)
        return request.request_id

    def step(self) -> list[StreamDelta]:
        if self.stall:
            time.sleep(0.01)
            return []
        out = [StreamDelta(rid, [7], "x", True, "length") for rid in self.running]
        self.done.update(self.running)
        self.running = []
        return out

    def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running.remove(request_id)
        self.done.add(request_id)
        self.bad_release.discard(request_id)  # aborted: now it can be released

    def release(self, request_id: str) -> RequestOutput:
        if request_id in self.bad_release:
            raise ValueError(f"request {request_id!r} has not finished")
        self.done.discard(request_id)
        now = time.monotonic()
        return RequestOutput(request_id, [1], [7], "x", True, "length", 0, now, now, now)

    def has_unfinished(self) -> bool:
        if self.explode:
            raise RuntimeError("a bug")
        return bool(self.running)

    def shutdown(self) -> None:
        self.shut_down = True

    def check_blocks(self) -> dict[str, int]:
        return {}


def request(rid: str) -> Any:
    return SimpleNamespace(request_id=rid)


async def ends(loop: EngineLoop, rid: str) -> list[Any]:
    return [item async for item in loop.stream([request(rid)]) if isinstance(item, Done | Failed)]


def test_a_request_that_cannot_be_released_fails_alone():
    engine = FakeEngine()
    engine.bad_release.add("bad")
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    try:
        (end,) = asyncio.run(asyncio.wait_for(ends(loop, "bad"), 10))
        assert isinstance(end, Failed) and "retry" in end.message
        (end,) = asyncio.run(asyncio.wait_for(ends(loop, "good"), 10))
        assert isinstance(end, Done) and end.output.token_ids == [7]
        assert loop.is_alive()
    finally:
        loop.shutdown()


def test_a_bug_in_the_loop_fails_what_it_held_and_refuses_new_requests():
    engine = FakeEngine()
    engine.stall = True
    loop = EngineLoop(engine)  # type: ignore[arg-type]

    async def run() -> None:
        stream = loop.stream([request("held")])
        await anext(stream)  # accepted
        engine.explode = True  # the next pass of the loop raises
        rest = [item async for item in stream]
        assert len(rest) == 1 and isinstance(rest[0], Failed)
        assert "retry" in rest[0].message

    try:
        asyncio.run(asyncio.wait_for(run(), 10))
        deadline = time.monotonic() + 10
        while loop.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.is_alive() and engine.shut_down
        with pytest.raises(EngineUnavailableError):
            asyncio.run(asyncio.wait_for(ends(loop, "late"), 10))
    finally:
        loop.shutdown()
