import random

import pytest

from policies.prefix_trie import PrefixTrie


def test_longest_match_with_an_available_target():
    t = PrefixTrie()
    t.insert([1, 2, 3], "a")
    t.insert([1, 2, 4], "b")
    t.insert([1, 5], "c")
    assert t.longest_match([1, 2, 3, 9], {"a", "b", "c"}) == (3, {"a"})
    # a is busy: the walk stops at [1, 2], held by a and b
    assert t.longest_match([1, 2, 3, 9], {"b", "c"}) == (2, {"b"})
    # only c available: [1] is the deepest node holding it
    assert t.longest_match([1, 2, 3], {"c"}) == (1, {"c"})
    assert t.longest_match([7], {"a", "c"}) == (0, {"a", "c"})
    assert t.longest_match([1, 2, 3], set()) == (0, set())
    assert t.match_length([1, 2, 4], "b") == 3
    assert t.match_length([1, 2, 4], "a") == 2
    t.check_invariants()


def test_eviction_is_oldest_first_and_keeps_subsets():
    t = PrefixTrie(max_entries=6)
    t.insert([1, 2, 3], "a")  # 4 entries: root, 1, 2, 3 for a
    t.insert([9], "b")  # 2 entries: root, 9 for b -> 6
    t.check_invariants()
    t.insert([9], "b")  # refresh b: a's entries are now the oldest
    t.insert([5], "c")  # 2 more -> evict a's two oldest entries: node 3, then node 2
    t.check_invariants()
    assert len(t) == 6
    assert t.match_length([1, 2, 3], "a") == 1
    assert t.longest_match([9], {"b"}) == (1, {"b"})
    assert t.evicted == 2


def test_subset_invariant_under_random_inserts_and_evictions():
    rng = random.Random(7)
    t = PrefixTrie(max_entries=60)
    for step in range(2000):
        depth = rng.randint(0, 6)
        keys = [rng.randint(0, 3) for _ in range(depth)]
        t.insert(keys, rng.choice("abcde"))
        if step % 97 == 0:
            t.remove_target(rng.choice("abcde"))
        t.check_invariants()
    assert t.evicted > 0


def test_remove_target_and_bad_size():
    t = PrefixTrie()
    t.insert([1, 2], "a")
    t.insert([1], "b")
    t.remove_target("a")
    t.check_invariants()
    assert t.longest_match([1, 2], {"a", "b"}) == (1, {"b"})
    assert 2 not in t.root.children[1].children
    with pytest.raises(ValueError):
        PrefixTrie(0)
