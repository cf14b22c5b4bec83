"""DualPath on a local Ray cluster: decode replicas write every full block back to the KV
store as it fills, so a conversation's next turn hits its own previous answer; a prefill
replica loads a stored prefix layer by layer while its prefill runs. Output always equals
a colocated replica's."""

from __future__ import annotations

import ray
from pd_common import BS, PARAMS, cluster, colocated, pd_config, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDSideConfig
from actors.disagg.store_view import StoreConfig
from actors.engine.sampling import SamplingParams
from store.hashing import chained_block_hashes
from store.transfer.links import LinkBudget

ANSWER = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def second_turn_cached(write_back: bool) -> tuple[int, list[int], int]:
    """Turn 1, then turn 2 = turn 1's prompt + its answer + a new message, on a prefill
    replica that forgot its own cache (so the prefix comes from the store). Returns turn
    2's cached tokens, its tokens, and the blocks the decode side wrote back in turn 1."""
    first = tokens(101, 30)  # 7 full blocks and 2 tokens
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=64 << 20, write_back=write_back)))
    try:
        (out1,) = pd.generate(prompt_token_ids=[first], sampling_params=ANSWER)
        assert out1.token_ids == colocated([first], ANSWER)[0]
        written = sum(ray.get(h.report_stats.remote()).stored_blocks for h in pd.decodes.values())
        second = first + out1.token_ids + tokens(102, 7)
        ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
        (out2,) = pd.generate(prompt_token_ids=[second], sampling_params=ANSWER)
        assert out2.token_ids == colocated([second], ANSWER)[0]
        written2 = sum(ray.get(h.report_stats.remote()).stored_blocks for h in pd.decodes.values())
        if write_back:  # turn 2's answer too: 49 + 11 computed tokens, 15 full blocks
            assert written2 - written == 15 - 12
        assert set(pd.check_blocks().values()) == {0}
        return out2.num_cached_tokens, out2.token_ids, written
    finally:
        pd.shutdown()


def test_write_back_makes_the_next_turn_hit_its_own_previous_answer():
    cached, got, written = second_turn_cached(write_back=True)
    # turn 1 held 30 + 12 tokens; the last one's KV is never computed: 41 tokens, 10 full
    # blocks, 3 of them (tokens 28..39) holding the answer, written back by decode
    assert written == 3
    assert cached == 10 * BS  # well past turn 1's prompt (30): its answer came back
    base_cached, base_got, base_written = second_turn_cached(write_back=False)
    assert base_written == 0
    assert base_cached == 7 * BS  # without write-back only turn 1's prompt blocks hit
    assert got == base_got


def first_after(timeline, event: str, layer: int, t0: float) -> float:
    return min(t for e, lay, t in timeline if e == event and lay == layer and t >= t0)


def test_prefix_loads_layer_by_layer_while_the_prefill_runs():
    prompt = tokens(111, 30)  # 7 full blocks
    want = colocated([prompt])[0]
    # a slow storage link (50 kB/s in 4 kB grants): each layer's 14 kB takes ~0.3 s
    budget = LinkBudget(storage_bps=50_000, chunk_bytes=4096)
    pd = PDCluster(
        pd_config(
            store=StoreConfig(dram_bytes=64 << 20),
            prefill=PDSideConfig(link_budget=budget, record_loads=True),
        )
    )
    try:
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == want
        (p0,) = pd.prefills.values()
        ray.get(p0.drop_local_cache.remote())
        t0 = max(t for _, _, t in ray.get(p0.load_timeline.remote()))
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == want and out.num_cached_tokens == 7 * BS
        timeline = ray.get(p0.load_timeline.remote())
        start = first_after(timeline, "load-start", 0, t0)
        layers = 4
        load_start = [first_after(timeline, "load-start", i, start) for i in range(layers)]
        load_end = [first_after(timeline, "load-end", i, start) for i in range(layers)]
        compute_start = [first_after(timeline, "compute-start", i, start) for i in range(layers)]
        compute_end = [first_after(timeline, "compute-end", i, start) for i in range(layers)]
        for i in range(layers):
            assert load_end[i] <= compute_start[i]  # a layer computes on its loaded KV
        for i in range(layers - 1):
            # the read of layer i + 1 starts before layer i's compute ends
            assert load_start[i + 1] < compute_end[i]
        # and the prefill started before the whole prefix was in: not load-then-compute
        assert compute_start[0] < load_end[layers - 1]
        assert set(pd.check_blocks().values()) == {0}
    finally:
        pd.shutdown()


