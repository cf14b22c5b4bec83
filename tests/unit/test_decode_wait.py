"""Waiting for decode room instead of a 429: the FIFO policy (``policies.decode_wait``), the
cluster's use of it (``actors.disagg.decode_waits``) over a fake placement, and an
``EngineLoop`` that defers a waiting request's verdict until it is placed or refused."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from engine_doubles import QuietEngineParts

from actors.disagg.conductor import RequestRejected
from actors.disagg.decode_waits import DecodeWaits
from actors.disagg.pd_request import PDRequest
from actors.disagg.request_table import RequestTable
from actors.engine.events import Accepted, Delta, Done, Refused
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.engine_loop import EngineLoop
from errors import OverloadedError
from policies.decode_wait import DecodeWaitQueue
from policies.request import Request, SamplingParams

# -- the policy -------------------------------------------------------------------------------


def test_only_decode_room_waits_and_only_within_the_count_bound():
    q = DecodeWaitQueue(max_wait_s=5.0, max_queued=2)
    assert q.may_wait("decode_full") and q.may_wait("decode_restarting")
    assert not q.may_wait("ttft_slo") and not q.may_wait("tbt_slo")
    assert not q.may_wait("prefill_busy")
    assert not q.must_queue()
    q.join("a", 0.0)
    assert q.must_queue() and q.may_wait("decode_full")
    q.join("b", 1.0)
    assert not q.may_wait("decode_full")  # full: the next one gets its 429
    assert not DecodeWaitQueue(max_wait_s=0.0, max_queued=8).may_wait("decode_full")


def test_fifo_order_and_cancel_anywhere():
    q = DecodeWaitQueue(5.0, 8)
    for i, rid in enumerate("abcd"):
        q.join(rid, float(i))
    removed = q.remove("b")
    assert removed is not None and removed.since == 1.0
    assert q.remove("b") is None and "b" not in q and "c" in q
    assert [q.pop_head().request_id for _ in range(len(q))] == ["a", "c", "d"]
    assert q.head() is None


def test_expired_is_the_prefix_that_waited_the_bound():
    q = DecodeWaitQueue(max_wait_s=2.0, max_queued=8)
    q.join("a", 0.0)
    q.join("b", 1.0)
    q.join("c", 3.0)
    assert q.expired(1.9) == []
    assert [w.request_id for w in q.expired(3.0)] == ["a", "b"]
    head = q.head()
    assert head is not None and head.request_id == "c" and len(q) == 1


def test_bad_bounds_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="max_wait_s"):
        DecodeWaitQueue(-1.0, 1)
    q = DecodeWaitQueue(1.0, 4)
    q.join("a", 5.0)
    with pytest.raises(ValueError, match="already waiting"):
        q.join("a", 6.0)
    with pytest.raises(ValueError, match="back in time"):
        q.join("b", 4.0)


# -- the cluster side, over a fake placement ---------------------------------------------------


class FakeDecode:
    """One decode instance with ``room`` tokens; a request needs prompt + max_tokens."""

    def __init__(self, room: int, reason: str = "decode_full") -> None:
        self.room, self.reason = room, reason
        self.placed: list[str] = []

    def place(self, req: PDRequest) -> None:
        need = req.request.num_prompt_tokens + req.request.params.max_tokens
        if need > self.room:
            raise RequestRejected(self.reason, 1.0)
        self.room -= need
        self.placed.append(req.request_id)

    def free(self, tokens: int) -> None:
        self.room += tokens


def pd_request(rid: str, prompt: int, max_tokens: int = 4) -> PDRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return PDRequest(Request(rid, list(range(prompt)), params, 0, 16, []))


def waits_over(decode: FakeDecode, max_wait_s: float = 30.0, max_queued: int = 8):
    table = RequestTable()
    waits = DecodeWaits(DecodeWaitQueue(max_wait_s, max_queued), table, decode.place, 1.0)

    def submit(req: PDRequest) -> None:
        table.add(req)
        try:
            waits.submit(req)
        except RequestRejected:
            table.remove(req.request_id)
            raise

    return table, waits, submit


def test_a_big_head_is_never_overtaken_and_the_queue_drains_in_order():
    decode = FakeDecode(room=20)
    table, waits, submit = waits_over(decode)
    submit(pd_request("a", 12))  # placed: 4 tokens of room left
    submit(pd_request("big", 12))  # no room: waits
    submit(pd_request("small", 0))  # would fit, but goes behind "big"
    assert decode.placed == ["a"] and waits.waiting("big") and waits.waiting("small")
    waits.place_waiting()
    assert decode.placed == ["a"]  # still no room for the head: nobody passes it
    decode.free(16)  # "a" finished
    waits.place_waiting()
    assert decode.placed == ["a", "big", "small"]
    assert not waits.waiting("big") and waits.num_waited == 2
    assert waits.refused == {}


def test_past_the_bounds_a_request_gets_the_429_it_got_before():
    decode = FakeDecode(room=0)
    table, waits, submit = waits_over(decode, max_wait_s=0.05, max_queued=1)
    submit(pd_request("a", 4))
    with pytest.raises(RequestRejected) as e:
        submit(pd_request("b", 4))  # the queue is full
    assert e.value.reason == "decode_full" and "b" not in table
    time.sleep(0.06)
    waits.place_waiting()
    refusal = waits.refused["a"]
    assert refusal.reason == "decode_full" and refusal.http_status == 429
    assert not waits.waiting("a") and table["a"].output is not None  # ended, nothing held
    assert waits.forget("a") is refusal and waits.forget("a") is None


def test_slo_rejections_never_wait():
    decode = FakeDecode(room=0, reason="ttft_slo")
    table, waits, submit = waits_over(decode)
    with pytest.raises(RequestRejected, match="ttft_slo"):
        submit(pd_request("a", 4))
    assert len(waits.queue) == 0 and "a" not in table


def test_a_head_refused_by_an_slo_when_its_turn_comes_ends_and_the_next_goes():
    decode = FakeDecode(room=0)
    table, waits, submit = waits_over(decode)
    submit(pd_request("a", 4))
    submit(pd_request("b", 0))
    decode.reason, decode.room = "ttft_slo", 4  # "a" (8 tokens) now misses its SLO
    waits.place_waiting()
    assert waits.refused["a"].reason == "ttft_slo" and decode.placed == ["b"]


def test_a_cancelled_request_leaves_the_queue():
    decode = FakeDecode(room=0)
    table, waits, submit = waits_over(decode)
    submit(pd_request("a", 4))
    submit(pd_request("b", 4))
    waits.cancel("a")
    table["a"].end()
    decode.free(8)
    waits.place_waiting()
    assert decode.placed == ["b"] and len(waits.queue) == 0


# -- an engine loop that defers the verdict ----------------------------------------------------


class WaitingEngine(QuietEngineParts):
    """Admits one request at a time: later ones wait until the running one finishes (after
    3 steps, one token each); a waiting one past ``max_wait`` steps is refused."""

    block_size = 16
    limits: Any = None

    def __init__(self, max_wait: int = 1000) -> None:
        self.max_wait = max_wait
        self.running: dict[str, int] = {}
        self.queue: list[tuple[str, int]] = []  # (id, steps waited)
        self.refused: dict[str, OverloadedError] = {}
        self.released: list[str] = []

    def add_request(self, request: Any) -> str:
        rid = request.request_id
        if self.running or self.queue:
            self.queue.append((rid, 0))
        else:
            self.running[rid] = 0
        return rid

    def waiting(self, rid: str) -> bool:
        return any(q == rid for q, _ in self.queue)

    def refusal(self, rid: str) -> OverloadedError | None:
        return self.refused.get(rid)

    def step(self) -> list[StreamDelta]:
        time.sleep(0.002)
        out = []
        for rid, n in list(self.running.items()):
            self.running[rid] = n + 1
            done = n + 1 == 3
            out.append(StreamDelta(rid, [n], str(n), done, "length" if done else None))
            if done:
                del self.running[rid]
        self.queue = [(rid, w + 1) for rid, w in self.queue]
        while self.queue and self.queue[0][1] > self.max_wait:
            rid = self.queue.pop(0)[0]
            self.refused[rid] = OverloadedError("overloaded (decode_full)", 1.0)
        if self.queue and not self.running:
            self.running[self.queue.pop(0)[0]] = 0
        return out

    def abort(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.queue = [q for q in self.queue if q[0] != rid]

    def release(self, rid: str) -> RequestOutput:
        self.released.append(rid)
        self.refused.pop(rid, None)
        now = time.monotonic()
        return RequestOutput(rid, [1], [0, 1, 2], "", True, "length", 0, now, now, now)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.queue)


def run_all(loop: EngineLoop, ids: list[str]) -> list[list[Any]]:
    async def one(rid: str) -> list[Any]:
        items: list[Any] = []
        try:
            async for item in loop.stream([SimpleNamespace(request_id=rid)]):
                items.append(item)
        except OverloadedError as e:
            items.append(e)
        return items

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(one(r) for r in ids))

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_waiting_request_is_accepted_when_placed_and_completes():
    engine = WaitingEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    try:
        results = run_all(loop, ["a", "b", "c"])
    finally:
        loop.shutdown()
    for items in results:
        assert isinstance(items[0], Accepted) and isinstance(items[-1], Done)
        assert items[-1].output.token_ids == [0, 1, 2]


def test_a_request_refused_after_waiting_gets_a_429_and_is_taken_back():
    engine = WaitingEngine(max_wait=1)
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    try:
        results = run_all(loop, ["a", "b"])
    finally:
        loop.shutdown()
    outcomes = sorted(type(items[-1]).__name__ for items in results)
    assert outcomes == ["Done", "OverloadedError"]
    refused = next(items[-1] for items in results if isinstance(items[-1], OverloadedError))
    assert refused.http_status == 429 and "decode_full" in str(refused)
    assert sorted(engine.released) == ["a", "b"] and not engine.refused
    assert Refused.of(refused).status == 429


def test_a_caller_that_leaves_while_waiting_takes_its_request_out():
    engine = WaitingEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]

    async def main() -> None:
        first = loop.stream([SimpleNamespace(request_id="a")])
        assert isinstance(await anext(first), Accepted)
        waiting = asyncio.ensure_future(anext(loop.stream([SimpleNamespace(request_id="b")])))
        while not engine.queue:  # "b" reached the engine and waits behind "a"
            await asyncio.sleep(0.001)
        waiting.cancel()  # the client went away before its verdict
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await first.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
        deadline = time.monotonic() + 5
        while "b" not in engine.released and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.shutdown()
    assert "b" in engine.released and not engine.queue


def test_a_choice_placed_before_its_sibling_streams_everything_after_the_verdict():
    engine = WaitingEngine()  # choice 0 runs at once, choice 1 waits until it finished
    loop = EngineLoop(engine)  # type: ignore[arg-type]

    async def main() -> list[Any]:
        choices = [SimpleNamespace(request_id="n0"), SimpleNamespace(request_id="n1")]
        return [item async for item in loop.stream(choices)]

    try:
        items = asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        loop.shutdown()
    assert isinstance(items[0], Accepted)
    for index in (0, 1):
        tokens = [i.delta.token_ids[0] for i in items if isinstance(i, Delta) and i.index == index]
        assert tokens == [0, 1, 2]  # nothing streamed before the verdict is lost
        assert sum(isinstance(i, Done) and i.index == index for i in items) == 1
