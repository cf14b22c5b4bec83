from __future__ import annotations

import random

import pytest

from policies.prefix_index import PrefixIndex
from policies.routing import cached_prefix_blocks


def brute_lengths(index: PrefixIndex, ids: list[str], hashes: list[int]) -> dict[str, int]:
    return {rid: cached_prefix_blocks(hashes, index.cached(rid)) for rid in ids}


def test_lengths_stop_at_each_replicas_first_miss():
    idx = PrefixIndex()
    for rid in ("a", "b", "c"):
        idx.add_replica(rid)
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2])
    idx.add("c", [2, 3, 4])  # no block 0: worth nothing
    by_slot = idx.lengths_by_slot([1, 2, 3, 4, 5])
    assert [by_slot[idx.slot(r)] for r in ("a", "b", "c")] == [4, 2, 0]
    a, b = idx.bit("a"), idx.bit("b")
    # Runs: a and b hold blocks 0-1, then only a holds blocks 2-3.
    assert idx.runs([1, 2, 3, 4, 5]) == [(a | b, 2), (a, 4)]
    assert idx.runs([9, 1, 2]) == []
    assert idx.runs([]) == []
    # A hole in the middle ends the prefix even if later blocks are held.
    idx.discard("a", [2])
    assert idx.lengths_by_slot([1, 2, 3, 4])[idx.slot("a")] == 1
    idx.check()


def test_adopts_the_given_set_and_mutates_it_in_place():
    idx = PrefixIndex()
    mine = {7, 8}
    idx.add_replica("a", mine)
    assert idx.holders(7) == idx.bit("a")
    idx.apply_events("a", [("stored", 9), ("evicted", 7)])
    assert mine == {8, 9} and idx.cached("a") is mine
    idx.reset("a", [1, 2])
    assert mine == {1, 2} and idx.holders(8) == 0 and idx.holders(1) == idx.bit("a")
    idx.check()


def test_unknown_event_raises_after_applying_the_earlier_ones():
    idx = PrefixIndex()
    idx.add_replica("a")
    with pytest.raises(ValueError, match="bogus"):
        idx.apply_events("a", [("stored", 1), ("bogus", 2), ("stored", 3)])
    assert idx.cached("a") == {1}
    idx.check()


def test_removing_a_replica_clears_its_bit_and_frees_its_slot():
    idx = PrefixIndex()
    for rid in ("a", "b", "c"):
        idx.add_replica(rid)
        idx.add(rid, [1, 2])
    slot_b = idx.slot("b")
    idx.remove_replica("b")
    assert "b" not in idx
    assert idx.holders(1) == idx.bit("a") | idx.bit("c")
    idx.add_replica("d")  # reuses b's slot, and starts empty
    assert idx.slot("d") == slot_b
    assert idx.lengths_by_slot([1, 2])[slot_b] == 0
    idx.remove_replica("a")
    idx.remove_replica("c")
    assert idx.holders(1) == 0  # no replica holds it: no entry left
    idx.remove_replica("nobody")  # a no-op
    idx.check()


def test_random_operations_agree_with_per_replica_sets():
    rng = random.Random(0)
    idx = PrefixIndex()
    ids: list[str] = []
    universe = list(range(40))
    next_id = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.05 or not ids:
            rid = f"r{next_id}"
            next_id += 1
            idx.add_replica(rid, set(rng.sample(universe, 5)))
            ids.append(rid)
        elif op < 0.08 and len(ids) > 1:
            idx.remove_replica(ids.pop(rng.randrange(len(ids))))
        elif op < 0.5:
            idx.add(rng.choice(ids), rng.sample(universe, rng.randrange(6)))
        elif op < 0.7:
            idx.discard(rng.choice(ids), rng.sample(universe, rng.randrange(6)))
        elif op < 0.9:
            kinds = ("stored", "evicted")
            idx.apply_events(rng.choice(ids), [(rng.choice(kinds), rng.choice(universe))])
        else:
            idx.reset(rng.choice(ids), rng.sample(universe, rng.randrange(10)))
        hashes = [rng.choice(universe) for _ in range(rng.randrange(8))]
        if rng.random() < 0.5:
            hashes = sorted(idx.cached(rng.choice(ids)))[:6] + hashes  # share a prefix
        by_slot = idx.lengths_by_slot(hashes)
        assert {rid: by_slot[idx.slot(rid)] for rid in ids} == brute_lengths(idx, ids, hashes)
        runs = idx.runs(hashes)
        for (m0, e0), (m1, e1) in zip(runs, runs[1:], strict=False):
            assert m1 & ~m0 == 0 and m1 != m0 and e1 > e0  # shrinking holders, growing ends
        if step % 100 == 0:
            idx.check()
    idx.check()
