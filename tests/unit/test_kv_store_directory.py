"""The cluster-wide block directory: updates from shard events, prefix lookups, dead shards."""

from __future__ import annotations

import numpy as np
import pytest

from store.block_directory import BlockDirectory
from store.kv_store_errors import InvalidBlockError
from store.shard_store import ShardStore


def test_events_from_a_shard_keep_the_directory_exact():
    d = BlockDirectory()
    d.add_shard("s0")
    s = ShardStore(16, 32)  # two blocks
    for h in (1, 2, 3):
        s.put(h, np.full(16, h, np.uint8), parent=h - 1 or None)
    d.apply_events("s0", s.drain_events())
    assert d.blocks_of("s0") == frozenset(h for h in (1, 2, 3) if s.contains(h))
    assert len(d) == 2


def test_prefix_lookups_and_best_holder():
    d = BlockDirectory()
    for shard in ("a", "b"):
        d.add_shard(shard)
    for h in (1, 2, 3):
        d.add(h, "a")
    for h in (1, 2, 3, 4):
        d.add(h, "b")
    d.add(5, "a")
    assert d.holders(1) == {"a", "b"}
    assert d.match_prefix([1, 2, 3, 4, 5, 6]) == 5
    assert d.prefix_len("a", [1, 2, 3, 4]) == 3
    assert d.best_holder([1, 2, 3, 4, 5]) == ("b", 4)
    assert d.best_holder([9]) == (None, 0) and d.best_holder([]) == (None, 0)
    d.discard(4, "b")
    assert d.best_holder([1, 2, 3, 4]) == ("a", 3)  # tie broken by shard id


def test_dead_shard_drops_out_and_is_not_resurrected():
    d = BlockDirectory()
    d.add_shard("a")
    d.add_shard("b")
    for h in (1, 2):
        d.add(h, "a")
    d.add(1, "b")
    assert d.remove_shard("a") == 2
    assert d.holders(1) == {"b"} and d.holders(2) == frozenset()
    assert d.match_prefix([1, 2]) == 1 and "a" not in d.shards
    d.apply_events("a", [("stored", 7)])  # a late event from the dead shard
    assert d.holders(7) == frozenset() and len(d) == 1


def test_bad_input():
    d = BlockDirectory()
    with pytest.raises(ValueError):
        d.add_shard("")
    d.add_shard("a")
    with pytest.raises(InvalidBlockError):
        d.add(-3, "a")
    with pytest.raises(ValueError, match="unknown store event"):
        d.apply_events("a", [("moved", 1)])
