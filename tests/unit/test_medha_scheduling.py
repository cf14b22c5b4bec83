"""Medha's scheduling on plain data: the deadline orderings (EDF, LRS, ILRS), the batch
packer (adaptive chunks, prefill-prefill batching), driven through the real scheduler and
KV manager, with time advanced by the runtime predictor's batch time."""

from __future__ import annotations

import pytest

from placement.runtime_predictor import RuntimePredictor
from policies.batch_packer import BatchPacker, PrefillCandidate
from policies.chunking import FixedChunk
from policies.ordering import FCFS
from policies.pd_costs import LinearPrefillTime
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import Sequence
from policies.slack import EDF, ILRS, LRS, Deadlines, make_ordering
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager


def predictor(pairs: float = 0.0, chunk_size: int = 32) -> RuntimePredictor:
    p = RuntimePredictor(chunk_size=chunk_size)
    p.prefill_time = LinearPrefillTime(
        base=1e-3, per_new_token=1e-4, per_cached_token=1e-7, per_attention_pair=pairs
    )
    return p


def scheduler(ordering=None, budget=32, chunk=32, packer=None, num_blocks=4096):
    kv = KVCacheManager(BlockPool(num_blocks, 16), enable_prefix_caching=False)
    rule = FixedChunk(chunk)
    return Scheduler(SchedulerConfig(budget, 256), kv, ordering, rule, packer), kv


class Clock:
    """Runs a scheduler with simulated time: each step takes the predictor's batch time."""

    def __init__(self, sched: Scheduler, pred: RuntimePredictor) -> None:
        self.sched, self.pred, self.now = sched, pred, 0.0
        self.steps: list[list[tuple[str, int, int]]] = []  # (id, new tokens, context)

    def step(self) -> list[tuple[str, int, int]]:
        step = self.sched.schedule(self.now)
        batch = [
            (s.request_id, n, at) for (s, n), at in zip(step.entries, step.starts, strict=True)
        ]
        self.steps.append(batch)
        self.now += self.pred.batch_time([(n, at) for _, n, at in batch]) or 1e-3
        sampled = {
            s.request_id: 1
            for (s, _), flag in zip(step.entries, step.sample_flags(), strict=True)
            if flag
        }
        self.sched.update(step, sampled, self.now)
        return batch


def req(rid: str, n: int, t: float, max_tokens: int = 1, slo: float | None = None) -> Sequence:
    s = Sequence(rid, [7] * n, max_tokens, arrival_time=t)
    s.ttft_slo = slo
    return s


def short_behind_long(ordering, **kw) -> tuple[Sequence, Sequence]:
    pred = predictor()
    sched, _ = scheduler(ordering(Deadlines(pred)) if ordering else None, **kw)
    clock = Clock(sched, pred)
    long = req("long", 2048, 0.0)
    sched.add(long)
    for _ in range(5):
        clock.step()
    short = req("short", 32, clock.now)
    sched.add(short)
    while sched.has_unfinished():
        clock.step()
    return long, short


def test_ilrs_serves_a_short_request_behind_a_long_one_before_the_long_one_finishes():
    long, short = short_behind_long(ILRS)
    assert short.first_token_time < long.first_token_time
    # FCFS: the running prefill keeps the budget, the short one waits for the whole prompt
    long, short = short_behind_long(None)
    assert short.first_token_time > long.first_token_time


def stream_of_shorts(kind) -> tuple[Sequence, float, int]:
    """A long request at t=0 and a short one arriving every step (as fast as one step
    serves one: the shorts alone keep the replica busy), each with a TTFT SLO of 3x its
    predicted prefill alone, at least 0.1 s. Returns the long one, its deadline and the
    prompt tokens it had computed at half its deadline."""
    pred = predictor()
    deadlines = Deadlines(pred, slo_factor=3.0, min_slo=0.1)
    sched, _ = scheduler(kind(deadlines))
    clock = Clock(sched, pred)
    long = req("long", 1024, 0.0)
    sched.add(long)
    deadline = deadlines.deadline(long)
    half = None
    for i in range(200):
        sched.add(req(f"s{i}", 32, clock.now))
        clock.step()
        if half is None and clock.now >= deadline / 2:
            half = long.num_computed_tokens
    assert half is not None
    return long, deadline, half


