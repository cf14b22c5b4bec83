"""Faults of a disaggregated deployment on a local Ray cluster: a KV store shard that dies
drops out of the map and the requests that needed its blocks recompute them; a prefill
replica that dies mid-stream frees the decode side's reservation and its requests complete
on a fresh replica. Every request completes with the colocated tokens; no block leaks."""

from __future__ import annotations

import time

import ray
from pd_common import PARAMS, cluster, colocated, pd_config, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from store.shared_segment import remove_stale_segments


def wait_until_dead(handle) -> None:
    while True:
        try:
            ray.get(handle.ping.remote())
        except ray.exceptions.RayActorError:
            return


def test_dead_store_shard_drops_out_and_requests_recompute():
    prompt = tokens(1, 26)
    want = colocated([prompt])[0]
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=1 << 20)))
    assert pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)[0].token_ids == want
    ray.kill(pd.shards["s0"])
    wait_until_dead(pd.shards["s0"])
    ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
    outs = pd.generate(prompt_token_ids=[prompt, tokens(2, 13)], sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == [want, colocated([tokens(2, 13)])[0]]
    stats = pd.prefill_stats()["p0"]
    assert stats.loaded_blocks == 0  # nothing came from the dead shard: recomputed
    assert pd.store_client is not None and "s0" not in pd.store_client.directory.shards
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
    remove_stale_segments()


def test_prefill_dying_mid_stream_frees_the_reservation_and_requests_complete():
    prompts = [tokens(3, 30), tokens(4, 9), tokens(5, 17)]
    want = colocated(prompts)
    pd = PDCluster(pd_config())
    # 4 layers per step: the replica exits after streaming 2 layers of its first step
    ray.get(pd.prefills["p0"].crash_after_layers.remote(2))
    victim = pd.prefills["p0"]
    ids = [pd.submit(p, PARAMS) for p in prompts]  # lifetime KV reserved on decode
    deadline = time.monotonic() + 120
    while pd.num_prefill_restarts == 0:  # the replica dies mid-stream; a new one starts
        assert time.monotonic() < deadline, "the prefill replica did not die"
        assert not pd.poll()  # nothing was admitted: no token reaches the caller
    wait_until_dead(victim)
    while pd.has_unfinished():
        pd.poll()
    outs = [pd.release(rid) for rid in ids]
    assert [o.token_ids for o in outs] == want
    assert pd.num_prefill_restarts == 1
    stats = ray.get(pd.decodes["d0"].report_stats.remote())
    assert stats.pending == 0 and stats.pending_blocks == 0  # dead streams' reservations freed
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
    remove_stale_segments()


def test_decode_dying_mid_generation_reruns_its_requests_without_repeating_tokens():
    prompts = [tokens(6, 10), tokens(7, 25), tokens(8, 6)]
    want = colocated(prompts)
    pd = PDCluster(pd_config())
    ids = [pd.submit(p, PARAMS) for p in prompts]
    streamed: dict[str, list[int]] = {rid: [] for rid in ids}

    def collect() -> None:
        for d in pd.poll():
            streamed[d.request_id] += d.token_ids

    while sum(len(t) for t in streamed.values()) < 4:  # some decoding, some maybe in prefill
        collect()
    victim = pd.decodes["d0"]
    ray.kill(victim)
    wait_until_dead(victim)
    while pd.has_unfinished():
        collect()
    assert pd.num_decode_restarts == 1
    outs = [pd.release(rid) for rid in ids]
    assert [o.token_ids for o in outs] == want
    assert [streamed[rid] for rid in ids] == want  # each token reached the caller once
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
    remove_stale_segments()
