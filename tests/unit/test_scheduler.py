from __future__ import annotations

import pytest

from policies.chunking import FixedChunk
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import FinishReason, SeqStatus, Sequence
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager


def make(num_blocks=64, block_size=4, budget=32, chunk=None, max_seqs=16, caching=True):
    pool = BlockPool(num_blocks, block_size)
    kv = KVCacheManager(pool, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(budget, max_seqs), kv, chunk_rule=FixedChunk(chunk))
    return sched, kv, pool


def seq(rid, n, max_tokens=4, t=0.0, start=0):
    return Sequence(rid, list(range(start, start + n)), max_tokens, arrival_time=t)


def run_step(sched, now=0.0, token=1):
    step = sched.schedule(now)
    sampled = {
        s.request_id: token
        for (s, _), flag in zip(step.entries, step.sample_flags(), strict=True)
        if flag
    }
    return step, sched.update(step, sampled, now)


def run_to_completion(sched, limit=1000):
    done = []
    for i in range(limit):
        if not sched.has_unfinished():
            return done
        _, finished = run_step(sched, now=float(i))
        done.extend(finished)
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_respects_chunk_and_budget():
    sched, kv, pool = make(budget=8, chunk=3)
    sched.add(seq("a", 10))
    sched.add(seq("b", 10, t=1.0, start=100))  # another prompt: no block shared with a
    step = sched.schedule(0.0)
    assert step.num_tokens == {"a": 3, "b": 3}
    sched.update(step, {}, 0.0)
    assert sched.get("a").num_computed_tokens == 3


def test_decode_first_and_never_starved():
    sched, kv, pool = make(budget=4, chunk=None)
    sched.add(seq("a", 3, max_tokens=5))
    run_step(sched)  # prefill a fully, samples its first token
    sched.add(seq("b", 40, t=1.0))
    for _ in range(3):
        step, _ = run_step(sched)
        assert step.entries[0][0].request_id == "a" and step.entries[0][1] == 1
        assert step.num_tokens["b"] == 3, "prefill takes only what decode leaves"


def test_fcfs_order_and_head_of_line():
    sched, kv, pool = make(num_blocks=4, block_size=4, budget=64)
    sched.add(seq("big", 15, t=0.0))
    sched.add(seq("small", 2, t=1.0))
    step = sched.schedule(0.0)
    assert [s.request_id for s, _ in step.entries] == ["big"]
    sched.update(step, {"big": 1}, 0.0)


def test_every_request_finishes_with_its_tokens_and_no_leak():
    sched, kv, pool = make(budget=16, chunk=5)
    for i in range(6):
        sched.add(seq(f"r{i}", 7 + i, max_tokens=3 + i, t=float(i)))
    done = run_to_completion(sched)
    assert sorted(s.request_id for s in done) == [f"r{i}" for i in range(6)]
    for s in done:
        assert len(s.output_token_ids) == s.max_tokens
        assert s.finish_reason is FinishReason.LENGTH
    assert pool.num_in_use == 0


def test_stop_token_finishes_early():
    sched, kv, pool = make()
    s = Sequence("a", [1, 2, 3], 10, stop_token_ids=frozenset({9}))
    sched.add(s)
    run_step(sched, token=5)
    _, finished = run_step(sched, token=9)
    assert finished == [s] and s.finish_reason is FinishReason.STOP
    assert s.output_token_ids == [5, 9]
    assert pool.num_in_use == 0


def test_a_request_waits_until_the_blocks_its_whole_life_needs_are_free():
    # 6 blocks of 4 tokens; two requests that each grow to 15 tokens of KV need 4 blocks
    # each: the second waits for the first to finish instead of preempting its decode.
    sched, kv, pool = make(num_blocks=6, block_size=4, budget=64)
    a, b = seq("a", 8, max_tokens=8, t=0.0), seq("b", 8, max_tokens=8, t=1.0, start=100)
    sched.add(a)
    sched.add(b)
    done = []
    for i in range(200):
        if not sched.has_unfinished():
            break
        step, finished = run_step(sched, now=float(i))
        assert not step.preempted
        if a.status is SeqStatus.RUNNING:
            assert b.status is SeqStatus.WAITING
        done += finished
    assert [s.request_id for s in done] == ["a", "b"]
    assert a.num_preemptions == b.num_preemptions == 0 and len(b.output_token_ids) == 8
    assert pool.num_in_use == 0


def test_prefix_cache_hit_skips_computed_blocks():
    sched, kv, pool = make(block_size=4)
    sched.add(seq("a", 10, max_tokens=1))
    run_to_completion(sched)
    sched.add(seq("b", 10, max_tokens=1, t=5.0))
    step = sched.schedule(5.0)
    # 10 tokens: 2 full blocks cached (8 tokens); at least one token is always computed.
    assert step.num_tokens == {"b": 2}
    assert sched.get("b").num_cached_tokens == 8
    sched.update(step, {"b": 0}, 5.0)
    assert pool.num_in_use == 0


