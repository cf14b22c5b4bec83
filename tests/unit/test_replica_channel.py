"""A replica's event channel on the tiny CPU model: every started prompt's events arrive on
its ingress's one stream, one entry per prompt a frame, in order and ending with None, with
the tokens the same engine loop gives each prompt alone; an aborted prompt frees its
blocks; a dropped stream aborts what it carried; an idle stream ends by itself; a call
meant for another replica says so."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from actors.engine.events import Accepted, Delta, Done, Refused
from actors.serving import replica_channel
from actors.serving.channel_socket import channel_batches
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from actors.serving.messages import AbortPrompt, OpenChannel, StartPrompt
from actors.serving.replica_channel import WRONG_REPLICA, ReplicaChannels
from models import write_tiny_model
from policies.request import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.timeout(300)  # the tiny model, one engine thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 200) for _ in range(10 + i)] for i in range(n)]


@pytest.fixture
def channels(model_dir):
    engine = ColocatedEngine.build(model_dir, block_size=4)
    loop = EngineLoop(engine, replica_id="r1")
    yield ReplicaChannels(loop, "r1"), engine.request_builder(), loop
    loop.shutdown()


def in_use(loop: EngineLoop) -> int:
    return sum(loop.call(lambda engine: engine.check_blocks()).result(timeout=30).values())


def test_one_stream_carries_every_prompt_in_order(channels):
    chans, builder, loop = channels
    toks = prompts(4)

    async def main():
        expected = []
        for i, t in enumerate(toks):  # each alone, through the loop's per-request path
            (out,) = await loop.generate([builder.build(t, GREEDY, request_id=f"alone{i}")])
            expected.append(out.token_ids)
        reqs = [builder.build(t, GREEDY, request_id=f"p{i}") for i, t in enumerate(toks)]
        verdicts = await asyncio.gather(
            *(chans.start(StartPrompt(requests=[r], ingress="i1")) for r in reqs)
        )
        assert verdicts == [Accepted("r1")] * 4
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        ended: list[str] = []
        items = 0
        stream = channel_batches(chans.events(OpenChannel(ingress="i1", replica_id="r1")))
        async for batch in stream:
            items += 1
            assert len({key for key, _ in batch}) == len(batch)  # one entry per prompt
            for key, events in batch:
                for item in events:
                    assert key not in ended, "an event after the prompt's end"
                    if item is None:
                        ended.append(key)
                    elif isinstance(item, Delta):
                        tokens[key] += item.delta.token_ids
                    else:
                        assert isinstance(item, Done)
                        assert item.output.token_ids == tokens[key]
            if len(ended) == 4:
                await stream.aclose()
        assert [tokens[r.request_id] for r in reqs] == expected
        assert items < 4 * len(expected[0])  # fewer stream items than events

    asyncio.run(main())
    assert in_use(loop) == 0


def test_abort_frees_blocks_and_a_dropped_stream_aborts_the_rest(channels):
    chans, builder, loop = channels

    async def main():
        a, b = (builder.build(t, LONG, request_id=f"long{i}") for i, t in enumerate(prompts(2)))
        for r in (a, b):
            assert await chans.start(StartPrompt(requests=[r], ingress="i2")) == (Accepted("r1"))
        stream = channel_batches(chans.events(OpenChannel(ingress="i2", replica_id="r1")))
        await anext(stream)
        assert in_use(loop) > 0
        await chans.abort_prompt(AbortPrompt(ingress="i2", key="long0"))
        # frames made before the abort may still be on the socket; then nothing more of it
        while any(key == "long0" for key, _ in await anext(stream)):
            pass
        for _ in range(5):
            assert all(key == "long1" for key, _ in await anext(stream))
        await stream.aclose()  # the ingress is gone: long1 is aborted too

    asyncio.run(main())
    for _ in range(100):  # the aborts land between engine steps
        if in_use(loop) == 0:
            break
        time.sleep(0.05)
    assert in_use(loop) == 0


def test_an_idle_stream_ends_and_a_misrouted_one_says_so(channels, monkeypatch):
    chans, builder, _ = channels
    monkeypatch.setattr(replica_channel, "IDLE_END_S", 0.1)

    async def main():
        misrouted = channel_batches(chans.events(OpenChannel(ingress="i3", replica_id="r9")))
        assert [b async for b in misrouted] == [[("", WRONG_REPLICA)]]
        # a refused prompt puts nothing on the channel, which then ends when idle
        bad = builder.build(prompts(1)[0], GREEDY, request_id="bad")
        chans.loop.max_waiting = 0
        refused = await chans.start(StartPrompt(requests=[bad], ingress="i3"))
        assert isinstance(refused, Refused) and refused.status == 429
        idle = channel_batches(chans.events(OpenChannel(ingress="i3", replica_id="r1")))
        assert [b async for b in idle] == []

    asyncio.run(main())
