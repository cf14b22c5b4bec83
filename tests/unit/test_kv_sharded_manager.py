"""KV-cache parallel block tables: start rank, spilling, prefix hits, accounting."""

from __future__ import annotations

import pytest

from policies.sequence import Sequence
from store.block_pool import BlockPool
from store.kv_sharded_manager import ShardedKVManager

BS = 4


def manager(kvp=2, blocks=16, limit=8, prefix=True):
    pools = [BlockPool(blocks, BS) for _ in range(kvp)]
    return ShardedKVManager(pools, limit, prefix), pools


def seq(rid, n, start=0):
    return Sequence(rid, list(range(start, start + n)), max_tokens=4)


def test_short_request_stays_on_one_rank():
    kv, pools = manager()
    s = seq("a", 6)
    assert kv.match_prefix(s) == 0
    assert kv.allocate(s, 6)
    shards = kv.shards("a")
    assert len(shards) == 1 and shards[0][1] == 0 and len(shards[0][2]) == 2
    assert sum(p.num_in_use for p in pools) == 2


def test_long_request_spills_to_the_next_rank_at_the_limit():
    kv, pools = manager(limit=8)
    s = seq("a", 14)
    kv.match_prefix(s)
    assert kv.allocate(s, 5)
    assert len(kv.shards("a")) == 1
    assert kv.allocate(s, 14)  # 8 on the start rank, 6 spilled
    (r0, f0, b0), (r1, f1, b1) = kv.shards("a")
    assert r1 == (r0 + 1) % 2 and (f0, f1) == (0, 8)
    assert (len(b0), len(b1)) == (2, 2)
    assert pools[r0].num_in_use == 2 and pools[r1].num_in_use == 2
    kv.free(s)
    assert all(p.num_in_use == 0 for p in pools)


def test_new_requests_start_on_the_emptier_rank():
    kv, pools = manager()
    a, b = seq("a", 8), seq("b", 8, start=100)
    kv.match_prefix(a)
    kv.allocate(a, 8)
    kv.match_prefix(b)
    kv.allocate(b, 8)
    assert kv.shards("a")[0][0] != kv.shards("b")[0][0]
    kv.free(a)
    kv.free(b)


def test_prefix_hit_picks_the_rank_holding_it():
    kv, pools = manager(blocks=16, limit=16)
    a = seq("a", 12)
    kv.match_prefix(a)
    kv.allocate(a, 12)
    a.num_computed_tokens = 12
    kv.commit(a)
    rank_a = kv.shards("a")[0][0]
    kv.free(a)
    filler = seq("f", 16, start=200)  # makes rank_a the fuller rank
    kv.match_prefix(filler)
    kv.allocate(filler, 16)
    b = seq("b", 12)  # same tokens as a
    assert kv.match_prefix(b) == 8  # two full blocks (the last token is always computed)
    assert kv.shards("b")[0][0] == rank_a
    kv.free(b)
    kv.free(filler)


def test_allocation_is_all_or_nothing_across_ranks():
    kv, pools = manager(blocks=3, limit=8)
    s = seq("a", 16)
    kv.match_prefix(s)
    assert kv.shards("a")[0][0] == 0  # equal pools: the lower rank
    taken = pools[1].allocate(2)  # leave one block on rank 1, where "a" would spill
    assert not kv.allocate(s, 16)  # needs 2 blocks on rank 1, has 1
    assert pools[0].num_in_use == 0 and pools[1].num_in_use == 2
    pools[1].release(taken)
    kv.free(s)


def test_a_request_longer_than_all_ranks_is_refused():
    kv, _ = manager(kvp=2, limit=8)
    s = seq("a", 20)
    kv.match_prefix(s)
    with pytest.raises(ValueError, match="2 ranks of 8 tokens"):
        kv.allocate(s, 17)
    kv.free(s)


def test_limit_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ValueError, match="multiple of the block size"):
        ShardedKVManager([BlockPool(4, BS)], 6)
