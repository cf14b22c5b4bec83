from __future__ import annotations

import pytest

from store.block_pool import BlockPool, NoFreeBlocksError
from store.hashing import chained_block_hashes, extend_block_hashes, root_hash


def test_hash_covers_whole_prefix_and_salt():
    a = chained_block_hashes(list(range(12)), 4)
    b = chained_block_hashes([99] + list(range(1, 12)), 4)
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b, strict=True)), "a changed first block changes all"
    assert chained_block_hashes(list(range(12)), 4, salt="t1") != a
    assert chained_block_hashes(list(range(13)), 4) == a, "partial blocks are not hashed"
    assert root_hash(None) == root_hash("")


def test_incremental_hashes_equal_full():
    tokens = list(range(40))
    hashes: list[int] = []
    for end in (3, 9, 17, 40):
        extend_block_hashes(hashes, tokens[:end], 8)
    assert hashes == chained_block_hashes(tokens, 8)


def test_allocate_release_and_integrity():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(5)
    assert pool.num_in_use == 5 and pool.num_free == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    pool.release(blocks[::-1])
    assert pool.num_free == 8
    with pytest.raises(ValueError):
        pool.release([blocks[0]])
    pool.check_integrity()


def test_prefix_hit_confirmed_by_tokens():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    pool.register(b, 123, [5, 6])
    assert pool.lookup(123, [5, 6]) == b
    assert pool.lookup(123, [5, 7]) is None, "a hash collision must not serve other tokens"
    pool.release([b])
    assert pool.num_cached == 1 and pool.num_free == 4
    pool.acquire(b)
    assert pool.num_in_use == 1 and pool.num_cached == 0
    pool.release([b])
    pool.check_integrity()


def test_eviction_is_oldest_release_first_and_emits_events():
    pool = BlockPool(3, 1)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i, [i])
    pool.release([blocks[2], blocks[0], blocks[1]])
    assert [e for e in pool.drain_events()] == [("stored", 100), ("stored", 101), ("stored", 102)]
    (got,) = pool.allocate(1)
    assert got == blocks[2]
    assert pool.drain_events() == [("evicted", 102)]
    assert pool.lookup(102, [2]) is None and pool.lookup(100, [0]) == blocks[0]
    pool.release([got])
    pool.check_integrity()


def test_duplicate_hash_keeps_first_copy():
    pool = BlockPool(2, 1)
    a, b = pool.allocate(2)
    pool.register(a, 7, [1])
    pool.register(b, 7, [1])
    assert pool.lookup(7, [1]) == a
    pool.release([a, b])
    assert pool.num_cached == 1
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = BlockPool(2, 1)
    pool.allocate(1)
    pool.ref_count[1] = 1  # a free block claims a reference
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.ref_count[1] = 0
