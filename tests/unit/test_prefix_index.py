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


def test_cached_is_a_live_read_only_view_of_the_masks():
    idx = PrefixIndex()
    idx.add_replica("a", [7, 8])
    idx.add_replica("b", [8])
    mine = idx.cached("a")
    assert idx.holders(7) == idx.bit("a") and idx.holders(8) == idx.bit("a") | idx.bit("b")
    idx.apply_events("a", [("stored", 9), ("evicted", 7), ("stored", 9)])
    assert mine == {8, 9} and idx.cached("a") is mine and len(mine) == 2
    assert 8 in mine and 7 not in mine and "x" not in mine
    assert mine >= {8} and mine & {9, 10} == {9} and isinstance(mine & {9}, set)
    assert not hasattr(mine, "add")  # one copy of each hash: change it through the index
    idx.reset("a", [1, 2, 2])
    assert mine == {1, 2} and idx.holders(8) == idx.bit("b") and idx.holders(1) == idx.bit("a")
    assert idx.counts[idx.slot("a")] == 2 and idx.prefix_length("a", [1, 2, 3]) == 2
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
    gone = idx.cached("b")
    idx.remove_replica("b")
    assert gone == set() and len(gone) == 0  # a removed replica's view reads as empty
    assert "b" not in idx
    assert idx.holders(1) == idx.bit("a") | idx.bit("c")
    idx.add_replica("d")  # reuses b's slot, and starts empty
    assert idx.slot("d") == slot_b
    assert idx.lengths_by_slot([1, 2])[slot_b] == 0
    idx.add("d", [1])
    assert idx.cached("d") == {1} and gone == set()  # even after its slot is reused
    idx.discard("d", [1, 1, 5])
    assert idx.cached("d") == set() and idx.holders(1) == idx.bit("a") | idx.bit("c")
    idx.remove_replica("a")
    idx.remove_replica("c")
    assert idx.holders(1) == 0  # no replica holds it: no entry left
    idx.remove_replica("nobody")  # a no-op
    idx.check()


def test_random_operations_agree_with_per_replica_sets():
    """Against a model kept as one plain set per replica: every operation, duplicates in
    the inputs included, leaves the same hashes, sizes and prefix lengths."""
    rng = random.Random(0)
    idx = PrefixIndex()
    model: dict[str, set[int]] = {}
    universe = list(range(40))
    next_id = 0
    for step in range(3000):
        ids = list(model)
        op = rng.random()
        if op < 0.05 or not ids:
            rid = f"r{next_id}"
            next_id += 1
            start = rng.choices(universe, k=5)
            idx.add_replica(rid, start)
            model[rid] = set(start)
        elif op < 0.08 and len(ids) > 1:
            rid = ids[rng.randrange(len(ids))]
            idx.remove_replica(rid)
            del model[rid]
        elif op < 0.5:
            rid, hs = rng.choice(ids), rng.choices(universe, k=rng.randrange(6))
            idx.add(rid, hs)
            model[rid].update(hs)
        elif op < 0.7:
            rid, hs = rng.choice(ids), rng.choices(universe, k=rng.randrange(6))
            idx.discard(rid, hs)
            model[rid].difference_update(hs)
        elif op < 0.9:
            rid = rng.choice(ids)
            events = [
                (rng.choice(("stored", "evicted")), rng.choice(universe))
                for _ in range(rng.randrange(4))
            ]
            idx.apply_events(rid, events)
            for kind, h in events:
                (model[rid].add if kind == "stored" else model[rid].discard)(h)
        else:
            rid, hs = rng.choice(ids), rng.choices(universe, k=rng.randrange(10))
            idx.reset(rid, hs)
            model[rid] = set(hs)
        ids = list(model)
        hashes = [rng.choice(universe) for _ in range(rng.randrange(8))]
        if rng.random() < 0.5:
            hashes = sorted(model[rng.choice(ids)])[:6] + hashes  # share a prefix
        by_slot = idx.lengths_by_slot(hashes)
        expected = {rid: cached_prefix_blocks(hashes, model[rid]) for rid in ids}
        assert {rid: by_slot[idx.slot(rid)] for rid in ids} == expected
        assert brute_lengths(idx, ids, hashes) == expected
        rid = rng.choice(ids)
        assert idx.prefix_length(rid, hashes) == expected[rid]
        assert len(idx.cached(rid)) == len(model[rid])
        runs = idx.runs(hashes)
        for (m0, e0), (m1, e1) in zip(runs, runs[1:], strict=False):
            assert m1 & ~m0 == 0 and m1 != m0 and e1 > e0  # shrinking holders, growing ends
        if step % 100 == 0:
            assert all(idx.cached(r) == model[r] for r in ids)
            idx.check()
    assert all(idx.cached(r) == model[r] for r in model)
    idx.check()
