"""KV reservation is checked per KV-parallel rank: a request's blocks live on the ranks its
shards are placed on, so free blocks on another rank do not cover its growth (or anyone
else's there)."""

from __future__ import annotations

from policies.chunking import FixedChunk
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import SeqStatus, Sequence
from store.block_pool import BlockPool
from store.kv_sharded_manager import ShardedKVManager

BS = 4


def run_step(sched: Scheduler, now: float) -> tuple[object, list[Sequence]]:
    step = sched.schedule(now)
    sampled = {
        s.request_id: 1
        for (s, _), flag in zip(step.entries, step.sample_flags(), strict=True)
        if flag
    }
    return step, sched.update(step, sampled, now)


def test_a_request_waits_for_room_on_its_own_rank_not_on_all_ranks_together():
    # Two ranks of 8 blocks (4 tokens each), 32 tokens per rank before a request spills.
    pools = [BlockPool(8, BS) for _ in range(2)]
    kv = ShardedKVManager(pools, 32)  # default placement: the longest cached prefix first
    sched = Scheduler(SchedulerConfig(64, 8), kv, chunk_rule=FixedChunk(None))
    # p leaves its 8-token prompt cached on rank 0 (the tie goes to the lower rank).
    p = Sequence("p", list(range(8)), max_tokens=1)
    sched.add(p)
    while sched.has_unfinished():
        run_step(sched, 0.0)
    # a grows to 4 + 29 - 1 = 32 tokens: all 8 blocks of its rank (rank 0 again: a tie).
    a = Sequence("a", list(range(100, 104)), max_tokens=29)
    sched.add(a)
    run_step(sched, 1.0)
    assert a.status is SeqStatus.RUNNING and kv.shards("a")[0][0] == 0
    # b shares p's prompt, cached on rank 0, so it is placed there; rank 0 has no block
    # a has not reserved, though rank 1 is empty (13 free blocks over both ranks would
    # cover a's 7 and b's own). It must not run there while a runs, else a's decode runs
    # out of blocks; it waits (and starts on rank 1 once p's prefix is evicted there).
    b = Sequence("b", [*range(8), 200], max_tokens=4)
    sched.add(b)
    step, _ = run_step(sched, 2.0)
    assert b.status is SeqStatus.WAITING and not step.preempted
    done: list[Sequence] = []
    for i in range(3, 200):
        if not sched.has_unfinished():
            break
        step, finished = run_step(sched, float(i))
        assert not step.preempted
        if a.status is SeqStatus.RUNNING and b.status is SeqStatus.RUNNING:
            assert kv.shards("b")[0][0] == 1
        done += finished
    assert sorted(s.request_id for s in done) == ["a", "b"]
    assert len(a.output_token_ids) == 29 and len(b.output_token_ids) == 4
    assert a.num_preemptions == b.num_preemptions == 0
    assert all(pool.num_in_use == 0 for pool in pools)


def test_blocks_per_rank_follow_the_shards():
    pools = [BlockPool(16, BS) for _ in range(3)]
    kv = ShardedKVManager(pools, 16, enable_prefix_caching=False)
    s = Sequence("s", list(range(40)), max_tokens=4)
    kv.match_prefix(s)
    start = kv.shards("s")[0][0]
    want = [0, 0, 0]
    # 43 tokens: 16 on the start rank (4 blocks), 16 on the next (4), 11 on the one after (3)
    for i, blocks in enumerate((4, 4, 3)):
        want[(start + i) % 3] = blocks
    assert kv.blocks_per_rank(s, 43) == want
    assert kv.blocks_per_rank(s, 0) == [0, 0, 0]
    assert kv.blocks_per_rank(s, 10_000) == [4, 4, 4]  # at most what the ranks hold
    assert kv.free_blocks_per_rank() == [16, 16, 16]
