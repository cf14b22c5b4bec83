"""Live region balancers in one process on the tiny CPU model: selective pushing spills a
burst over to peer regions, a killed balancer's region is served by the nearest survivor,
and every request finishes with the in-process engine's greedy tokens."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from actors.engine.replica_controller import ReplicaController
from actors.regions.regions import Regions
from actors.regions.runtime import LocalReplica
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from models import write_tiny_model
from policies.request import SamplingParams

DELAY = {("us", "eu"): 0.02, ("us", "asia"): 0.04, ("eu", "asia"): 0.05}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(24)]
    return [shared + [rng.randrange(3, 200) for _ in range(8 + i % 5)] for i in range(n)]


def reference(model_dir, toks: list[list[int]]) -> list[list[int]]:
    engine = ReplicaController.build(model_dir, block_size=4)
    out = []
    for t in toks:
        req = engine.request_builder().build(t, GREEDY)
        engine.add_request(req)
        while engine.has_unfinished():
            engine.step()
        out.append(engine.release(req.request_id).token_ids)
    return out


def make_regions(model_dir) -> tuple[Regions, list[EngineLoop], object]:
    loops, replicas = [], {}
    builder = None
    for region in ("us", "eu", "asia"):
        engine = ColocatedEngine.build(model_dir, block_size=4, max_num_seqs=1)
        builder = builder or engine.request_builder()
        loop = EngineLoop(engine)
        loops.append(loop)
        replicas[region] = [LocalReplica(f"{region}0", loop)]
    return Regions(replicas, DELAY, probe_interval=0.02), loops, builder


def test_burst_spills_over_and_failover_loses_nothing(model_dir):
    toks = prompts(12)
    expected = reference(model_dir, toks)
    regions, loops, builder = make_regions(model_dir)

    async def main():
        regions.start()
        try:
            # the burst can spill only once us has heard from a peer (its first probes)
            us = regions.balancer_for("us").policy
            for _ in range(500):
                now = time.monotonic()
                if any(us.remotes.available(b, now) for b in us.remotes.balancers):
                    break
                await asyncio.sleep(0.01)
            reqs = [builder.build(t, GREEDY, request_id=f"q{i}") for i, t in enumerate(toks)]
            # a burst at us: one replica per region, one request per batch
            burst = await asyncio.gather(*(regions.handle("us", r) for r in reqs[:6]))
            assert [o.output.token_ids for o in burst] == expected[:6]
            assert any(o.forwarded for o in burst) and any(not o.forwarded for o in burst)
            assert all(o.region == "us" for o in burst if not o.forwarded)
            # under load, the us balancer dies: eu (nearest) takes over its replica
            tasks = [asyncio.ensure_future(regions.handle("us", r)) for r in reqs[6:]]
            await asyncio.sleep(0.001)  # queued or forwarded (peers are >= 20 ms away)
            assert await regions.fail("us") == "eu"
            assert set(regions.balancer_for("us").replicas) == {"eu0", "us0"}
            late = await asyncio.gather(*tasks)
            assert [o.output.token_ids for o in late] == expected[6:]
            assert regions.retries > 0  # some were in flight at the dead balancer
            # it comes back and serves its region again
            await regions.restore("us")
            assert set(regions.balancer_for("eu").replicas) == {"eu0"}
            again = builder.build(toks[0], GREEDY, request_id="again")
            await asyncio.sleep(0.05)  # its first probe
            out = await regions.handle("us", again)
            assert out.output.token_ids == expected[0] and not out.forwarded
        finally:
            await regions.close()

    try:
        asyncio.run(main())
    finally:
        for loop in loops:
            loop.shutdown()
    for loop in loops:
        assert loop.engine.check_blocks() == {"kvp0": 0}  # nothing leaked by the aborts
