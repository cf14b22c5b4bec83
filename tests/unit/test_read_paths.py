"""The Conductor's read-path bookkeeping: fixed modes, the dual mode's shorter queue, and
queues that drain when an attempt's prefill ends."""

from __future__ import annotations

import pytest

from actors.disagg.read_paths import ReadPaths


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