def test_edf_starves_a_long_request_under_a_stream_of_short_ones_where_ilrs_does_not():
    # EDF: every fresh short request's deadline is nearer than the long one's, until the
    # long one's deadline is close; it gets nothing before then.
    long, deadline, half = stream_of_shorts(EDF)
    assert half == 0 and long.first_scheduled_time > 0.7 * deadline
    # ILRS: the long request's slack relative to its deadline falls below a waiting short
    # one's; it is served from the start and shares the replica with the stream.
    long, deadline, half = stream_of_shorts(ILRS)
    assert long.first_scheduled_time == 0.0 and half >= 0.4 * 1024


def test_orderings_rank_by_deadline_slack_and_relative_slack():
    pred = predictor()
    d = Deadlines(pred, slo_factor=3.0)
    a = req("a", 2048, 0.0)
    b = req("b", 32, 0.5)
    assert d.slo(a) == pytest.approx(3 * pred.remaining_prefill_time(2048, 0))
    assert EDF(d).key(b, 0.5) < EDF(d).key(a, 0.5)  # b's deadline is nearer
    # an explicit SLO on the request wins over the derived one
    c = req("c", 32, 0.0, slo=10.0)
    assert d.deadline(c) == 10.0
    # slack in seconds favours the short one, relative slack the long one that waited
    assert LRS(d).key(b, 0.5) < LRS(d).key(a, 0.5)
    assert ILRS(d).key(a, 0.5) < ILRS(d).key(b, 0.5)
    # a request past its prompt ranks ahead of every prefill (never a preemption victim)
    a.num_computed_tokens = 2048
    a.append_token(1)
    assert ILRS(d).key(a, 0.5) < ILRS(d).key(b, 0.5) and EDF(d).key(a, 9) < EDF(d).key(b, 9)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_ordering("sjf", d)
    assert isinstance(make_ordering("ilrs", d), ILRS)
    assert FCFS().ranks_prefills is False and FCFS().urgency(b, 0.5) == 1.0


# -- the batch packer ----------------------------------------------------------------------
def decodes_with_long_prompt(target: float, prompt: int = 16384):
    pred = predictor(pairs=1e-8, chunk_size=256)
    packer = BatchPacker(pred, target_batch_time=target, max_share=0.5)
    sched, kv = scheduler(ILRS(Deadlines(pred)), budget=8192, chunk=None, packer=packer)
    clock = Clock(sched, pred)
    for i in range(4):
        sched.add(req(f"d{i}", 64, 0.0, max_tokens=10_000))
    clock.step()  # their prompts
    long = req("long", prompt, clock.now)
    sched.add(long)
    return sched, clock, pred, packer, long


def test_the_long_prefills_chunk_shrinks_as_its_kv_grows_and_the_batch_stays_under_target():
    target = 0.05
    sched, clock, pred, packer, long = decodes_with_long_prompt(target)
    chunks = []
    while not long.output_token_ids:
        batch = clock.step()
        assert pred.batch_time([(n, at) for _, n, at in batch]) <= target + 1e-12
        assert sum(n == 1 for _, n, _ in batch) == 4  # the decodes run every step
        chunks += [(n, at) for rid, n, at in batch if rid == "long"]
    sizes = [n for n, _ in chunks]
    assert sum(sizes) == 16384
    assert all(
        a >= b for a, b in zip(sizes[:-2], sizes[1:-1], strict=True)
    )  # the last one is what is left
    assert sizes[0] > 1.5 * sizes[-2]
    for n, at in chunks[:-1]:  # never below the efficient minimum
        assert n >= packer.floor(at)


def test_short_prefills_ride_with_the_long_one_their_share_capped():
    target = 0.05
    sched, clock, pred, packer, _ = decodes_with_long_prompt(target)
    for _ in range(3):
        clock.step()  # the long prefill is under way
    sched.add(req("short", 200, clock.now))
    batch = clock.step()
    ids = {rid: n for rid, n, _ in batch}
    assert "short" in ids and "long" in ids  # no head-of-line blocking, no stall
    assert pred.batch_time([(n, at) for _, n, at in batch]) <= target + 1e-12


