"""Session KV retention in a store shard: ordering against LRU, expiry, the tenant bound,
with real files for the SSD tier and an injected clock."""

from __future__ import annotations

import numpy as np
import pytest

from store.retention import RetentionTable
from store.shard_store import ShardStore
from store.ssd_tier import HEADER

B = 1024  # block bytes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, B, dtype=np.uint8)


def store(tmp_path, dram_blocks: int, ssd_blocks: int, clock: Clock, share: float = 1.0):
    return ShardStore(
        B,
        dram_blocks * B,
        ssd_blocks * (HEADER.size + B),
        tmp_path / "ssd" if ssd_blocks else None,
        tenant_retained_share=share,
        clock=clock,
    )


def test_table_expiry_extension_and_tenant_bound():
    clock = Clock()
    t = RetentionTable(max_blocks_per_tenant=3, clock=clock)
    assert t.retain([1, 2], "a", 10) == 2
    assert t.retain([9], "a", 0) == 0  # no retention asked: nothing kept
    assert t.is_retained(1) and not t.is_retained(9)
    clock.t += 5
    t.retain([2], "a", 10)  # re-retained: deadline moves to t+15, 2 becomes a's newest
    clock.t += 6  # 1's deadline (t+10) passed, 2's not
    assert t.expire() == [1] and t.expired == 1
    assert not t.is_retained(1) and t.is_retained(2)
    t.retain([3, 4, 5], "a", 10)  # a holds 2, 3, 4, 5 > 3: its oldest (2) loses retention
    assert t.revoked == 1 and not t.is_retained(2)
    assert [t.is_retained(h) for h in (3, 4, 5)] == [True, True, True]
    t.retain([6], "b", 10)  # b's bound is its own
    assert t.tenant_blocks("a") == 3 and t.tenant_blocks("b") == 1
    assert t.forget(3) and not t.forget(3) and t.num_retained == 3
    clock.t += 100
    assert sorted(t.expire()) == [4, 5, 6] and t.num_retained == 0 and t.expired == 4


def test_retained_blocks_outlive_lru_and_are_demoted_to_ssd_not_dropped(tmp_path):
    clock = Clock()
    s = store(tmp_path, dram_blocks=2, ssd_blocks=2, clock=clock)
    s.put(1, block(1))
    s.put(2, block(2), parent=1)
    assert s.retain([1, 2, 77], "a", 30) == 2  # 77 is not here: not retained
    for h in range(10, 20):  # a burst of other traffic, far more than the shard holds
        s.put(h, block(h))
    # DRAM all retained: the chain's tail was demoted to SSD, its root kept in DRAM, and
    # neither dropped; the other blocks were evicted around them
    assert s.tier_of(1) == "dram" and s.tier_of(2) == "ssd"
    assert sum(s.contains(h) for h in range(10, 20)) == 2  # one DRAM slot, one SSD file
    assert s.stats()["retained_blocks"] == 2
    out = np.empty(B, np.uint8)
    assert s.get_into(2, out) and np.array_equal(out, block(2))
    assert s.stats()["retention_hit_blocks"] == 1
    assert len(s.acquire("turn-2", [1, 2, 3])) == 2
    s.release("turn-2")
    assert s.stats()["retention_hit_blocks"] == 3


def test_without_retention_the_same_traffic_evicts_the_session(tmp_path):
    clock = Clock()
    s = store(tmp_path, dram_blocks=2, ssd_blocks=2, clock=clock)
    s.put(1, block(1))
    s.put(2, block(2), parent=1)
    for h in range(10, 20):
        s.put(h, block(h))
    assert not s.contains(1) and not s.contains(2)


def test_after_expiry_blocks_are_ordinary_lru_blocks(tmp_path):
    clock = Clock()
    s = store(tmp_path, dram_blocks=2, ssd_blocks=2, clock=clock)
    s.put(1, block(1))
    s.retain([1], None, 5)
    clock.t += 5  # the deadline itself ends retention
    assert s.stats()["expired_retentions"] == 1 and s.stats()["retained_blocks"] == 0
    for h in range(10, 20):
        s.put(h, block(h))
    assert not s.contains(1)
    assert s.stats()["retention_hit_blocks"] == 0
    assert s.acquire("late", [1]) == [] and s.stats()["retention_hit_blocks"] == 0


def test_unretained_demotion_never_displaces_retained_ssd_blocks(tmp_path):
    clock = Clock()
    s = store(tmp_path, dram_blocks=1, ssd_blocks=2, clock=clock)
    for h in (1, 2, 3):
        s.put(h, block(h))  # 1, 2 demoted to SSD, 3 in DRAM
    s.retain([1, 2], "a", 60)
    s.put(4, block(4))  # 3 (unretained) must leave DRAM: SSD is all retained -> 3 dropped
    assert not s.contains(3)
    assert s.tier_of(1) == s.tier_of(2) == "ssd" and s.tier_of(4) == "dram"
    # with no SSD tier a retained block is dropped only when nothing unretained is left
    t = store(tmp_path / "t", dram_blocks=2, ssd_blocks=0, clock=clock)
    t.put(1, block(1))
    t.retain([1], "a", 60)
    for h in (5, 6, 7):
        t.put(h, block(h))
        assert t.contains(1)


def test_tenant_bound_takes_retention_from_that_tenants_oldest_first(tmp_path):
    clock = Clock()
    s = store(tmp_path, dram_blocks=2, ssd_blocks=2, clock=clock, share=0.5)  # 2 blocks each
    for h in (1, 2, 3, 11):
        s.put(h, block(h))
    s.retain([1], "greedy", 60)
    s.retain([11], "other", 60)
    s.retain([2, 3], "greedy", 60)  # greedy over its 2: block 1 loses retention first
    st = s.stats()
    assert st["revoked_retentions"] == 1 and st["retained_blocks"] == 3
    assert not s.retention.is_retained(1) and s.retention.is_retained(11)
    for h in range(20, 30):  # pressure: the other tenant's block is still kept
        s.put(h, block(h))
    assert s.contains(11) and s.contains(2) and s.contains(3) and not s.contains(1)


def test_bad_share_is_refused():
    with pytest.raises(ValueError, match="tenant_retained_share"):
        ShardStore(B, 2 * B, tenant_retained_share=0.0)
    with pytest.raises(ValueError, match="max_blocks_per_tenant"):
        RetentionTable(max_blocks_per_tenant=0)
