"""The Conductor's read-path bookkeeping: fixed modes, the dual mode's shorter queue, and
queues that drain when an attempt's prefill ends."""

from __future__ import annotations

import pytest

from actors.disagg.read_paths import ReadPaths, storage_rates


def test_dual_reads_on_the_side_with_the_shorter_queue_and_queues_drain():
    rp = ReadPaths("dual")
    assert rp.choose("a#1", 10, "p0", "d0") == "prefill"  # tie: the prefill side
    assert rp.choose("b#1", 10, "p0", "d0") == "decode"
    assert rp.choose("c#1", 5, "p0", "d0") == "prefill"
    assert rp.queue == {"p0": 15, "d0": 10}
    rp.done("a#1")
    rp.done("a#1")  # once only
    assert rp.queue == {"p0": 5, "d0": 10}
    assert rp.choose("d#1", 1, "p0", "d0") == "prefill"
    assert rp.counts == {"prefill": 3, "decode": 1}
    assert rp.choose("e#1", 0, "p0", "d0") == "prefill"  # nothing stored: nothing queued
    assert rp.counts == {"prefill": 3, "decode": 1}


def test_fixed_modes_and_bad_modes():
    rp = ReadPaths("decode")
    assert [rp.choose(f"{i}", 3, "p", "d") for i in range(3)] == ["decode"] * 3
    assert rp.queue == {"d": 9}
    with pytest.raises(ValueError, match="read_path must be one of"):
        ReadPaths("both")


def test_with_both_sides_rates_the_read_goes_where_it_ends_first():
    from store.transfer.links import LinkBudget

    rates = storage_rates(LinkBudget(storage_bps=1e6), LinkBudget(storage_bps=3e6), 1000)
    assert rates == (1000.0, 3000.0)  # blocks per second on each side
    rp = ReadPaths("dual", rates)
    # the decode side reads 3x faster: 3 of 4 equal reads go there
    paths = [rp.choose(f"{i}#1", 30, "p0", "d0") for i in range(4)]
    assert paths.count("decode") == 3
    assert rp.queue == {"p0": 30, "d0": 90}
    # a side without a limit: rates unknown, the shorter queue decides
    assert storage_rates(LinkBudget(storage_bps=1e6), LinkBudget(), 1000) is None
    assert storage_rates(None, LinkBudget(storage_bps=1e6), 1000) is None
