"""Two colocated replicas of one group share the group's KV store (a ``store`` section on a
colocated group): a prompt replica A computed is loaded by replica B for a turn extending
it, counted as cached, with the greedy tokens of the single-process engine without a
store; a shard killed by SIGKILL costs only cache (B recomputes, exactly) and is started
again under its name. Each replica is a Ray actor built the way a Serve replica builds its
engine (``actors.serving.replica._engine`` from the group's config) and runs it in an
``EngineLoop``; the shards are real shard actors of the group's app-wide pool."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import pytest
import ray

from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.request_builder import RequestBuilder
from policies.request import Request, SamplingParams

pytestmark = pytest.mark.timeout(600)

APP = "app"
GROUP = {
    "name": "chat",
    "engine": {"kv_cache_memory": 1 << 24},
    "store": {"dram_bytes": 1 << 24, "min_load_tokens": 32},
}
POOL = f"{APP}/{GROUP['name']}"
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = EngineConfig().block_size

# The replica class travels to its actors by value: they cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StoreReplica:
    """A colocated replica of ``GROUP`` as a Ray actor (``_engine``, as Serve builds it)."""

    def __init__(self, replica_id: str) -> None:
        from actors.serving.config import ReplicaGroupConfig
        from actors.serving.engine_loop import EngineLoop
        from actors.serving.replica import _engine

        group = ReplicaGroupConfig(**GROUP)
        self.engine = _engine(None, group, replica_id, group.engine, {}, APP)
        self.loop = EngineLoop(self.engine)

    async def generate(self, request: Request):
        (out,) = await self.loop.generate([request])
        return out

    async def _call(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    async def check_blocks(self) -> dict[str, int]:
        return await self._call(lambda e: e.check_blocks())

    async def counters(self) -> tuple[int, int]:
        return await self._call(lambda e: (e.loaded_blocks, e.stored_blocks))

    def shutdown(self) -> None:
        self.loop.shutdown()


@pytest.fixture(scope="module")
def replicas(connected_ray_cluster):
    from actors.serving.store_shards import stop

    actor: Any = ray.remote(num_cpus=0)(StoreReplica)
    a, b = actor.remote("replica-a"), actor.remote("replica-b")
    try:
        yield a, b
    finally:
        for r in (a, b):
            ray.get(r.shutdown.remote())
        assert stop(POOL) >= 1  # the pool's shards outlive the replicas until stopped


@pytest.fixture(scope="module")
def reference():
    engine = ReplicaController.build(None, EngineConfig(kv_cache_memory=1 << 24))
    yield engine
    engine.shutdown()


def request(reference: ReplicaController, rid: str, tokens: list[int]) -> Request:
    return RequestBuilder(BLOCK, reference.limits).build(tokens, PARAMS, request_id=rid)


def alone(engine: ReplicaController, req: Request) -> list[int]:
    """Greedy tokens of the single-process engine without a store (its cache emptied)."""
    engine.kv.evict_all_cached()
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    return list(engine.release(req.request_id).token_ids)


def shard():
    """(id, handle) of the pool's one shard (one node, one shard per node)."""
    from actors.disagg import pool_actors

    (found,) = pool_actors.find(POOL).items()
    return found


