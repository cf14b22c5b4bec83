"""One cluster over two Ray nodes (two raylets on this machine): prefill replicas on both
nodes, one KV store shard per node, one Conductor.

- A prefix prefilled on one prefill replica is read from the pool by the other prefill
  replica, on the other node, and its KV streams to the decode replica across nodes: the
  tokens equal the single-process engine's.
- The prefill pool grows under a load step and shrinks after it; the replica it drains
  still holds prefills, finishes them, and only then leaves: every request ends exactly.
- A shared pool (``PDClusterConfig.pool``) outlives its Conductor: a Conductor replaced
  while its requests run and it still polls (Serve starts a new one while an unhealthy one
  drains) is superseded: the next Conductor attaches to those same actors, which report to
  it alone, keeps the pool's cache and serves exactly; the old one ends its requests with
  what they streamed, and its shutdown and its process's death leave the pool alive;
  shutting the new one down removes the pool.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import ray
from pd_common import PARAMS, REPO, colocated, pd_config, tokens, two_node_cluster

from actors.disagg import pool_actors
from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.disagg.store_view import StoreConfig
from policies.pool_scaling import PREFILL_POOL, PoolScaler, PoolScaling
from store.hashing import chained_block_hashes
from store.transfer.nixl_backend import nixl_api

BS = 4


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    yield from two_node_cluster(REPO / "tests" / "integration")  # the host actor's module


def drain(pd: PDCluster) -> None:
    while pd.has_unfinished():
        pd.poll()


def test_a_prefix_prefilled_on_one_replica_is_read_by_another_on_another_node():
    store = StoreConfig(dram_bytes=4 << 20)
    pd = PDCluster(pd_config(2, store=store, fit_costs=False))
    nodes = {rid: ray.get(h.node.remote()) for rid, h in {**pd.prefills, **pd.decodes}.items()}
    assert nodes["p0"] != nodes["p1"] and nodes["d0"] == nodes["p0"]  # p1 streams across
    assert sorted(pd.shards) == ["s0", "s1"]  # a shard per node, p0 and p1 each at home
    shared = tokens(1, 16)
    first = pd.submit(shared + tokens(2, 3), PARAMS)
    assert pd.placement(first)[0] == "p0"  # idle instances tie: the first
    drain(pd)
    pd.release(first)
    while any(v.queued_tokens for v in pd.prefill_views.values()):
        pd.poll()  # p0's last report (queue empty) reaches the Conductor: a true tie
    busy = pd.submit(tokens(3, 40), PARAMS)  # queues on p0
    second_prompt = shared + tokens(4, 5)
    second = pd.submit(second_prompt, PARAMS)
    assert pd.placement(busy)[0] == "p0" and pd.placement(second)[0] == "p1"
    hashes = chained_block_hashes(shared, BS)
    assert ray.get(pd.shards["s1"].match_prefix.remote(hashes)) == len(hashes)  # on p1's node
    drain(pd)
    pd.release(busy)
    out = pd.release(second)
    assert out.token_ids == colocated([second_prompt])[0]
    assert out.num_cached_tokens == len(shared)  # read from the pool, not recomputed
    stats = pd.prefill_stats()["p1"]
    assert stats.loaded_blocks == len(hashes)
    across = "nixl" if nixl_api() is not None else "tcp"
    assert list(stats.backends.values()) == [across]  # p1 -> d0 on the other node
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()


@ray.remote(num_cpus=0, max_restarts=0)
class ConductorHost:
    """A Conductor in a process of its own, so that a test can kill that process."""

    def __init__(self, config: PDClusterConfig) -> None:
        self.pd = PDCluster(config)
        self.outputs: dict[str, list[int]] = {}

    def actor_ids(self) -> dict[str, str]:
        pd = self.pd
        handles = {**pd.prefills, **pd.decodes, **pd.shards}
        return {rid: h._actor_id.hex() for rid, h in handles.items()}

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
        outs = self.pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        return [(o.token_ids, o.num_cached_tokens) for o in outs]

    def start_load(self, prompts: list[list[int]]) -> None:
        """Submit ``prompts`` and poll in a thread until ``end_of_load``, as a Serve
        replica's engine thread polls (idle too) until it stops."""
        ids = [self.pd.submit(p, PARAMS) for p in prompts]
        self._stop = threading.Event()
        self._load = threading.Thread(target=self._poll, daemon=True)
        self._load.start()
        self._ids = ids

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.pd.poll()

    def end_of_load(self) -> list[tuple[list[int], str | None]]:
        """Stop polling; each request of the load (ended by now): tokens, finish reason."""
        self._stop.set()
        self._load.join()
        outs = [self.pd.release(rid) for rid in self._ids]
        return [(o.token_ids, o.finish_reason) for o in outs]

    def tokens_streamed(self) -> int:
        return sum(len(self.pd.token_times(rid)) for rid in self._ids)

    def check_blocks(self) -> dict[str, int]:
        return self.pd.check_blocks()

    def shutdown(self) -> None:
        self.pd.shutdown()


