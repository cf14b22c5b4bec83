"""Prefill/decode disaggregation on a local Ray cluster: prefill actors stream each layer's
KV into decode actors' shared-memory caches (never through Ray), the Conductor places every
request, and the output equals a colocated replica's. Prefixes come back from the KV store
(DRAM and SSD) with identical output; pinned store blocks survive eviction pressure; every
block is returned after each test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from pd_common import BS, OPTS, PARAMS, cluster, colocated, pd_config, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDSideConfig
from actors.disagg.conductor import ConductorOptions, RequestRejected
from actors.disagg.store_view import StoreConfig
from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams
from policies.conductor import Conductor
from policies.pd_costs import LinearDecodeTBT, LinearPrefillTime, transfer_time_fn
from store.hashing import chained_block_hashes


def finish(pd: PDCluster) -> None:
    """Every block of every replica is back (integrity checked on each pool)."""
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()


def test_pd_output_equals_colocated():
    shared = tokens(1, 12)
    prompts = [tokens(2, 5), shared + tokens(3, 9), shared + tokens(4, 14), tokens(5, 30)]
    pd = PDCluster(pd_config(2, 2))
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    assert all(o.finish_reason == "length" for o in outs)
    # TTFT and TPOT are measured on one clock, from submission
    for o in outs:
        assert o.first_token_time is not None and o.finish_time is not None
        assert o.arrival_time <= o.first_token_time <= o.finish_time
    stats = pd.prefill_stats()
    assert sum(s.layers_streamed for s in stats.values()) > 0
    finish(pd)


def test_llm_with_prefill_and_decode_pools_equals_colocated():
    from actors.llm import LLM

    prompts = [tokens(8, 7), tokens(9, 21)]
    # the prefill replica samples the first token under the same rules: penalties over the
    # prompt, a bias, min_tokens, the seed; its logprob reaches the caller with the rest
    sampled = SamplingParams(
        max_tokens=6,
        temperature=0.8,
        seed=3,
        repetition_penalty=1.6,
        frequency_penalty=0.5,
        logit_bias={9: 3.0},
        min_tokens=6,
        logprobs=2,
    )
    llm = LLM(None, num_prefill=1, num_decode=1, **OPTS)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        pd_sampled = llm.generate(prompt_token_ids=prompts, sampling_params=sampled)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == colocated(prompts)
    refs = LLM(None, **OPTS).generate(prompt_token_ids=prompts, sampling_params=sampled)
    assert [o.token_ids for o in pd_sampled] == [r.token_ids for r in refs]
    for o, r in zip(pd_sampled, refs, strict=True):
        assert [lp.token_id for lp in o.logprobs] == r.token_ids
        assert [lp.logprob for lp in o.logprobs] == pytest.approx(
            [lp.logprob for lp in r.logprobs], abs=1e-9
        )


def test_conductor_prefers_the_prefill_instance_holding_the_prefix():
    shared = tokens(6, 16)
    pd = PDCluster(pd_config(2, 1))
    first = pd.submit(shared + tokens(7, 3), PARAMS)
    while pd.has_unfinished():
        pd.poll()
    holder = pd.placement(first)[0]
    pd.release(first)
    pd.poll()  # nothing runs; the views already hold the holder's cached blocks
    second = pd.submit(shared + tokens(8, 5), PARAMS)
    assert pd.placement(second)[0] == holder
    while pd.has_unfinished():
        pd.poll()
    out = pd.release(second)
    assert out.token_ids == colocated([shared + tokens(8, 5)])[0]
    finish(pd)


def test_rejects_with_retry_after_when_slos_cannot_be_met():
    prompt = tokens(9, 20)
    strict = Conductor(
        prefill_time=LinearPrefillTime(base=1.0),
        decode_tbt=LinearDecodeTBT(base=0.01),
        transfer_time=transfer_time_fn(1024, 1e9),
        ttft_slo=0.5,
        tbt_slo=1.0,
        admission="early",
    )
    pd = PDCluster(pd_config(conductor=strict))
    with pytest.raises(RequestRejected) as err:
        pd.submit(prompt, PARAMS)
    assert err.value.http_status == 429 and err.value.reason == "ttft_slo"
    assert err.value.retry_after >= 1.0
    assert set(pd.check_blocks().values()) == {0}  # nothing was reserved
    pd.shutdown()

    # the same through the deployment's options: early admission at a 1 ms TTFT objective
    pd = PDCluster(pd_config(conductor=ConductorOptions(ttft_slo=1e-3, admission="early")))
    with pytest.raises(RequestRejected) as err:
        pd.submit(prompt, PARAMS)
    assert err.value.reason == "ttft_slo" and pd.conductor.admission == "early"
    pd.shutdown()

    small = EngineConfig(**{**OPTS, "num_blocks": 12})  # 20 + 20 tokens need 10 blocks
    pd = PDCluster(pd_config(engine=small, decode_wait_s=0))  # refused at once, no waiting
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = pd.submit(prompt, long)
    with pytest.raises(RequestRejected) as err:  # the first one's reservation fills decode
        pd.submit(tokens(10, 20), long)
    assert err.value.reason == "decode_full"
    outs = pd.generate(prompt_token_ids=[tokens(10, 20)], sampling_params=long)  # waits
    assert outs[0].token_ids == colocated([tokens(10, 20)], long)[0]
    assert pd.release(first).token_ids == colocated([prompt], long)[0]
    finish(pd)


def shard_stats(pd: PDCluster) -> dict:
    return ray.get(pd.shards["s0"].stats.remote())


def run_after_dropping_local_cache(pd: PDCluster, prompt: list[int]) -> tuple[list[int], int]:
    """Run one prompt on a prefill replica that forgot its own cache; returns its tokens
    and how many blocks it loaded from the store for it."""
    ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
    before = sum(s.loaded_blocks for s in pd.prefill_stats().values())
    (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
    after = sum(s.loaded_blocks for s in pd.prefill_stats().values())
    return out.token_ids, after - before


def ssd_files(folder: Path, hashes: list[int]) -> list[bool]:
    """Which blocks lie on the SSD tier (a file named by the block's hash)."""
    return [any(folder.rglob(f"{h:016x}.kv")) for h in hashes]


def test_prefix_from_dram_and_from_ssd_equals_recomputed(tmp_path):
    prompt = tokens(11, 24) + tokens(12, 6)  # 7 full blocks
    hashes = chained_block_hashes(prompt, BS)
    want = colocated([prompt])[0]
    block_bytes = pd_config().kv_block_bytes(on_gpu=False)
    store = StoreConfig(8 * block_bytes, ssd_bytes=64 * block_bytes, ssd_dir=str(tmp_path))
    pd = PDCluster(pd_config(store=store))
    (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
    assert out.token_ids == want  # computed, and its 7 full blocks written to the store
    assert shard_stats(pd)["dram_blocks"] == 7 and not any(ssd_files(tmp_path, hashes))

    before = shard_stats(pd)
    got, loaded = run_after_dropping_local_cache(pd, prompt)
    assert loaded == 7 and got == want  # from DRAM
    after = shard_stats(pd)
    assert after["dram_hit_blocks"] - before["dram_hit_blocks"] == 7
    assert after["ssd_hit_blocks"] == before["ssd_hit_blocks"]

    # other prompts push the prefix out of DRAM onto SSD files
    for seed in range(20, 23):
        pd.generate(prompt_token_ids=[tokens(seed, 20)], sampling_params=PARAMS)
    assert all(ssd_files(tmp_path, hashes))
    before = shard_stats(pd)
    got, loaded = run_after_dropping_local_cache(pd, prompt)
    assert loaded == 7 and got == want  # from SSD, promoted back to DRAM
    assert not any(ssd_files(tmp_path, hashes))
    stats = shard_stats(pd)
    assert stats["ssd_hit_blocks"] - before["ssd_hit_blocks"] == 7
    # a reader's release is fire-and-forget: from this caller it shows up eventually
    deadline = time.monotonic() + 30
    while stats["pinned_blocks"] or stats["pending_writes"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
        stats = shard_stats(pd)
    # the Conductor's view for /metrics catches up with the shard's counts, never blocking
    assert pd.store is not None
    keys = ("dram_hit_blocks", "ssd_hit_blocks", "miss_blocks")
    deadline = time.monotonic() + 30
    while pd.store.tier_counts(every_s=0.0) != {k: stats[k] for k in keys}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    finish(pd)


def test_pinned_blocks_survive_eviction_pressure():
    prompt = tokens(30, 18)  # 4 full blocks
    want = colocated([prompt])[0]
    block_bytes = pd_config().kv_block_bytes(on_gpu=False)
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=8 * block_bytes)))  # no SSD
    pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
    hashes = chained_block_hashes(prompt, BS)
    shard = pd.shards["s0"]
    assert len(ray.get(shard.acquire.remote("pin-test", hashes))) == 4  # an in-flight read
    filler = [tokens(seed, 16) for seed in range(40, 44)]  # 16 blocks through 8 slots
    pd.generate(prompt_token_ids=filler, sampling_params=PARAMS)
    assert ray.get(shard.match_prefix.remote(hashes)) == 4  # pinned: never evicted
    first_filler = chained_block_hashes(filler[0], BS)
    assert ray.get(shard.match_prefix.remote(first_filler)) == 0  # unpinned: evicted
    assert ray.get(shard.release.remote("pin-test")) == 4
    got, loaded = run_after_dropping_local_cache(pd, prompt)
    assert loaded == 4 and got == want
    finish(pd)


