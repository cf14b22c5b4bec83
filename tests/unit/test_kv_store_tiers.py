"""KV store shard logic: tiers, bounds, pins, chain touch, write visibility, SSD files."""

from __future__ import annotations

import numpy as np
import pytest

from store.kv_store_errors import InvalidBlockError, StoreFullError, WriteStateError
from store.shard_store import ShardStore
from store.ssd_tier import HEADER, SsdTier

B = 1024  # block bytes


def block(i: int, n: int = B) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def chain_put(store: ShardStore, hashes: list[int]) -> None:
    for i, h in enumerate(hashes):
        assert store.put(h, block(h), parent=hashes[i - 1] if i else None)


def test_put_get_roundtrip_and_dedupe():
    s = ShardStore(B, 4 * B)
    assert s.put(11, block(11))
    assert not s.put(11, block(99))  # already stored: first copy wins
    assert np.array_equal(s.get(11), block(11))
    assert s.get(12) is None
    assert s.tier_of(11) == "dram" and s.tier_of(12) is None
    # bytes, torch tensors and arrays of other dtypes are accepted as raw bytes
    import torch

    t = torch.arange(B // 4, dtype=torch.float32)
    assert s.put(12, t)
    assert np.array_equal(s.get(12), t.numpy().view(np.uint8))
    assert s.put(13, bytes(range(200)))
    assert s.get(13).tobytes() == bytes(range(200))


def test_dram_bound_in_bytes_and_drop_without_ssd():
    s = ShardStore(B, 3 * B + 100)  # room for 3 blocks
    assert s.dram.capacity_bytes == 3 * B
    for h in range(1, 6):
        s.put(h, block(h))
        assert s.stats()["dram_used_bytes"] <= 3 * B
    assert [s.contains(h) for h in range(1, 6)] == [False, False, True, True, True]
    events = s.drain_events()
    assert ("removed", 1) in events and ("removed", 2) in events
    assert s.drain_events() == []


def test_demotion_to_ssd_and_promotion_back(tmp_path):
    s = ShardStore(B, 2 * B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    for h in (1, 2, 3):
        s.put(h, block(h))
    assert s.tier_of(1) == "ssd" and s.tier_of(2) == "dram" and s.tier_of(3) == "dram"
    # the file is really on disk and holds the bytes after its header
    path = s.ssd.path(1)
    raw = path.read_bytes()
    assert len(raw) == HEADER.size + B and raw[HEADER.size :] == block(1).tobytes()
    # a get promotes it back (and demotes the LRU DRAM block to make room)
    assert np.array_equal(s.get(1), block(1))
    assert s.tier_of(1) == "dram" and not path.exists()
    assert s.tier_of(2) == "ssd"
    assert not any(kind == "removed" for kind, _ in s.drain_events())  # moves, not losses


def test_ssd_bound_in_bytes(tmp_path):
    s = ShardStore(B, B, ssd_bytes=2 * (HEADER.size + B), ssd_dir=tmp_path)
    for h in range(1, 6):
        s.put(h, block(h))
        assert s.ssd.used_bytes <= s.ssd.capacity_bytes
    assert len(list(tmp_path.glob("*.kv"))) == 2
    assert s.stats()["dram_blocks"] + s.stats()["ssd_blocks"] == 3


def test_ssd_files_survive_a_restart_and_read_back_identical(tmp_path):
    s = ShardStore(B, B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    chain_put(s, [1, 2, 3])  # 1 and 2 demoted to files
    del s
    s2 = ShardStore(B, B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    assert s2.tier_of(1) == "ssd" and s2.tier_of(2) == "ssd" and s2.tier_of(3) is None
    assert {h for kind, h in s2.drain_events() if kind == "stored"} == {1, 2}
    assert np.array_equal(s2.get(2), block(2)) and np.array_equal(s2.get(1), block(1))


def test_torn_or_partial_ssd_file_is_never_served(tmp_path):
    tier = SsdTier(tmp_path, 10 * B)
    tier.write(7, block(7))
    tier.write(8, block(8))
    # a crashed writer leaves a temporary file: never visible, removed on reopen
    (tmp_path / f".{9:016x}.dead{'.tmp'}").write_bytes(b"partial")
    # a torn file: right name, truncated payload
    data = tier.path(8).read_bytes()
    tier.path(8).write_bytes(data[: HEADER.size + 10])
    reopened = SsdTier(tmp_path, 10 * B)
    assert reopened.contains(7) and not reopened.contains(8) and not reopened.contains(9)
    assert not list(tmp_path.glob("*.tmp"))
    # corruption after opening: the CRC check turns it into a miss, not wrong bytes
    raw = bytearray(reopened.path(7).read_bytes())
    raw[-1] ^= 0xFF
    reopened.path(7).write_bytes(bytes(raw))
    out = np.empty(B, dtype=np.uint8)
    assert not reopened.read_into(7, out)
    assert not reopened.contains(7) and not reopened.path(7).exists()


def test_put_in_progress_is_invisible_until_commit():
    s = ShardStore(B, 4 * B)
    buf = s.begin_put(5, B)
    assert buf is not None
    buf[:] = block(5)
    assert not s.contains(5) and s.get(5) is None and s.match_prefix([5]) == 0
    assert s.begin_put(5, B) is None  # a second writer backs off
    s.commit_put(5)
    assert s.contains(5) and np.array_equal(s.get(5), block(5))
    # an aborted write never becomes visible and frees its slot
    buf = s.begin_put(6, B)
    s.abort_put(6)
    assert not s.contains(6) and s.stats()["pending_writes"] == 0
    assert s.dram.num_free_slots == 3
    with pytest.raises(WriteStateError):
        s.commit_put(6)


def test_pending_writes_are_never_evicted():
    s = ShardStore(B, 2 * B)
    s.begin_put(1, B)
    s.begin_put(2, B)
    with pytest.raises(StoreFullError):
        s.put(3, block(3))
    s.commit_put(1)
    s.commit_put(2)


def test_pinned_blocks_survive_eviction_pressure(tmp_path):
    s = ShardStore(B, 3 * B, ssd_bytes=2 * (HEADER.size + B), ssd_dir=tmp_path)
    chain_put(s, [1, 2])
    locs = s.acquire("req-a", [1, 2])
    assert [loc.block_hash for loc in locs] == [1, 2]
    for h in range(100, 140):  # far more than both tiers hold
        s.put(h, block(h))
    assert s.tier_of(1) == "dram" and s.tier_of(2) == "dram"  # not even demoted
    for loc in locs:  # the location handed out is still the block
        assert np.array_equal(
            s.dram.buffer[loc.offset : loc.offset + loc.nbytes], block(loc.block_hash)
        )
    with pytest.raises(WriteStateError):
        s.remove(1)
    assert s.release("req-a") == 2
    assert s.stats()["pinned_blocks"] == 0 and s.stats()["pinning_requests"] == 0
    for h in range(200, 210):
        s.put(h, block(h))
    assert not s.contains(1) and not s.contains(2)


def test_full_of_pinned_blocks_raises_a_clear_error():
    s = ShardStore(B, 2 * B)
    chain_put(s, [1, 2])
    s.pin("r", [1, 2])
    with pytest.raises(StoreFullError, match="pinned"):
        s.put(3, block(3))
    s.release("r")
    assert s.put(3, block(3))


def test_access_touches_the_whole_prefix_chain():
    s = ShardStore(B, 4 * B)
    chain_put(s, [1, 2, 3])  # chain 1 <- 2 <- 3
    s.put(50, block(50))  # unrelated, newer than the chain
    s.get(3)  # touching the tail refreshes 2 and 1 too
    s.put(51, block(51))  # evicts the LRU block: 50, not the chain's head
    assert not s.contains(50)
    assert all(s.contains(h) for h in (1, 2, 3, 51))
    # within a chain the tail goes first: a tail is useless without its head
    s.put(52, block(52))
    assert not s.contains(3) and s.contains(1) and s.contains(2)


def test_acquire_stops_at_first_miss_and_promotes(tmp_path):
    s = ShardStore(B, 2 * B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    chain_put(s, [1, 2, 3, 4])
    assert s.tier_of(1) == "dram" and s.tier_of(2) == "ssd"  # the chain's head stays hot
    locs = s.acquire("r", [1, 2, 3, 99, 4])
    assert [loc.block_hash for loc in locs] == [1, 2]  # DRAM holds 2 pinned blocks at most
    assert all(s.tier_of(loc.block_hash) == "dram" for loc in locs)
    for loc in locs:
        assert loc.parent == (None if loc.block_hash == 1 else loc.block_hash - 1)
    s.release("r")
    assert [loc.block_hash for loc in s.acquire("r2", [3, 99])] == [3]
    s.release("r2")


def test_get_into_with_dram_all_pinned_reads_straight_from_ssd(tmp_path):
    s = ShardStore(B, B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    chain_put(s, [1, 2])
    s.pin("r", [2])
    out = np.empty(B, dtype=np.uint8)
    assert s.get_into(1, out) and np.array_equal(out, block(1))
    assert s.tier_of(1) == "ssd"
    s.release("r")


def test_change_replica_in_process(tmp_path):
    a = ShardStore(B, 4 * B)
    b = ShardStore(B, 4 * B)
    chain_put(a, [1, 2, 3])
    assert a.change_replica([1, 2, 77], b) == [1, 2]
    assert np.array_equal(b.get(2), block(2)) and a.contains(2)
    assert a.change_replica([3], b, move=True) == [3]
    assert not a.contains(3) and np.array_equal(b.get(3), block(3))


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put(-1, b"x"),
        lambda s: s.put(1 << 64, b"x"),
        lambda s: s.put("abc", b"x"),
        lambda s: s.put(True, b"x"),
        lambda s: s.put(1, b""),
        lambda s: s.put(1, np.zeros(B + 1, np.uint8)),
        lambda s: s.put(1, np.zeros((4, 4), np.float32)[:, ::2]),
        lambda s: s.put(1, object()),
        lambda s: s.begin_put(1, 0),
        lambda s: s.get_into(2, np.zeros(3, np.uint8)),
    ],
)
def test_bad_input_gets_a_clear_error(call):
    s = ShardStore(B, 2 * B)
    s.put(2, block(2))
    with pytest.raises(InvalidBlockError):
        call(s)


def test_bad_configuration_errors():
    with pytest.raises(InvalidBlockError):
        ShardStore(0, 10)
    with pytest.raises(InvalidBlockError):
        ShardStore(B, B - 1)
    with pytest.raises(InvalidBlockError, match="ssd_dir"):
        ShardStore(B, B, ssd_bytes=B)


def test_reads_are_counted_by_the_tier_that_served_them(tmp_path):
    s = ShardStore(B, 3 * B, ssd_bytes=10 * B, ssd_dir=tmp_path)
    for h in (1, 2, 3, 4):
        s.put(h, block(h))
    assert [s.tier_of(h) for h in (1, 2, 3, 4)] == ["ssd", "dram", "dram", "dram"]
    out = np.empty(B, dtype=np.uint8)
    assert s.get_into(4, out) and s.get_into(1, out)  # one DRAM hit, one SSD hit (promoted)
    assert not s.get_into(9, out)  # a miss
    counts = {k: s.stats()[k] for k in ("dram_hit_blocks", "ssd_hit_blocks", "miss_blocks")}
    assert counts == {"dram_hit_blocks": 1, "ssd_hit_blocks": 1, "miss_blocks": 1}
    # acquire: each block of the visible prefix by the tier it is in when its turn comes
    # (promoting 2 demotes 3, the LRU unpinned block), the rest of the prefix as misses
    assert [s.tier_of(h) for h in (1, 2, 3)] == ["dram", "ssd", "dram"]
    locs = s.acquire("r", [1, 2, 3, 7, 8])
    assert [loc.block_hash for loc in locs] == [1, 2, 3]
    st = s.stats()
    assert (st["dram_hit_blocks"], st["ssd_hit_blocks"], st["miss_blocks"]) == (2, 3, 3)
