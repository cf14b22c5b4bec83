"""Which store shard a prefix goes to: the owner of its first block by rendezvous hashing
(spread over every shard; a shard leaving or joining moves only its own keys), or the
writer's own shard."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.shard_choice import check_placement, key_owner, local_choice

SHARDS = ["s0", "s1", "s2"]
KEYS = range(10_000, 10_600)


def test_keys_spread_over_every_shard_the_same_in_any_order():
    owners = {k: key_owner(k, SHARDS) for k in KEYS}
    assert owners == {k: key_owner(k, reversed(SHARDS)) for k in KEYS}
    counts = Counter(owners.values())
    assert set(counts) == set(SHARDS)
    assert min(counts.values()) > len(KEYS) / len(SHARDS) / 2  # no shard starved


def test_a_shard_leaving_or_joining_moves_only_its_own_keys():
    before = {k: key_owner(k, SHARDS) for k in KEYS}
    after = {k: key_owner(k, ["s0", "s2"]) for k in KEYS}
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "s1"}
    joined = {k: key_owner(k, [*SHARDS, "s3"]) for k in KEYS}
    assert {k for k in KEYS if joined[k] != before[k]} == {k for k in KEYS if joined[k] == "s3"}


def test_no_shard_owns_nothing():
    assert key_owner(1, []) is None
    assert local_choice("s0", [], []) is None


def test_local_is_the_wanted_shard_else_one_on_the_node_else_any():
    assert local_choice("s1", ["s2"], SHARDS) == "s1"
    assert local_choice("s9", ["s2"], SHARDS) == "s2"  # wanted is gone
    assert local_choice(None, [], SHARDS) == "s0"


def test_an_unknown_placement_is_refused_naming_the_choices():
    assert check_placement("local") == "local"
    with pytest.raises(ValueError, match="key, local"):
        check_placement("random")