def test_conductor_estimates_are_refitted_from_measured_steps():
    prompts = [tokens(60 + i, n) for i, n in enumerate((5, 9, 14, 22, 30, 11, 27, 40, 18, 33))]
    pd = PDCluster(pd_config())
    default = pd.conductor.prefill_time
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    fitter = pd.fitter
    assert fitter is not None
    # every prefill step and decode step was measured (chunks of at most 8 new tokens)
    assert len(fitter.prefill) >= 8 and len(fitter.decode) >= 8
    assert all(0 < n <= 8 and t > 0 for chunks, t in fitter.prefill for n, _ in chunks)
    assert all(b >= 1 and t > 0 for b, _, t in fitter.decode)
    assert fitter.num_fits["prefill"] >= 1 and fitter.num_fits["decode"] >= 1
    # the Conductor now predicts with a fit to those measurements, not the starting guess
    assert pd.conductor.prefill_time is not default
    assert isinstance(pd.conductor.prefill_time, LinearPrefillTime)
    assert pd.conductor.prefill_time.chunk_size == OPTS["chunk_size"]
    assert isinstance(pd.conductor.decode_tbt, LinearDecodeTBT)
    # decode steps measured under a fitted model (not those before the first decode fit)
    # feed admission's TBT margin, which never goes below 1
    ratios = pd.conductor.decode_overruns.ratios
    assert 1 <= len(ratios) < len(fitter.decode) and pd.conductor.tbt_margin() >= 1.0
    # predictive admission by default, decode priced by that fit: each running request's
    # remaining tokens (reported by its decode replica) at the predicted TBT
    assert pd.conductor.admission == "predictive" and pd.conductor.decode_duration is None
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rid = pd.submit(tokens(80, 12), long)
    (pview,) = pd.prefill_views.values()
    assert pview.queued is not None and pview.queued[-1] == (12, 0)  # its own length
    (dview,) = pd.decode_views.values()
    while dview.num_running == 0:
        pd.poll()
    assert len(dview.remaining_tokens) == 1 and 0 < dview.remaining_tokens[0] < 40
    (end,) = pd.conductor.finish_times(dview, now=0.0)
    assert end == pytest.approx(
        dview.remaining_tokens[0] * pd.conductor.decode_tbt(1, dview.used_blocks)
    )
    while pd.has_unfinished():
        pd.poll()
    pd.release(rid)
    finish(pd)


