"""Links with a byte budget and two traffic classes, moving real bytes through the shared-
memory backend: the bytes arrive intact, the budget bounds the rate from above, and a
model-execution message overtakes a KV transfer in progress (waiting behind at most one
KV chunk). No timing thresholds: the rate bound is read on the link's own clock (one
that advances each time it is read), and the rest are counts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from store.shared_segment import SharedSegment
from store.transfer import TransferEngine
from store.transfer.links import (
    EXEC,
    KV,
    BudgetedTransfer,
    Link,
    LinkBudget,
    NodeLinks,
    split_ranges,
)


def test_split_ranges_cuts_into_chunks_and_keeps_every_byte():
    ranges = [(0, 100, 10), (50, 0, 25), (1000, 2000, 3)]
    groups = list(split_ranges(ranges, 8))
    assert all(sum(n for _, _, n in g) <= 8 for g in groups)
    flat = [(r + i, l + i) for g in groups for r, l, n in g for i in range(n)]
    want = [(r + i, l + i) for r, l, n in ranges for i in range(n)]
    assert flat == want


def test_budgeted_read_moves_identical_bytes_no_faster_than_the_budget():
    seg = SharedSegment.create(1 << 22)
    owner = TransferEngine("store", "node-a", seg)
    reader = TransferEngine("reader", "node-a")
    try:
        nbytes = 1 << 20
        data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        seg.array[4096 : 4096 + nbytes] = data
        rate = 4 << 20  # 4 MiB/s
        # a clock that reads 10 ms later each time it is read: the bucket's refills, not
        # the machine's speed, decide how much time passes
        ticks = iter(range(1 << 30))
        link = Link(
            "storage:node-a",
            rate,
            burst_bytes=64 << 10,
            chunk_bytes=64 << 10,
            clock=lambda: next(ticks) * 1e-2,
        )
        clock_at_start = link.clock()
        out = np.zeros(nbytes, dtype=np.uint8)
        local = reader.register(out)
        budgeted = BudgetedTransfer(reader, link)
        # two ranges, the second longer than a chunk: both are split
        half = nbytes // 2
        moved = budgeted.read_ranges(
            owner.endpoint, local, [(4096, 0, half), (4096 + half, half, nbytes - half)]
        )
        link_seconds = link.clock() - clock_at_start  # on the link's clock, not the wall's
        assert moved == nbytes
        assert np.array_equal(out, data)
        assert link.bytes[KV] == nbytes and link.bytes[EXEC] == 0
        assert link.grants[KV] == nbytes // (64 << 10)
        # the bucket starts full (one burst), then refills at `rate`
        assert link_seconds >= (nbytes - (64 << 10)) / rate
        # writing back through an unlimited link is a plain transfer
        assert BudgetedTransfer(reader, None).write_ranges(owner.endpoint, local, [(0, 0, 100)])
        assert np.array_equal(seg.array[:100], data[:100])
    finally:
        reader.close()
        owner.close()
        seg.close()


def run_messages_under_kv_load(cls) -> tuple[list[int], bool, list[bytearray], list[bytearray]]:
    """Four KV transfers of real bytes share one link; three chunk-sized messages of class
    ``cls`` go while they run. Returns how many KV chunks were granted while each message
    waited, whether the KV transfers were still under way, and the sent / received bytes."""
    chunk = 16 << 10
    link = Link("compute:n", 512 << 10, burst_bytes=chunk, chunk_bytes=chunk, kv_floor=0.0)
    rng = np.random.default_rng(1)
    sent = [bytearray(rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()) for _ in range(4)]
    received = [bytearray(len(s)) for s in sent]
    started = threading.Barrier(5)

    def transfer(i: int) -> None:
        def move(offset: int, n: int) -> None:
            received[i][offset : offset + n] = sent[i][offset : offset + n]
            if offset == chunk:
                started.wait(60)

        link.send(len(sent[i]), KV, move)

    threads = [threading.Thread(target=transfer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    waits = []
    for _ in range(3):
        before = link.grants[KV]
        link.send(chunk, cls)
        waits.append(link.grants[KV] - before)
    in_flight = link.grants[KV] < sum(len(s) for s in sent) // chunk
    for t in threads:
        t.join(120)
    return waits, in_flight, sent, received


def test_model_execution_messages_overtake_kv_transfers():
    waits, in_flight, sent, received = run_messages_under_kv_load(EXEC)
    assert in_flight, "the KV transfers were over before the messages went"
    # each message passed at most one KV chunk granted after it was sent
    assert max(waits) <= 1
    assert received == sent


def test_node_links_are_per_node_and_optional():
    links = NodeLinks(LinkBudget(storage_bps=1e6, compute_bps=None))
    a, b = links.storage("a"), links.storage("b")
    assert a is not None and b is not None and a is not b
    assert links.storage("a") is a
    assert links.compute("a") is None
    a.send(3000, KV)
    a.send(200, EXEC)
    assert links.granted("a") == {"storage": {"exec": 200, "kv": 3000}}
    assert links.granted("b") == {"storage": {"exec": 0, "kv": 0}}
    assert links.granted("c") == {}  # no link made for it yet


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="bytes_per_second"):
        Link("x", 0)
    link = Link("x", 1e6, burst_bytes=100, chunk_bytes=100)
    with pytest.raises(ValueError, match="exceeds the burst"):
        link.acquire(101, EXEC)


def test_a_budget_shared_by_processes_gives_each_an_equal_part():
    budget = LinkBudget(storage_bps=8e6, compute_bps=None, chunk_bytes=4096)
    assert budget.share(4) == LinkBudget(storage_bps=2e6, compute_bps=None, chunk_bytes=4096)
    assert budget.share(1) == budget
    with pytest.raises(ValueError, match="at least 1"):
        budget.share(0)
