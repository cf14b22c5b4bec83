"""KV store shards as Ray actors: blocks written by one process are read by another with
identical bytes, through the transfer layer (shared memory on this node, and TCP as a
cross-node path would use), from DRAM and from SSD; replicas move shard to shard; a killed
shard drops out of the directory and its blocks read as misses (the caller recomputes)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from actors.kvstore.shard import KVStoreClient, kv_store_shard_actor
from kernels.kv_cache import allocate_kv_cache
from store.hashing import chained_block_hashes
from store.kv_block_layout import KVBlockLayout
from store.shared_segment import remove_stale_segments

LAYERS, BLOCK_SIZE, HEADS, DIM = 2, 4, 2, 8
LAYOUT = KVBlockLayout(LAYERS, BLOCK_SIZE, HEADS, DIM, torch.float32)
BB = LAYOUT.block_bytes  # 1 KiB


def block(h: int) -> np.ndarray:
    return np.random.default_rng(h % (1 << 32)).integers(0, 256, BB, dtype=np.uint8)


def digest(arrays) -> str:
    d = hashlib.blake2b()
    for a in arrays:
        d.update(np.ascontiguousarray(a).tobytes())
    return d.hexdigest()


@pytest.fixture(scope="module")
def cluster():
    # workers import this module (the Worker actor below) by name
    here = str(Path(__file__).resolve().parent)
    ray.init(
        "local",  # a new cluster, never one that `ray start` recorded on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": here}},
    )
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Worker:
    """A worker in its own process that loads stored prefixes into its paged KV cache."""

    def __init__(self, shards: dict, prefer: tuple = ()) -> None:
        self.client = KVStoreClient("worker", prefer=prefer)
        for shard_id, handle in shards.items():
            self.client.add_shard(shard_id, handle)
        self.caches = allocate_kv_cache(LAYERS, 16, BLOCK_SIZE, HEADS, DIM)

    def backends(self) -> list[str]:
        return sorted({self.client.engine.backend_for(ep) for ep in self.client.endpoints.values()})

    def shard_stats(self, shard_id: str) -> dict:
        """The shard's counts, read after this worker's own (fire-and-forget) releases:
        one caller's calls to an actor run in the order they were sent."""
        return ray.get(self.client.handles[shard_id].stats.remote())

    def load(self, request_id: str, hashes: list[int]) -> tuple[int, str]:
        self.client.refresh()
        block_ids = list(range(len(hashes)))
        n = self.client.load_into_cache(request_id, hashes, self.caches, block_ids)
        return n, digest(LAYOUT.gather(self.caches, b) for b in block_ids[:n])


def make_shards(tmp_path_factory, n: int, dram_blocks: int, ssd_blocks: int) -> dict:
    Shard = kv_store_shard_actor()
    shards = {}
    for i in range(n):
        folder = tmp_path_factory.mktemp(f"ssd{i}")
        shards[f"s{i}"] = Shard.remote(
            f"s{i}", BB, dram_blocks * BB, ssd_bytes=ssd_blocks * 2 * BB, ssd_dir=str(folder)
        )
    return shards


def wait_until_dead(handle) -> None:
    """ray.kill is asynchronous: calls already queued may still run; wait for the end."""
    while True:
        try:
            ray.get(handle.ping.remote())
        except ray.exceptions.RayActorError:
            return


def client_and_cache(shards: dict, num_blocks: int) -> tuple[KVStoreClient, list]:
    """A client of every shard, and a paged KV cache of ``num_blocks`` random blocks."""
    client = KVStoreClient("driver")
    for sid, h in shards.items():
        client.add_shard(sid, h)
    caches = allocate_kv_cache(LAYERS, num_blocks, BLOCK_SIZE, HEADS, DIM)
    for k, v in caches:
        k.normal_()
        v.normal_()
    return client, caches


def prompt_hashes(seed: int, num_blocks: int) -> list[int]:
    tokens = list(range(seed, seed + num_blocks * BLOCK_SIZE))
    return chained_block_hashes(tokens, BLOCK_SIZE, salt=f"tenant-{seed}")


@pytest.mark.parametrize("prefer", [(), ("tcp",)])
def test_put_in_one_process_get_in_another_identical(cluster, tmp_path_factory, prefer):
    shards = make_shards(tmp_path_factory, 1, dram_blocks=4, ssd_blocks=32)
    writer = KVStoreClient("driver", prefer=prefer)
    writer.add_shard("s0", shards["s0"])
    hashes = prompt_hashes(7, 10)  # more blocks than DRAM holds: most end up on SSD
    blocks = [block(h) for h in hashes]
    assert writer.put_blocks("s0", hashes, blocks) == hashes
    stats = ray.get(shards["s0"].stats.remote())
    assert stats["dram_blocks"] == 4 and stats["ssd_blocks"] == 6
    worker = Worker.remote(shards, prefer)
    assert ray.get(worker.backends.remote()) == [prefer[0] if prefer else "shm"]
    n, got = ray.get(worker.load.remote("req-1", hashes))
    assert n == 4  # DRAM holds 4 pinned blocks at a time: the rest is a later load
    assert got == digest(blocks[:4])
    n, got = ray.get(worker.load.remote("req-2", hashes[4:8]))
    assert n == 4 and got == digest(blocks[4:8])  # these came back from SSD files
    stats = ray.get(worker.shard_stats.remote("s0"))
    assert stats["pinned_blocks"] == 0 and stats["pending_writes"] == 0
    writer.close()
    for h in shards.values():
        ray.get(h.close.remote())
        ray.kill(h)


