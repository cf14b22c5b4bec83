"""The KV managers as the engine's only door to KV (``actors.engine.kv_cache.KVCache``):
statistics, events and checks over every rank, and a one-rank cache's blocks outside any
request table (a P/D replica's loads into its prefix cache)."""

from __future__ import annotations

import pytest

from actors.engine.kv_cache import KVCache
from policies.sequence import Sequence
from store.block_pool import BlockPool
from store.hashing import chained_block_hashes
from store.kv_manager import KVCacheManager
from store.kv_sharded_manager import ShardedKVManager

BS = 4


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), max_tokens=max_tokens)


def computed(kv: KVCache, s: Sequence) -> None:
    """``s``'s prompt is allocated, computed and committed to the prefix cache."""
    kv.match_prefix(s)
    assert kv.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.commit(s)


@pytest.mark.parametrize("kvp", [1, 2])
def test_views_over_every_rank(kvp: int) -> None:
    pools = [BlockPool(8, BS) for _ in range(kvp)]
    kv: KVCache = (
        KVCacheManager(pools[0]) if kvp == 1 else ShardedKVManager(pools, rank_token_limit=16)
    )
    assert kv.kvp == kvp and kv.max_tokens == 32  # 8 blocks; 2 ranks of 16 tokens
    prompt = list(range(9))
    s = seq("a", prompt)
    computed(kv, s)
    assert kv.num_used_blocks == 3 and kv.check_blocks().count(3) == 1
    assert kv.block_table("a") == kv.shards("a")[0][2]
    hashes = chained_block_hashes(prompt, BS)
    assert kv.cached_hashes() == sorted(hashes)
    assert kv.drain_events() == [("stored", h) for h in hashes]
    assert kv.drain_events() == []
    assert kv.likely_cached_blocks(hashes + [12345]) == 2
    kv.free(s)
    assert kv.num_used_blocks == 0 and kv.check_blocks() == [0] * kvp
    assert kv.evict_all_cached() == 2
    assert kv.cached_hashes() == [] and kv.likely_cached_blocks(hashes) == 0
    assert kv.drain_events() == [("evicted", h) for h in hashes[::-1]]  # tail first


def test_published_blocks_are_found_and_return_to_the_cache() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    prompt = list(range(16))
    hashes = chained_block_hashes(prompt, BS)
    a = seq("a", prompt[:8] + [99])
    computed(kv, a)
    kv.free(a)  # blocks 0-1 stay cached
    held = kv.cached_prefix(hashes, prompt)
    assert len(held) == 2 and kv.cached_block(hashes[1], prompt[4:8]) == held[1]
    assert kv.cached_block(hashes[1], prompt[:4]) is None  # tokens are compared
    kv.hold(held)
    free = kv.num_free_blocks
    blocks = kv.allocate_published(hashes, prompt, 2, 2)  # blocks 2-3, loaded elsewhere
    kv.unhold(held)
    assert kv.num_free_blocks == free  # 2 published in use, the held 2 evictable again
    assert kv.cached_prefix(hashes, prompt) == held + blocks
    assert kv.num_used_blocks == 2
    kv.unhold(blocks)  # the load finished: they are cached
    assert kv.num_used_blocks == 0 and kv.cached_prefix(hashes, prompt) == held + blocks
    kv.check_blocks()


def test_unpublished_blocks_are_freed() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    prompt = list(range(8))
    hashes = chained_block_hashes(prompt, BS)
    blocks = kv.allocate_published(hashes, prompt, 0, 2)
    kv.unpublish(blocks)  # the load failed
    assert kv.cached_prefix(hashes, prompt) == []
    kv.unhold(blocks)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 8 and kv.cached_hashes() == []
    assert kv.check_blocks() == [0]