def run_on_path(read_path: str, prompt: list[int]) -> tuple[list[int], int, list[bytes], dict]:
    """Store ``prompt``'s prefix, then run it again on a prefill replica that forgot its
    cache, reading the prefix on ``read_path``. Returns the tokens, cached tokens, the KV of
    every prompt block the prefill replica then holds, and counters."""
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=64 << 20), read_path=read_path))
    try:
        pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        (p0,) = pd.prefills.values()
        (d0,) = pd.decodes.values()
        ray.get(p0.drop_local_cache.remote())
        streamed = pd.prefill_stats()["p0"].bytes_streamed
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        kv = ray.get(p0.cached_block_bytes.remote(chained_block_hashes(prompt, BS), prompt))
        stats = pd.prefill_stats()["p0"]
        counters = {
            "prefill_loaded": stats.loaded_blocks,
            "decode_loaded": ray.get(d0.report_stats.remote()).loaded_blocks,
            "streamed": stats.bytes_streamed - streamed,
            "paths": dict(pd.path_counts),
        }
        assert set(pd.check_blocks().values()) == {0}
        return out.token_ids, out.num_cached_tokens, kv, counters
    finally:
        pd.shutdown()


def test_both_read_paths_deliver_identical_kv_and_tokens():
    prompt = tokens(121, 30)  # 7 full blocks
    want = colocated([prompt])[0]
    got_p, cached_p, kv_p, n_p = run_on_path("prefill", prompt)
    got_d, cached_d, kv_d, n_d = run_on_path("decode", prompt)
    assert got_p == got_d == want
    assert cached_p == cached_d == 7 * BS
    assert len(kv_p) == len(kv_d) == 7 and kv_p == kv_d  # every layer's K and V, bytewise
    # prefill path: the store -> the prefill replica, the whole prompt streamed to decode
    assert n_p["prefill_loaded"] == 7 and n_p["decode_loaded"] == 0
    assert n_p["paths"] == {"prefill": 1, "decode": 0}
    # decode path: the store -> the decode replica -> the prefill replica, layer by layer;
    # only the missed tokens' blocks streamed back (1 of 8 blocks)
    assert n_d["prefill_loaded"] == 7 and n_d["decode_loaded"] == 7
    assert n_d["paths"] == {"prefill": 0, "decode": 1}
    assert n_d["streamed"] * 8 == n_p["streamed"]


def test_a_relaying_decode_replica_that_dies_loses_no_request():
    prompt = tokens(131, 30)
    want = colocated([prompt])[0]
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=64 << 20), read_path="decode"))
    try:
        pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
        (d0,) = pd.decodes.values()
        ray.get(d0.crash_on_load.remote())
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == want  # on the prefill path, or recomputed
        assert pd.num_decode_restarts == 1
        assert set(pd.check_blocks().values()) == {0}
    finally:
        pd.shutdown()


def test_the_live_conductor_places_requests_by_dualpaths_rules():
    """Two prefill and two decode replicas under ``scheduler="dualpath"`` (alpha = 40
    tokens): a request reading a stored prefix on p0 makes p0's read queue long, so the
    next fresh requests go to p1 even once p1 has more unfinished tokens; with alpha
    raised the smaller unfinished tokens win again. Every output equals the colocated
    reference."""
    first = tokens(141, 50)  # 12 full blocks go to the store
    hit = first + tokens(142, 6)  # 56 tokens, 48 of them stored
    fresh = [tokens(143, 40), tokens(144, 20), tokens(145, 12)]
    prompts = [hit, *fresh]
    want = colocated(prompts)
    pd = PDCluster(
        pd_config(
            2,
            2,
            store=StoreConfig(dram_bytes=64 << 20),
            read_path="dual",
            scheduler="dualpath",
            dualpath_thresholds=(40, 10_000),
        )
    )
    try:
        pd.generate(prompt_token_ids=[first], sampling_params=PARAMS)
        for _ in range(4):  # the replicas' reports bring the views back to idle
            pd.poll(0.3)
        assert all(v.queued_tokens == 0 for v in pd.prefill_views.values())
        assert all(v.pending_blocks == 0 for v in pd.decode_views.values())
        ids = [pd.submit(hit, PARAMS)]
        # idle replicas tie: p0, d0; the 48 stored tokens are read on p0's side (tie)
        assert pd.placement(ids[0]) == ("p0", "d0")
        assert pd.read_paths.tokens(BS) == {"p0": 48}
        # p0 reads more than alpha: a fresh request goes to p1; d1 is under Z
        # (1.05 * (40 + 64) / 2 = 54.6 >= 0 + 40) where d0 (64 + 40) is not
        ids.append(pd.submit(fresh[0], PARAMS))
        assert pd.placement(ids[1]) == ("p1", "d1")
        # p1 now has 40 unfinished tokens, p0 8, yet p0's read queue still keeps it out
        assert pd.prefill_views["p0"].queued_tokens == 8
        ids.append(pd.submit(fresh[1], PARAMS))
        assert pd.placement(ids[2])[0] == "p1"
        # with alpha raised, both are in the short-queue class: fewer unfinished tokens win
        assert pd.dualpath is not None
        pd.dualpath.thresholds = (10_000, 10_000)
        ids.append(pd.submit(fresh[2], PARAMS))
        assert pd.placement(ids[3])[0] == "p0"
        while pd.has_unfinished():
            pd.poll()
        assert [pd.release(i).token_ids for i in ids] == want
        assert pd.path_counts == {"prefill": 1, "decode": 0}
        assert set(pd.check_blocks().values()) == {0}
    finally:
        pd.shutdown()


