"""A request's stream from an engine loop: the loop's ``Accepted`` (naming its replica), then
every event in order, ending with the request's ``Done``."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from engine_doubles import QuietEngineParts

from actors.engine.events import Accepted, Delta, Done
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.engine_loop import EngineLoop

TOKENS = 12


class CountingEngine(QuietEngineParts):
    """Each running request gets one token per step (token i is ``i``) and finishes after
    ``TOKENS``; a step takes 2 ms."""

    block_size = 16
    limits: Any = None

    def __init__(self) -> None:
        self.made: dict[str, int] = {}

    def add_request(self, request: Any) -> str:
        self.made[request.request_id] = 0
        return request.request_id

    def step(self) -> list[StreamDelta]:
        time.sleep(0.002)
        out = []
        for rid, n in list(self.made.items()):
            if n < TOKENS:
                self.made[rid] = n + 1
                done = n + 1 == TOKENS
                out.append(StreamDelta(rid, [n], str(n), done, "length" if done else None))
        return out

    def abort(self, request_id: str) -> None:
        self.made[request_id] = TOKENS

    def release(self, request_id: str) -> RequestOutput:
        del self.made[request_id]
        now = time.monotonic()
        ids = list(range(TOKENS))
        return RequestOutput(request_id, [1], ids, "", True, "length", 0, now, now, now)

    def has_unfinished(self) -> bool:
        return any(n < TOKENS for n in self.made.values())


def test_stream_yields_the_loops_accept_then_every_event_in_order():
    loop = EngineLoop(CountingEngine(), replica_id="r7")  # type: ignore[arg-type]

    async def run() -> list[Any]:
        return [item async for item in loop.stream([SimpleNamespace(request_id="s")])]

    try:
        items = asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        loop.shutdown()
    assert items[0] == Accepted("r7")
    assert [i.delta.token_ids[0] for i in items if isinstance(i, Delta)] == list(range(TOKENS))
    assert isinstance(items[-1], Done) and len(items) == TOKENS + 2