def test_packer_on_plain_data():
    pred = predictor(pairs=2e-9)
    packer = BatchPacker(pred, target_batch_time=0.03, max_share=0.25)
    decodes = [(1, 500)] * 8
    long = PrefillCandidate(uncomputed=50_000, context=1000, urgency=0.0)
    short = PrefillCandidate(uncomputed=5000, context=0, urgency=1.0)
    alone = packer.pack(decodes, [long], budget=100_000)
    both = packer.pack(decodes, [long, short], budget=100_000)
    t0 = pred.batch_time(decodes)
    # a less urgent short one (not the longest) gets at most its capped share of the room
    share = pred.batch_time([*decodes, (both[1], 0)]) - t0
    assert 0 < share <= 0.25 * (0.03 - t0) + 1e-12
    assert 0 < both[0] < alone[0]
    assert pred.batch_time([*decodes, (both[0], 1000), (both[1], 0)]) <= 0.03
    # a calm one (urgency 0) takes no share; the long one takes the room
    calm = packer.pack(decodes, [long, PrefillCandidate(5000, 0, 0.0)], budget=100_000)
    assert calm[0] == alone[0]
    # one more urgent than the long one takes what it needs first; the long one the rest
    first = packer.pack(decodes, [PrefillCandidate(100, 0, 0.0), long], budget=100_000)
    assert first[0] == 100 and 0 < first[1] < alone[0]
    assert pred.batch_time([*decodes, (100, 0), (first[1], 1000)]) <= 0.03
    # over the target with decodes alone: the most urgent prefill still runs its minimum
    slow = BatchPacker(pred, target_batch_time=1e-4)
    assert slow.pack(decodes, [long], budget=100_000) == [packer.floor(1000)]
    assert packer.pack(decodes, [long], budget=7) == [7]  # the token budget caps even that
    with pytest.raises(ValueError, match="target_batch_time"):
        BatchPacker(pred, target_batch_time=0)


def test_a_relative_target_holds_each_step_to_a_multiple_of_its_decodes_own():
    pred = predictor(pairs=2e-9)
    packer = BatchPacker(pred, decode_slowdown=2.0)
    long = PrefillCandidate(uncomputed=50_000, context=1000)
    for decodes in ([(1, 500)] * 32, [(1, 500)] * 64, [(1, 4000)] * 16):
        alone = pred.batch_time(decodes)
        (n,) = packer.pack(decodes, [long], budget=100_000)
        with_chunk = pred.batch_time([*decodes, (n, 1000)])
        assert n > 0 and with_chunk <= 2.0 * alone + 1e-12
        assert pred.batch_time([*decodes, (n + 1, 1000)]) > 2.0 * alone  # the largest such
    # more decodes, a longer step to share: the chunk grows with the decodes' time
    few, many = ([(1, 500)] * k for k in (32, 128))
    assert packer.pack(few, [long], 100_000)[0] < packer.pack(many, [long], 100_000)[0]
    # decodes too quick to share a step worth running: the chunk's efficient minimum
    assert packer.pack([(1, 500)] * 4, [long], 100_000) == [packer.floor(1000)]
    # without decodes nothing but the budget bounds the step
    assert packer.pack([], [long], budget=4096) == [4096]
    # a uniform error of the predictor (its cold start) cancels out of the target
    scaled = predictor(pairs=2e-9)
    m = pred.prefill_time
    assert m is not None
    scaled.prefill_time = LinearPrefillTime(
        base=20 * m.base,
        per_new_token=20 * m.per_new_token,
        per_cached_token=20 * m.per_cached_token,
        per_attention_pair=20 * m.per_attention_pair,
    )
    decodes = [(1, 500)] * 16
    assert BatchPacker(scaled, decode_slowdown=2.0).pack(decodes, [long], 100_000) == (
        packer.pack(decodes, [long], 100_000)
    )
    for bad in ({}, {"target_batch_time": 0.1, "decode_slowdown": 2.0}):
        with pytest.raises(ValueError, match="one of them"):
            BatchPacker(pred, **bad)
    with pytest.raises(ValueError, match="decode_slowdown must be above 1"):
        BatchPacker(pred, decode_slowdown=1.0)