def test_store_writes_pay_the_storage_links():
    """Prefill's store writes and decode's write-back pass their replica's emulated
    storage link (KV class), byte for byte."""
    budget = LinkBudget(storage_bps=20e6, chunk_bytes=16 << 10)
    prompt = tokens(151, 30)
    pd = PDCluster(
        pd_config(
            store=StoreConfig(dram_bytes=64 << 20, write_back=True),
            prefill=PDSideConfig(link_budget=budget),
            decode=PDSideConfig(link_budget=budget),
        )
    )
    try:
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=ANSWER)
        assert out.token_ids == colocated([prompt], ANSWER)[0]
        (p0,) = pd.prefills.values()
        (d0,) = pd.decodes.values()
        prefill_stored = pd.prefill_stats()["p0"].stored_blocks
        decode_stored = ray.get(d0.report_stats.remote()).stored_blocks
        assert (prefill_stored, decode_stored) == (7, 3)  # the prompt's, then the answer's
        prefill_links = ray.get(p0.link_bytes.remote())
        assert prefill_links["storage"] == {"exec": 0, "kv": 7 * pd.block_bytes}
        assert ray.get(d0.link_bytes.remote())["storage"] == {"exec": 0, "kv": 3 * pd.block_bytes}
    finally:
        pd.shutdown()


def test_the_decode_side_read_is_relayed_layer_by_layer():
    """On the decode read path the prefill replica reads layer 0 of the prefix from the
    decode replica before the decode replica has read the last layer from the store (a
    slow storage link there: ~0.3 s a layer)."""
    prompt = tokens(161, 30)  # 7 full blocks
    budget = LinkBudget(storage_bps=50_000, chunk_bytes=4096)
    pd = PDCluster(
        pd_config(
            store=StoreConfig(dram_bytes=64 << 20),
            read_path="decode",
            prefill=PDSideConfig(record_loads=True),
            decode=PDSideConfig(link_budget=budget, record_loads=True),
        )
    )
    try:
        pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        (p0,) = pd.prefills.values()
        (d0,) = pd.decodes.values()
        ray.get(p0.drop_local_cache.remote())
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == colocated([prompt])[0] and out.num_cached_tokens == 7 * BS
        assert pd.path_counts == {"prefill": 0, "decode": 1}
        relayed = ray.get(p0.load_timeline.remote())
        stored = ray.get(d0.load_timeline.remote())
        layers = 4
        assert [layer for layer, _ in stored] == list(range(layers))  # one load, in order
        assert first_after(relayed, "load-end", 0, 0.0) < stored[-1][1]
        assert set(pd.check_blocks().values()) == {0}
    finally:
        pd.shutdown()


def test_with_skewed_storage_links_the_dual_path_reads_on_the_faster_side():
    """Both sides' storage budgets known, the prefill side's 4x slower: with empty read
    queues the stored prefix is read where it ends first, the decode side (with equal
    links the tie goes to the prefill side); tokens as the colocated replica's."""
    slow, fast = LinkBudget(storage_bps=5e6), LinkBudget(storage_bps=20e6)
    first = tokens(161, 30)
    pd = PDCluster(
        pd_config(
            store=StoreConfig(dram_bytes=64 << 20, write_back=True),
            prefill=PDSideConfig(link_budget=slow),
            decode=PDSideConfig(link_budget=fast),
            read_path="dual",
        )
    )
    try:
        (out1,) = pd.generate(prompt_token_ids=[first], sampling_params=ANSWER)
        second = first + out1.token_ids + tokens(162, 7)
        ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
        (out2,) = pd.generate(prompt_token_ids=[second], sampling_params=ANSWER)
        assert out2.token_ids == colocated([second], ANSWER)[0]
        assert out2.num_cached_tokens > 0
        assert pd.path_counts == {"prefill": 0, "decode": 1}
        (d0,) = pd.decodes.values()
        assert ray.get(d0.report_stats.remote()).loaded_blocks > 0
    finally:
        pd.shutdown()
