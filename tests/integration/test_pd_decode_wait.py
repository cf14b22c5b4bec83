"""On Ray, P/D 1+1 on the tiny model: requests beyond what the decode replica's KV holds at
once wait for decode room (FIFO) instead of a 429 and all complete with the colocated
reference's tokens; one beyond the queue's bound gets the 429; through an ``EngineLoop`` a
waiting request is answered ``Accepted`` once placed and streams as any other."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pd_common import PARAMS, cluster, colocated, pd_config, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.conductor import RequestRejected
from actors.disagg.engine import PDEngine
from actors.engine.events import Accepted, Done
from actors.serving.engine_loop import EngineLoop

PROMPT = 40  # + 6 new tokens: 12 of the decode replica's 64 blocks each, ~5 at once
WAIT_MAX = 4


@pytest.fixture(scope="module")
def pd():
    c = PDCluster(pd_config(1, 1, decode_wait_max=WAIT_MAX))
    yield c
    c.shutdown()


def test_more_than_decode_holds_all_complete_in_order_and_one_past_the_bound_is_refused(pd):
    prompts = [tokens(100 + i, PROMPT) for i in range(40)]
    ids: list[str] = []
    while not ids or not pd.waiting(ids[-1]):  # fill decode until one has to wait
        ids.append(pd.submit(prompts[len(ids)], PARAMS))
    placed = len(ids) - 1
    assert placed >= 2
    for _ in range(WAIT_MAX - 1):
        ids.append(pd.submit(prompts[len(ids)], PARAMS))
        assert pd.waiting(ids[-1])
    with pytest.raises(RequestRejected) as e:  # the queue is full: the same 429 as before
        pd.submit(prompts[len(ids)], PARAMS)
    assert e.value.reason == "decode_full" and e.value.http_status == 429
    started: list[str] = []  # ids in the order they left the queue
    while pd.has_unfinished():
        pd.poll()
        started += [r for r in ids[placed:] if r not in started and not pd.waiting(r)]
        assert all(pd.refusal(r) is None for r in ids)
    assert started == ids[placed:]  # FIFO
    outs = [pd.release(r) for r in ids]
    assert [o.token_ids for o in outs] == colocated(prompts[: len(ids)])
    assert all(o.finish_reason == "length" for o in outs)
    assert pd.waits.num_waited == WAIT_MAX and len(pd.waits.queue) == 0
    assert set(pd.check_blocks().values()) == {0}


def test_through_an_engine_loop_waiting_requests_are_accepted_and_stream(pd):
    prompts = [tokens(200 + i, PROMPT) for i in range(8)]
    build = pd.builder
    requests = [build.build(p, PARAMS, request_id=f"loop-{i}") for i, p in enumerate(prompts)]
    waited_before = pd.waits.num_waited
    loop = EngineLoop(PDEngine(pd))

    async def one(request: Any) -> list[Any]:
        return [item async for item in loop.stream([request])]

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(one(r) for r in requests))

    try:
        results = asyncio.run(asyncio.wait_for(main(), 60))
        assert set(pd.check_blocks().values()) == {0}
    finally:
        loop.shutdown()  # shuts the cluster down too (the fixture's shutdown is a no-op)
    assert all(isinstance(items[0], Accepted) for items in results)  # no 429
    dones = [items[-1] for items in results]
    assert all(isinstance(d, Done) for d in dones)
    assert [d.output.token_ids for d in dones] == colocated(prompts)
    assert pd.waits.num_waited > waited_before  # some of them waited