def test_conductor_copies_a_hot_prefix_to_the_chosen_instance_home_shard():
    block_bytes = pd_config().kv_block_bytes(on_gpu=False)
    # each prefill replica writes to its home shard ("local"): the copy to p1's is the
    # Conductor's (under "key" the prefix's owner shard may already be p1's)
    store = StoreConfig(dram_bytes=64 * block_bytes, num_shards=2, placement="local")
    pd = PDCluster(pd_config(2, store=store, fit_costs=False))
    assert (pd.home_shard("p0"), pd.home_shard("p1")) == ("s0", "s1")

    def run_shared_prefix_on_p1(shared: list[int], drop_from_store: bool) -> list[int]:
        first = pd.submit(shared + tokens(70, 3), PARAMS)
        assert pd.placement(first)[0] == "p0"  # idle instances tie: the first
        while pd.has_unfinished():
            pd.poll()
        pd.release(first)
        while any(v.queued_tokens for v in pd.prefill_views.values()):
            pd.poll()  # p0's last report (queue empty) reaches the Conductor: a true tie
        hashes = chained_block_hashes(shared, BS)
        if drop_from_store:  # only p0's own cache holds the prefix now
            assert ray.get(pd.shards["s0"].remove.remote(hashes)) == len(hashes)
        busy = pd.submit(tokens(71, 40), PARAMS)  # queues on p0 (no prefix anywhere: tie)
        second_prompt = shared + tokens(72, 5)
        second = pd.submit(second_prompt, PARAMS)
        assert pd.placement(busy)[0] == "p0" and pd.placement(second)[0] == "p1"
        # before p1 prefills, the prefix was copied into p1's home shard
        assert ray.get(pd.shards["s1"].match_prefix.remote(hashes)) == len(hashes)
        while pd.has_unfinished():
            pd.poll()
        pd.release(busy)
        out = pd.release(second)
        assert out.token_ids == colocated([second_prompt])[0]
        assert out.num_cached_tokens == len(shared)  # the copied prefix, not recomputed
        return hashes

    loaded = pd.prefill_stats()["p1"].loaded_blocks
    hashes = run_shared_prefix_on_p1(tokens(73, 16), drop_from_store=False)  # shard to shard
    assert pd.replicated_blocks == len(hashes) == 4
    assert pd.prefill_stats()["p1"].loaded_blocks == loaded + 4  # not recomputed
    hashes = run_shared_prefix_on_p1(tokens(74, 16), drop_from_store=True)  # from p0's cache
    assert pd.replicated_blocks == 8
    assert pd.prefill_stats()["p1"].loaded_blocks == loaded + 8
    finish(pd)