def test_full_prompt_hit_still_computes_last_token():
    sched, kv, pool = make(block_size=4)
    sched.add(seq("a", 8, max_tokens=1))
    run_to_completion(sched)
    sched.add(seq("b", 8, max_tokens=1))
    step = sched.schedule(1.0)
    assert step.num_tokens == {"b": 4}, "the last block is recomputed to get logits"
    sched.update(step, {"b": 0}, 1.0)


def test_salt_isolates_tenants():
    sched, kv, pool = make(block_size=4)
    sched.add(Sequence("a", list(range(9)), 1, salt="alice"))
    run_to_completion(sched)
    sched.add(Sequence("b", list(range(9)), 1, salt="bob"))
    sched.add(Sequence("c", list(range(9)), 1, salt="alice"))
    sched.schedule(0.0)
    assert sched.get("b").num_cached_tokens == 0
    assert sched.get("c").num_cached_tokens == 8
    sched.finish("b", FinishReason.ABORT, 0.0)
    sched.finish("c", FinishReason.ABORT, 0.0)
    assert pool.num_in_use == 0


def test_abort_frees_blocks_and_step_update_skips_it():
    sched, kv, pool = make()
    sched.add(seq("a", 6))
    step = sched.schedule(0.0)
    aborted = sched.finish("a", FinishReason.ABORT, 0.0)
    assert aborted is not None and aborted.status is SeqStatus.FINISHED
    assert sched.update(step, {"a": 1}, 0.0) == []
    assert pool.num_in_use == 0 and not sched.has_unfinished()


def test_max_num_seqs_caps_running():
    sched, kv, pool = make(max_seqs=2, budget=100)
    for i in range(4):
        sched.add(seq(f"r{i}", 3, t=float(i)))
    step = sched.schedule(0.0)
    assert len(step.entries) == 2
    sched.update(step, {s.request_id: 1 for s, _ in step.entries}, 0.0)
    run_to_completion(sched)


def test_duplicate_and_empty_requests_rejected():
    sched, kv, pool = make()
    sched.add(seq("a", 3))
    with pytest.raises(ValueError):
        sched.add(seq("a", 3))
    with pytest.raises(ValueError):
        sched.add(Sequence("e", [], 1))
    sched.finish("a", FinishReason.ABORT, 0.0)


# -- pipelined steps (several in flight before their updates) ------------------------------
def test_prefill_chunks_pipeline_but_a_pending_token_is_not_rescheduled():
    sched, kv, pool = make(budget=8, chunk=4)
    s = seq("a", 10)
    sched.add(s)
    steps = [sched.schedule(0.0) for _ in range(4)]
    assert [st.num_tokens for st in steps] == [{"a": 4}, {"a": 4}, {"a": 2}, {}]
    assert [st.starts for st in steps[:3]] == [[0], [4], [8]]
    assert [st.sample_flags() for st in steps[:3]] == [[False], [False], [True]]
    assert s.num_inflight_tokens == 10 and s.num_computed_tokens == 0
    for st in steps[:3]:
        sched.update(st, {"a": 99} if st.sample_flags()[0] else {}, 0.0)
    assert s.num_inflight_tokens == 0 and s.num_computed_tokens == 10
    assert s.output_token_ids == [99]
    assert sched.schedule(0.0).num_tokens == {"a": 1}  # decode resumes once the token is back


def running(sched, kv, rid, prompt, computed, start=0):
    """A request admitted with ``computed`` tokens of KV already in its blocks."""
    s = seq(rid, prompt, max_tokens=8, start=start)
    s.num_computed_tokens = computed
    assert kv.allocate(s, computed)
    sched.add_running(s, 0.0)
    return s


def test_a_decode_is_never_preempted_even_under_memory_pressure():
    # 3 blocks, all held: a decode that needs a new block waits; the other decodes go on.
    sched, kv, pool = make(num_blocks=3, block_size=4, budget=16)
    a = running(sched, kv, "a", 9, 8)  # 2 blocks; its next token needs a third
    running(sched, kv, "c", 3, 2, start=50)  # 1 block with room for its next tokens
    assert pool.num_free == 0
    step, _ = run_step(sched)
    assert step.num_tokens == {"c": 1} and not step.preempted
    assert a.status is SeqStatus.RUNNING and a.num_preemptions == 0
    sched.finish("c", FinishReason.STOP, 0.0)
    step, _ = run_step(sched)
    assert step.num_tokens == {"a": 1} and not step.preempted
    sched.finish("a", FinishReason.ABORT, 0.0)
    assert pool.num_in_use == 0