def test_a_new_conductor_supersedes_the_running_one_and_keeps_the_pool_and_its_cache():
    pool = "test/pool"
    config = pd_config(2, store=StoreConfig(dram_bytes=4 << 20), fit_costs=False, pool=pool)
    shared = tokens(10, 16)
    host: Any = ConductorHost.remote(config)
    ((warm, _),) = ray.get(host.generate.remote([shared + tokens(11, 3)]))
    before = ray.get(host.actor_ids.remote())
    load = [tokens(20 + i, 30) for i in range(4)]
    ray.get(host.start_load.remote(load))
    while ray.get(host.tokens_streamed.remote()) == 0:
        pass  # requests are decoding now

    # a new Conductor while the first still polls: the replicas report to the new one only
    again: Any = ConductorHost.remote(config)
    assert ray.get(again.actor_ids.remote()) == before  # the same actors, attached
    prompts = [shared + tokens(12, 5), *load]
    outs = ray.get(again.generate.remote(prompts))
    assert [t for t, _ in outs] == colocated(prompts)  # no token taken by the first
    assert outs[0][1] == len(shared)  # the prefix the first Conductor's request left
    ended = ray.get(host.end_of_load.remote())  # done, or given up when superseded
    for (got, reason), want in zip(ended, colocated(load), strict=True):
        assert got == want[: len(got)] and reason in ("abort", "length")
    ray.get(host.shutdown.remote())  # as Serve stops it: the pool is the new one's
    ray.kill(host)
    assert set(pool_actors.find(pool)) == set(before)
    assert set(ray.get(again.check_blocks.remote()).values()) == {0}
    ray.get(again.shutdown.remote())
    assert pool_actors.find(pool) == {}


def test_the_prefill_pool_grows_under_load_and_drains_without_losing_a_request():
    grow_only = PoolScaling(1, 2, target=32.0, upscale_delay_s=0.0, downscale_delay_s=3600.0)
    config = pd_config(prefill=PDSideConfig(1, scaling=grow_only), fit_costs=False)
    pd = PDCluster(config)
    wave1 = [tokens(100 + i, 40) for i in range(20)]
    ids1 = [pd.submit(p, PARAMS) for p in wave1]
    while "p1" not in pd.prefills:  # the queue is over the target: p1 starts, then joins
        assert not pd.replicas.failed_starts, "a new prefill replica's actor died starting"
        pd.poll()
    assert [(e.pool, e.action, e.replica_id) for e in pd.pools.events] == [
        ("prefill", "grow", "p1")
    ]
    assert pd.pools.events[0].signal == "queued_prefill_tokens"
    wave2 = [tokens(200 + i, 60) for i in range(16)]
    ids2 = [pd.submit(p, PARAMS) for p in wave2]
    placed = {pd.placement(rid)[0] for rid in ids2}  # None: waits for decode room
    assert {"p0", "p1"} <= placed  # both replicas hold queued prefills
    # the load falls (here: the target rises): shrink at once, to one replica
    pd.pools.scalers[PREFILL_POOL] = PoolScaler(
        PREFILL_POOL, PoolScaling(1, 2, target=1e9, downscale_delay_s=0.0)
    )
    pd.poll(0)
    (drained,) = [e for e in pd.pools.events if e.action == "drain"]
    assert pd.table.in_prefill_on(drained.replica_id)  # drained with prefills still on it
    drain_ids = [rid for rid in ids2 if pd.placement(rid)[0] == drained.replica_id]
    drain(pd)
    while drained.replica_id in pd.prefills:
        pd.poll()  # retired once its last report (queue empty) arrives
    assert [e.action for e in pd.pools.events] == ["grow", "drain", "retire"]
    assert pd.pools.sizes()["prefill"] == 1
    outs = [pd.release(rid) for rid in ids1 + ids2]
    assert [o.token_ids for o in outs] == colocated(wave1 + wave2)  # nothing lost
    assert drain_ids and all(o.finish_reason == "length" for o in outs)
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