def test_an_engine_packs_chunks_relative_to_its_decodes_when_asked():
    from actors.engine.config import EngineConfig
    from actors.engine.controller_builder import _scheduler

    kv = KVCacheManager(BlockPool(64, 16), enable_prefix_caching=False)
    _, relative = _scheduler(EngineConfig(decode_slowdown=2.5), kv)  # type: ignore[arg-type]
    assert isinstance(relative.packer, BatchPacker)
    assert relative.packer.decode_slowdown == 2.5 and relative.packer.target is None
    assert _scheduler(EngineConfig(), kv)[1].packer is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_slowdown must be above 1"):
        EngineConfig(decode_slowdown=0.5)
    others = {"target_batch_time": 0.2, "attention_quota": 0.1, "chunk_rule": FixedChunk(64)}
    for name, value in others.items():
        with pytest.raises(ValueError, match=f"give decode_slowdown or {name}, not both"):
            EngineConfig(decode_slowdown=2.5, **{name: value})


def test_engine_and_serve_group_options():
    from actors.engine.config import EngineConfig
    from actors.serving.config import ReplicaGroupConfig

    cfg = EngineConfig.from_options(scheduling="ilrs", target_batch_time=0.05)
    assert cfg.scheduling == "ilrs" and cfg.max_prefill_share == 0.5
    group = ReplicaGroupConfig(engine={"scheduling": "edf", "min_ttft_slo": 0.5})
    assert group.engine.scheduling == "edf"
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        ReplicaGroupConfig(engine={"scheduling": "sjf"})
    with pytest.raises(ValueError, match="target_batch_time"):
        EngineConfig(target_batch_time=0.0)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(scheduling="ilrs", ordering=FCFS())
    with pytest.raises(ValueError, match="max_prefill_share"):
        EngineConfig(max_prefill_share=1.5)


def test_a_waiting_request_that_does_not_fit_leaves_the_step_to_running_prefills():
    # 16 blocks of 16 tokens hold 256: "a" (prompt 160 + 15 new) is admitted first; the
    # more urgent "b" (prompt 120 + 15 new) would not leave room for a's growth, so it
    # waits, and the budget it would have taken goes to a's next chunk.
    kv = KVCacheManager(BlockPool(16, 16), enable_prefix_caching=False)
    pred = predictor()
    sched = Scheduler(SchedulerConfig(32, 16), kv, EDF(Deadlines(pred)), FixedChunk(32))
    a, b = req("a", 160, 0.0, max_tokens=16, slo=100.0), req("b", 120, 0.0, 16, slo=0.1)
    sched.add(a)
    assert sched.schedule(0.0).num_tokens == {"a": 32}
    sched.add(b)
    for _ in range(4):
        step = sched.schedule(0.0)
        assert step.num_tokens == {"a": 32}
        sched.update(step, {"a": 1} if step.sample_flags()[0] else {}, 0.0)
    assert b.status.value == "waiting" and kv.pool.num_in_use == 10


def test_a_request_carries_its_ttft_slo_to_the_scheduler():
    from errors import InvalidRequestError
    from policies.request import Request, SamplingParams

    params = SamplingParams(max_tokens=4, ttft_slo=2.5)
    seq = Sequence.from_request(Request("r", [1, 2, 3], params, 0, 16, []))
    assert seq.ttft_slo == 2.5
    assert Deadlines(predictor(), default_slo=9.0).slo(seq) == 2.5  # its own wins
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(InvalidRequestError, match="ttft_slo"):
            SamplingParams(ttft_slo=bad)


def test_prefill_beside_decodes_caps_prefills_ranked_with_the_running_ones():
    # a deadline ordering ranks running and waiting prefills together (``ranks_prefills``):
    # the cap beside decodes holds on that path as on the FCFS one
    kv = KVCacheManager(BlockPool(4096, 16), enable_prefix_caching=False)
    config = SchedulerConfig(64, 256, prefill_beside_decodes=10)
    sched = Scheduler(config, kv, EDF(Deadlines(predictor())), FixedChunk(None))
    clock = Clock(sched, predictor())
    sched.add(req("a", 20, 0.0, max_tokens=8))
    assert clock.step() == [("a", 20, 0)]  # no decode runs: the whole prompt
    sched.add(req("b", 40, clock.now))
    sched.add(req("c", 40, clock.now))
    assert sum(n for rid, n, _ in clock.step() if rid != "a") == 10
    assert sum(n for rid, n, _ in clock.step() if rid != "a") == 10