def test_prefills_yield_to_decodes_but_not_while_their_tokens_are_in_flight():
    sched, kv, pool = make(num_blocks=4, block_size=4, budget=16, chunk=4)
    a = running(sched, kv, "a", 8, 7)  # a decode at position 7: 2 blocks
    b = running(sched, kv, "b", 12, 4, start=50)  # a prefill, 4 of 12 computed: 1 block
    first = sched.schedule(0.0)  # a's decode, b's tokens 4..8 (its 2nd block): pool full
    assert first.num_tokens == {"a": 1, "b": 4} and pool.num_free == 0
    # b's next chunk needs a 3rd block; every other request has tokens in flight: it waits.
    assert sched.schedule(0.0).num_tokens == {}
    sched.update(first, {"a": 1}, 0.0)
    third = sched.schedule(0.0)  # a decodes into a 3rd block: the prefill b yields
    assert third.num_tokens == {"a": 1} and third.preempted == [b]
    assert a.num_preemptions == 0 and b.status is SeqStatus.WAITING
    sched.update(third, {"a": 2}, 0.0)
    sched.finish("a", FinishReason.ABORT, 0.0)
    sched.finish("b", FinishReason.ABORT, 0.0)
    assert pool.num_in_use == 0


def test_recompute_all_requeues_running_requests_in_order():
    sched, kv, pool = make(budget=32)
    a, b = seq("a", 6), seq("b", 6, start=50)
    sched.add(a)
    sched.add(b)
    st = sched.schedule(0.0)
    sched.update(st, {"a": 7, "b": 8}, 0.0)
    lost = sched.recompute_all()
    assert lost == [a, b] and sched.waiting == [a, b] and not sched.running
    assert pool.num_in_use == 0
    assert a.num_computed_tokens == 0 and a.token_ids == list(range(6)) + [7]
    pool.evict_all_cached()  # their KV is gone with the workers (the controller does this)
    again = sched.schedule(0.0)  # prompt and the sampled token are recomputed together
    assert again.num_tokens == {"a": 7, "b": 7}
    assert again.sample_flags() == [True, True]
    sched.update(again, {"a": 9, "b": 9}, 0.0)
    sched.finish("a", FinishReason.ABORT, 0.0)
    sched.finish("b", FinishReason.ABORT, 0.0)


def test_a_prompt_shared_with_a_running_prefill_waits_for_its_blocks():
    """Two samples of one prompt (and a third request behind them): the second waits while
    the first computes the shared blocks, then attaches them from the prefix cache and
    computes only its last block; the third, sharing nothing, is not held up."""
    sched, kv, pool = make(budget=8, chunk=4, block_size=4)
    sched.add(seq("s0", 13))
    sched.add(seq("s1", 13, t=0.5))
    sched.add(seq("other", 6, t=1.0, start=100))
    step, _ = run_step(sched)
    assert step.num_tokens == {"s0": 4, "other": 4}  # s1 waits: s0 computes block 0
    step, _ = run_step(sched)
    assert "s1" not in step.num_tokens  # s0 computes block 1, s1's next
    while sched.get("s0").num_computed_tokens < 12:
        run_step(sched)
    step, _ = run_step(sched)  # s0's blocks are cached: s1 attaches them, computes 1 token
    assert step.num_tokens.get("s1") == 1 and sched.get("s1").num_cached_tokens == 12
    run_to_completion(sched)


def test_without_prefix_caching_nothing_waits_for_a_sharer():
    sched, kv, pool = make(budget=8, chunk=4, block_size=4, caching=False)
    sched.add(seq("s0", 13))
    sched.add(seq("s1", 13, t=0.5))
    step, _ = run_step(sched)
    assert step.num_tokens == {"s0": 4, "s1": 4}


def test_prefill_beside_decodes_caps_prompt_tokens_only_while_decodes_run():
    pool = BlockPool(128, 4)
    kv = KVCacheManager(pool, enable_prefix_caching=False)
    config = SchedulerConfig(32, 16, prefill_beside_decodes=6)
    sched = Scheduler(config, kv, chunk_rule=FixedChunk(None))
    sched.add(seq("a", 20, max_tokens=8))
    step, _ = run_step(sched)
    assert step.num_tokens == {"a": 20}  # no decode runs: the whole budget
    sched.add(seq("b", 20, t=1.0, start=100))
    sched.add(seq("c", 20, t=2.0, start=200))
    step, _ = run_step(sched)
    # a decodes; b and c share 6 prompt tokens (b first), not the 31 the budget leaves
    assert step.num_tokens == {"a": 1, "b": 6}
    step, _ = run_step(sched)
    assert step.num_tokens == {"a": 1, "b": 6}


def test_prefill_beside_decodes_must_be_positive():
    with pytest.raises(ValueError, match="prefill_beside_decodes"):
        SchedulerConfig(32, 16, prefill_beside_decodes=0)
