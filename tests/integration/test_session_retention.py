"""Sessions on a real P/D cluster (Ray, a real store shard with an SSD folder): a turn's
blocks retained for ``kv_retention_s`` survive a pause full of other traffic, far more than
the store's DRAM holds, and the next turn reads them back through DualPath's chosen read
path (counted as retention hits); once the retention has ended the same pause evicts them
and the next turn recomputes."""

from __future__ import annotations

import dataclasses
import time

import ray
from pd_common import PARAMS, cluster, colocated, pd_config, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from store.ssd_tier import HEADER


def shard_stats(pd: PDCluster) -> dict:
    return ray.get(pd.shards["s0"].stats.remote())


def wait_for(pd: PDCluster, check, what: str) -> dict:
    """Shard stats once ``check(stats)`` holds (retains are sent without waiting)."""
    deadline = time.monotonic() + 30
    stats = shard_stats(pd)
    while not check(stats):
        assert time.monotonic() < deadline, (what, stats)
        time.sleep(0.05)
        stats = shard_stats(pd)
    return stats


def turn(pd: PDCluster, prompt: list[int], params) -> list[int]:
    """One turn, on prefill replicas that forgot their own caches (a pause that long)."""
    ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
    (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=params)
    return out.token_ids


def other_traffic(pd: PDCluster, first_seed: int) -> None:
    """30 blocks written back through a store of 8 DRAM slots and 24 SSD files."""
    prompts = [tokens(seed, 16) for seed in range(first_seed, first_seed + 6)]
    pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)


def test_retained_turn_survives_the_pause_and_an_expired_one_does_not(tmp_path):
    block_bytes = pd_config().kv_block_bytes(on_gpu=False)
    store = StoreConfig(
        8 * block_bytes,  # a read pins its prefix in DRAM: room for 7 blocks
        ssd_bytes=24 * (HEADER.size + block_bytes),
        ssd_dir=str(tmp_path),
        write_back=True,
    )
    pd = PDCluster(pd_config(store=store, read_path="dual"))
    kept = dataclasses.replace(PARAMS, kv_retention_s=120.0)

    # session A: turn 1 (24 prompt tokens + 6 out: 7 full blocks) retained for 120 s
    a1 = tokens(1, 24)
    out1 = turn(pd, a1, kept)
    wait_for(pd, lambda s: s["retained_blocks"] >= 7, "turn 1 retained")
    other_traffic(pd, 100)  # the tool pause: DRAM residency long over
    a2 = a1 + out1 + tokens(2, 6)
    before = shard_stats(pd)
    reads = sum(pd.path_counts.values())
    assert turn(pd, a2, kept) == colocated([a2])[0]
    after = wait_for(pd, lambda s: s["pinned_blocks"] == 0, "reads released")
    assert after["retention_hit_blocks"] - before["retention_hit_blocks"] == 7
    hits = after["dram_hit_blocks"] + after["ssd_hit_blocks"]
    assert hits - before["dram_hit_blocks"] - before["ssd_hit_blocks"] == 7
    assert sum(pd.path_counts.values()) == reads + 1  # read on the side DualPath chose
    # the same counts reach /metrics through the engine's counters
    assert pd.store is not None
    deadline = time.monotonic() + 30
    while (
        pd.store.tier_counts(every_s=0.0)
        and pd.store.retention_counts()["retention_hit_blocks"] != after["retention_hit_blocks"]
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    # session B: retained for 1.5 s only; its pause outlasts the retention
    b1 = tokens(3, 24)
    short = dataclasses.replace(PARAMS, kv_retention_s=1.5)
    out_b = turn(pd, b1, short)
    retained = wait_for(pd, lambda s: s["retained_blocks"] >= 14, "B retained")
    expired = wait_for(
        pd,
        lambda s: s["expired_retentions"] - retained["expired_retentions"] >= 7,
        "B's retention expired",
    )
    assert expired["retained_blocks"] >= 7  # session A's are still kept
    other_traffic(pd, 200)
    b2 = b1 + out_b + tokens(4, 6)
    before = shard_stats(pd)
    assert turn(pd, b2, PARAMS) == colocated([b2])[0]
    after = shard_stats(pd)
    assert after["retention_hit_blocks"] == before["retention_hit_blocks"]
    assert after["dram_hit_blocks"] + after["ssd_hit_blocks"] == (
        before["dram_hit_blocks"] + before["ssd_hit_blocks"]
    )  # B's blocks were ordinary LRU blocks again, and the pause evicted them
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