def wait_stored(req: Request, blocks: int, timeout: float = 60) -> None:
    """Until the pool's shard holds the first ``blocks`` blocks of ``req`` (A's write
    runs off the request's path, after its prompt step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, handle = shard()
        if ray.get(handle.match_prefix.remote(req.block_hashes[:blocks])) == blocks:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the shard never held {blocks} blocks of {req.request_id}")


def tokens(seed: int, n: int) -> list[int]:
    return [3 + (seed * 31 + 7 * i) % 500 for i in range(n)]


def test_a_prefix_computed_by_one_replica_is_loaded_by_the_other(replicas, reference):
    a, b = replicas
    first = tokens(1, 100)  # 6 full blocks
    turn_a = request(reference, "a-1", first)
    out_a = ray.get(a.generate.remote(turn_a))
    assert out_a.token_ids == alone(reference, turn_a)
    wait_stored(turn_a, 6)
    turn_b = request(reference, "b-1", first + tokens(2, 40))
    out_b = ray.get(b.generate.remote(turn_b))
    assert out_b.token_ids == alone(reference, turn_b)
    assert out_b.num_cached_tokens == 6 * BLOCK  # loaded from the store, counted as cached
    loaded, _ = ray.get(b.counters.remote())
    assert loaded == 6
    # A's own blocks were written (100 prompt and 7 answer tokens have KV: 6 full blocks);
    # B wrote only what the store lacked: 2 new prompt blocks and 1 of its answer
    assert ray.get(a.counters.remote())[1] == 6
    assert ray.get(b.counters.remote())[1] == 3
    for r in (a, b):
        assert ray.get(r.check_blocks.remote()) == {"kvp0": 0}


def test_a_later_turn_on_the_other_replica_loads_the_earlier_answer(replicas, reference):
    """A writes its answer's blocks as they fill: B's turn 2 (turn 1, A's answer, a new
    message) loads the blocks holding the answer too, exactly."""
    a, b = replicas
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = tokens(6, 40)
    turn_a = RequestBuilder(BLOCK, reference.limits).build(first, params, request_id="a-5")
    answer = ray.get(a.generate.remote(turn_a)).token_ids
    assert answer == alone(reference, turn_a)
    history = first + answer  # 80 tokens, 79 with KV on A: 4 full blocks, 2 of the answer
    turn_b = request(reference, "b-5", history + tokens(7, 20))
    wait_stored(turn_b, 4)
    out = ray.get(b.generate.remote(turn_b))
    assert out.token_ids == alone(reference, turn_b)
    assert out.num_cached_tokens == 4 * BLOCK  # the answer's blocks were loaded, not computed
    for r in (a, b):
        assert ray.get(r.check_blocks.remote()) == {"kvp0": 0}


def test_a_session_turn_is_retained_with_its_answer(replicas, reference):
    """Sessions: a finished turn asking for ``kv_retention_s`` has its prompt's and its
    answer's blocks retained on the shard (``store.retention``: kept ahead of LRU)."""
    a, _ = replicas
    _, handle = shard()
    before = ray.get(handle.stats.remote())["retained_blocks"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, kv_retention_s=120.0)
    turn = RequestBuilder(BLOCK, reference.limits).build(tokens(8, 40), params, request_id="a-6")
    assert ray.get(a.generate.remote(turn)).token_ids == alone(reference, turn)
    deadline = time.monotonic() + 60  # retained by A's writing thread, after its writes
    while (kept := ray.get(handle.stats.remote())["retained_blocks"]) < before + 3:
        assert time.monotonic() < deadline, kept
        time.sleep(0.1)
    assert kept == before + 3  # 63 tokens with KV: 2 prompt blocks and 1 of the answer


def test_a_load_needs_min_load_tokens(replicas, reference):
    a, b = replicas
    first = tokens(3, 40)  # 2 full blocks stored
    turn_a = request(reference, "a-2", first)
    ray.get(a.generate.remote(turn_a))
    wait_stored(turn_a, 2)
    # 33 tokens may use 2 blocks: 32 tokens, min_load_tokens: loaded
    turn_b = request(reference, "b-2", first[:33])
    out = ray.get(b.generate.remote(turn_b))
    assert out.num_cached_tokens == 32 and out.token_ids == alone(reference, turn_b)
    # 20 tokens may use 1 stored block (16 tokens, fewer): computed
    ray.get(a.generate.remote(request(reference, "a-3", tokens(9, 40))))
    turn_b = request(reference, "b-3", tokens(9, 20))
    wait_stored(turn_b, 1)
    out = ray.get(b.generate.remote(turn_b))
    assert out.num_cached_tokens == 0 and out.token_ids == alone(reference, turn_b)
    for r in (a, b):
        assert ray.get(r.check_blocks.remote()) == {"kvp0": 0}


def test_a_killed_shard_costs_only_cache(replicas, reference):
    a, b = replicas
    first = tokens(4, 120)  # 7 full blocks
    turn_a = request(reference, "a-4", first)
    ray.get(a.generate.remote(turn_a))
    wait_stored(turn_a, 7)
    sid, handle = shard()
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    loaded_before, _ = ray.get(b.counters.remote())
    turn_b = request(reference, "b-4", first + tokens(5, 30))
    out = ray.get(b.generate.remote(turn_b))
    assert out.token_ids == alone(reference, turn_b)  # recomputed, exactly
    assert out.num_cached_tokens == 0
    assert ray.get(b.counters.remote())[0] == loaded_before
    for r in (a, b):
        assert ray.get(r.check_blocks.remote()) == {"kvp0": 0}
    # B found the shard dead and started it again, empty, under its name, then wrote the
    # prompt it recomputed there
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        from actors.disagg import pool_actors

        if sid in pool_actors.find(POOL):
            break
        time.sleep(0.2)
    new_sid, new = shard()
    assert new_sid == sid and new._actor_id != handle._actor_id
    wait_stored(turn_b, len(turn_b.block_hashes))
    # and the group uses it again: A's next prompt is written there and B loads it
    again = tokens(6, 70)
    turn_a = request(reference, "a-5", again)
    ray.get(a.generate.remote(turn_a))
    wait_stored(turn_a, 4)
    turn_b = request(reference, "b-5", again + tokens(7, 10))
    out = ray.get(b.generate.remote(turn_b))
    assert out.token_ids == alone(reference, turn_b)
    assert out.num_cached_tokens == 4 * BLOCK