def test_kv_cache_roundtrip_and_replica(cluster, tmp_path_factory):
    shards = make_shards(tmp_path_factory, 2, dram_blocks=8, ssd_blocks=8)
    client, caches = client_and_cache(shards, 8)
    hashes = prompt_hashes(3, 3)
    assert client.store_from_cache("s0", hashes, caches, [5, 1, 6]) == hashes
    expected = digest(LAYOUT.gather(caches, b) for b in (5, 1, 6))
    assert client.change_replica(hashes, "s0", "s1") == hashes
    assert client.directory.holders(hashes[0]) == {"s0", "s1"}
    only_s1 = {"s1": shards["s1"]}
    n, got = ray.get(Worker.remote(only_s1).load.remote("r", hashes))
    assert n == 3 and got == expected
    for h in shards.values():
        ray.get(h.close.remote())
        ray.kill(h)


def test_killed_shard_drops_out_and_its_blocks_miss(cluster, tmp_path_factory):
    shards = make_shards(tmp_path_factory, 2, dram_blocks=8, ssd_blocks=8)
    client = KVStoreClient("driver")
    for sid, h in shards.items():
        client.add_shard(sid, h)
    shared = prompt_hashes(11, 2)
    lonely = prompt_hashes(12, 3)
    assert client.put_blocks("s0", shared, [block(h) for h in shared]) == shared
    assert client.change_replica(shared, "s0", "s1") == shared
    assert client.put_blocks("s1", lonely, [block(h) for h in lonely]) == lonely
    worker = Worker.remote(shards)  # another process that knows both shards
    assert ray.get(worker.backends.remote()) == ["shm"]
    ray.kill(shards["s1"])
    wait_until_dead(shards["s1"])
    outs = [np.zeros(BB, np.uint8) for _ in lonely]
    assert client.get_blocks("after-kill", lonely, outs) == 0  # a miss: recompute
    assert "s1" not in client.directory.shards
    assert all(not client.directory.holders(h) for h in lonely)
    outs = [np.zeros(BB, np.uint8) for _ in shared]
    assert client.get_blocks("shared", shared, outs) == 2  # still on the live replica
    assert digest(outs) == digest(block(h) for h in shared)
    # the worker finds out on its own (refresh sees the actor gone) and recomputes
    assert ray.get(worker.load.remote("w-lonely", lonely))[0] == 0
    n, got = ray.get(worker.load.remote("w-shared", shared))
    assert n == 2 and got == digest(block(h) for h in shared)
    remove_stale_segments()  # the killed shard's segment is reclaimed by name
    ray.get(shards["s0"].close.remote())
    ray.kill(shards["s0"])


def test_prefixes_spread_over_shards_by_key_and_a_conversation_stays_on_one(
    cluster, tmp_path_factory
):
    """Placement "key": writers on any node put a prefix on the owner of its first block,
    so distinct prefixes fill every shard, a later turn's new blocks join its first turn's
    on one shard (one read brings the whole conversation back, exactly), and once the
    owner dies its prefixes go to the next owner. "local": the writer's own shard."""
    from policies.shard_choice import key_owner

    shards = make_shards(tmp_path_factory, 3, dram_blocks=32, ssd_blocks=0)
    client, caches = client_and_cache(shards, 16)
    node = client.endpoints["s0"].node_id
    prefixes = [prompt_hashes(100 + i, 2) for i in range(12)]
    for hashes in prefixes:  # wanted "s0" (the writer's home) does not decide: the key does
        assert client.store_chain(hashes, caches, [0, 1], 0, "s0", node) == 2
        assert client.directory.holders(hashes[0]) == {key_owner(hashes[0], shards)}
    assert {key_owner(p[0], shards) for p in prefixes} == set(shards)  # every shard used
    # turn 2: turn 1's two blocks and three more (say, the answer and the next message)
    turn2 = prompt_hashes(100, 5)
    assert turn2[:2] == prefixes[0]
    assert client.store_chain(turn2, caches, [0, 1, 2, 3, 4], 2, None, node) == 3
    owner = key_owner(turn2[0], shards)
    assert client.directory.best_holder(turn2) == (owner, 5)
    n, got = ray.get(Worker.remote(shards).load.remote("turn2", turn2))
    assert n == 5 and got == digest(LAYOUT.gather(caches, b) for b in range(5))
    ray.kill(shards[owner])
    wait_until_dead(shards[owner])
    later = prompt_hashes(100, 6)  # the owner is gone: the whole prefix to the next owner
    client.store_chain(later, caches, list(range(6)), 0, None, node)
    alive = [s for s in shards if s != owner]
    assert client.directory.best_holder(later) == (key_owner(later[0], alive), 6)
    local = KVStoreClient("local-writer", placement="local")
    for sid in alive:
        local.add_shard(sid, shards[sid])
    fresh = prompt_hashes(500, 2)
    assert local.store_chain(fresh, caches, [0, 1], 0, alive[1], node) == 2
    assert local.directory.holders(fresh[0]) == {alive[1]}
    for sid in alive:
        ray.get(shards[sid].close.remote())
        ray.kill(shards[sid])
    client.close()
    local.close()
    remove_stale_segments()
