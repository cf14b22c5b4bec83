"""Medha's KVP balancer: a new request starts on the KV-parallel rank with the least
pending prefill work (after its own, less what is cached there) and room for its shard."""

from __future__ import annotations

import pytest

from policies.kvp_balancer import choose_kvp_rank
from policies.sequence import Sequence
from store.block_pool import BlockPool
from store.kv_sharded_manager import RankLoad, ShardedKVManager

BS = 4


def test_least_pending_work_among_ranks_with_room():
    loads = [RankLoad(0, 500, 90, 100), RankLoad(1, 50, 10, 100), RankLoad(2, 0, 3, 100)]
    assert choose_kvp_rank(loads, need_blocks=8) == 1  # rank 2 has no room for the shard
    # a prefix cached on a busier rank can still make it the cheaper one
    loads = [RankLoad(0, 60, 90, 10), RankLoad(1, 50, 90, 100)]
    assert choose_kvp_rank(loads, need_blocks=8) == 0
    # no rank has room: the one with the most free blocks (it waits there)
    assert choose_kvp_rank([RankLoad(0, 0, 2, 9), RankLoad(1, 99, 5, 9)], 8) == 1
    with pytest.raises(ValueError):
        choose_kvp_rank([], 1)


def seq(rid, n, start=0, max_tokens=4):
    return Sequence(rid, list(range(start, start + n)), max_tokens=max_tokens)


def test_the_sharded_manager_balances_by_pending_prefill_and_spills_at_the_limit():
    pools = [BlockPool(64, BS) for _ in range(2)]
    kv = ShardedKVManager(pools, 64, enable_prefix_caching=False, choose_rank=choose_kvp_rank)
    long = seq("long", 100)  # 64 tokens on its start rank, 36 spilled to the other
    kv.match_prefix(long)
    assert kv.allocate(long, 16)  # its first chunk
    long.num_computed_tokens = 16
    start = kv.shards("long")[0][0]
    pending = kv.pending_prefill_tokens()
    assert pending[start] == 64 - 16 and pending[1 - start] == 100 - 64
    # a request past its prompt adds no prefill work: it lands on the less loaded rank
    done = seq("done", 60, start=300)
    done.num_computed_tokens = 59
    kv.match_prefix(done)
    assert kv.allocate(done, 60) and kv.shards("done")[0][0] == 1 - start
    assert kv.pending_prefill_tokens() == pending
    assert pools[start].num_free > pools[1 - start].num_free
    # the long request's remaining prompt weighs more on its start rank: a new request
    # goes to the other one, although the start rank has more free blocks
    short = seq("short", 8, start=500)
    kv.match_prefix(short)
    assert kv.shards("short")[0][0] == 1 - start
    default = ShardedKVManager([BlockPool(64, BS) for _ in range(2)], 64, False)
    loads = [RankLoad(r, pending[r], pools[r].num_free, 8) for r in range(2)]
    assert default.choose_rank(loads, 3) == start  # the default looks at free blocks only
    assert kv.allocate(long, 100)  # its rank set grows past the start rank's limit
    assert [r for r, _, _ in kv.shards("long")] == [start, 1 - start]
    kv.free(long)
    kv.free(short)
    kv.free(done)
    assert kv.pending_prefill_tokens() == [0, 0]
    assert all(p.num_in_use == 0 for p in pools)