def test_abort_in_prefill_and_in_decode_frees_every_block():
    pd = PDCluster(pd_config())
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    decoding = pd.submit(tokens(80, 6), long)
    while not pd.output(decoding) and not any(
        d.request_id == decoding and d.token_ids for d in pd.poll()
    ):
        pass
    prefilling = pd.submit(tokens(81, 30), long)  # 30 tokens: several prefill steps
    pd.abort(decoding)
    pd.abort(prefilling)
    pd.abort("no-such-request")  # unknown ids are ignored
    for rid in (decoding, prefilling):
        out = pd.release(rid)
        assert out.finished and out.finish_reason == "abort" and len(out.token_ids) < 20
    assert not pd.has_unfinished()
    pd.poll()  # the aborted prefill leaves nothing behind
    finish(pd)


def test_prefill_and_decode_with_different_layouts_equal_colocated():
    # prefill: two pipeline stages; decode: two tensor-parallel ranks. Each prefill stage
    # streams its layers into both decode ranks' shares of the cache.
    prompts = [tokens(90, 7), tokens(91, 26)]
    pd = PDCluster(
        pd_config(prefill=PDSideConfig(spp=2), decode=PDSideConfig(tp=2), fit_costs=False)
    )
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    assert sum(s.layers_streamed for s in pd.prefill_stats().values()) > 0
    finish(pd)


def test_kv_parallel_decode_equals_colocated():
    # decode: two KV-parallel ranks of at most 16 tokens each, so a 26-token prompt's blocks
    # are split over both ranks' pools; the prefill replica streams each block to its rank
    prompts = [tokens(92, 26), tokens(93, 9)]
    engine = EngineConfig(**{**OPTS, "kvp_rank_tokens": 16})
    pd = PDCluster(
        pd_config(engine=engine, decode=PDSideConfig(kvp=2), fit_costs=False, pin_cores=False)
    )
    assert pd.replicas.decode_engine.kvp == 2 and pd.replicas.prefill_engine.kvp == 1
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    # two ranks' pools: the Conductor sees both
    assert pd.decode_views["d0"].total_blocks == 2 * OPTS["num_blocks"]
    finish(pd)


def test_pipelined_prefill_reads_and_writes_the_kv_store():
    # Mooncake's chunked pipeline parallelism: a two-stage prefill replica, its stages'
    # caches mapped by the replica, which loads stored prefixes and writes prompts back
    shared = tokens(95, 16)  # 4 full blocks
    first, second = shared + tokens(96, 5), shared + tokens(97, 7)
    pd = PDCluster(pd_config(prefill=PDSideConfig(spp=2), store=StoreConfig(dram_bytes=1 << 22)))
    (out,) = pd.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    assert out.token_ids == colocated([first])[0]
    assert sum(s.stored_blocks for s in pd.prefill_stats().values()) == 5  # 21 tokens
    before = shard_stats(pd)["dram_hit_blocks"]
    got, loaded = run_after_dropping_local_cache(pd, second)
    assert loaded == 4 and got == colocated([second])[0]  # the shared prefix, from the store
    assert shard_stats(pd)["dram_hit_blocks"] - before == 4
    finish(pd)
