"""SLO-aware admission: the shared TTFT rule, a colocated replica's predicted TTFT with a
fitted step-cost model, and the Conductor's decisions on top of the same rule."""

from __future__ import annotations

import random

import pytest

from actors.serving.config import ReplicaGroupConfig
from policies import admission as adm
from policies.admission import (
    ColocatedAdmission,
    ColocatedLoad,
    QueuedPrompt,
    RunningDecode,
    colocated_ttft,
    judge_ttft,
)
from policies.conductor import Conductor, ConductorRequest, DecodeInstance, PrefillInstance
from policies.pd_costs import CostFitter, LinearPrefillTime

STEP = LinearPrefillTime(base=1.0)  # every step costs one second: times count steps


def load(prompts=(), decodes=(), budget=64, max_num_seqs=256, chunk=None) -> ColocatedLoad:
    return ColocatedLoad(list(prompts), list(decodes), budget, max_num_seqs, chunk)


# -- the shared rule -----------------------------------------------------------------------
def test_judge_ttft_accepts_up_to_the_slo_and_reports_the_excess_otherwise():
    ok = judge_ttft(2.0, 2.0)
    assert ok.meets_slo and ok.load == 1.0 and ok.retry_after == 0.0
    late = judge_ttft(5.5, 2.0)
    assert not late.meets_slo and late.load == 2.75 and late.retry_after == 3.5
    assert adm.predict_ttft(1.5, 0.25) == 1.75
    assert adm.retry_after_at_least(0.2, 1.0) == 1.0
    assert adm.retry_after_at_least(3.5, 1.0) == 3.5
    with pytest.raises(ValueError):
        judge_ttft(1.0, 0.0)


# -- a colocated replica's predicted TTFT --------------------------------------------------
def test_prompts_drain_at_the_token_budget_in_fcfs_order():
    queued = [QueuedPrompt(100, 0, 1), QueuedPrompt(100, 0, 1)]
    # 210 tokens at 64 a step: the queue fills steps 1-3 and part of 4, which runs ours.
    assert colocated_ttft(STEP, load(queued), 10, 0) == (3.0, 1.0)
    # Idle: one step.
    assert colocated_ttft(STEP, load(), 10, 0) == (0.0, 1.0)
    # A long prompt of our own runs over several steps; chunk_size caps it per step.
    assert colocated_ttft(STEP, load(), 130, 0) == (0.0, 3.0)
    assert colocated_ttft(STEP, load(chunk=16), 64, 0) == (0.0, 4.0)


def test_decodes_take_their_tokens_first_and_leave_when_done():
    # 32 decodes leave 32 prompt tokens a step: 64 queued tokens take two steps.
    decodes = [RunningDecode(100, 10)] * 32
    queued = [QueuedPrompt(64, 0, 1)]
    assert colocated_ttft(STEP, load(queued, decodes), 1, 0) == (2.0, 1.0)
    # The same decodes ending after one step: 32 tokens, then 64 a step.
    short = [RunningDecode(1, 10)] * 32
    assert colocated_ttft(STEP, load(queued, short), 1, 0) == (1.0, 1.0)


def test_prompts_finished_ahead_join_the_decode_batch():
    # 32 two-token prompts fill step 1 and then decode (99 more tokens each): the 64-token
    # prompt behind them gets 32 tokens a step (steps 2, 3), ours runs in step 4.
    queued = [QueuedPrompt(2, 0, 100)] * 32 + [QueuedPrompt(64, 0, 1)]
    assert colocated_ttft(STEP, load(queued), 1, 0) == (3.0, 1.0)
    # Prompts that end at their first token (max_tokens 1) never decode: step 3.
    done = [QueuedPrompt(2, 0, 1)] * 32 + [QueuedPrompt(64, 0, 1)]
    assert colocated_ttft(STEP, load(done), 1, 0) == (2.0, 1.0)


def test_a_full_replica_starts_no_prompt_until_a_request_ends():
    decodes = [RunningDecode(5, 10), RunningDecode(9, 10)]
    assert colocated_ttft(STEP, load([], decodes, max_num_seqs=2), 8, 0) == (5.0, 1.0)
    # A running prefill already holds its slot.
    held = [QueuedPrompt(8, 0, 1, running=True)]
    assert colocated_ttft(STEP, load(held, [], max_num_seqs=1), 8, 0) == (1.0, 1.0)


def test_cost_terms_count_new_tokens_context_and_attention_pairs():
    cost = LinearPrefillTime(0.5, 0.01, 0.001, 0.0001)
    # One step: a decode (1 new token after 99) and our 10 new tokens after 20 cached.
    t = colocated_ttft(cost, load([], [RunningDecode(5, 99)]), 10, 20)
    new, context, pairs = 1 + 10, 99 + 20, (1 + 99) + 10 * 30
    assert t == (0.0, pytest.approx(0.5 + 0.01 * new + 0.001 * context + 0.0001 * pairs))


def test_the_walk_gives_up_beyond_its_horizon():
    queued = [QueuedPrompt(64 * 1000, 0, 1)]
    queue_time, own = colocated_ttft(STEP, load(queued), 1, 0, give_up_after=10.0)
    assert queue_time == 11.0 and own == 0.0  # a lower bound: enough to refuse


def fitted_admission(slo: float) -> tuple[ColocatedAdmission, LinearPrefillTime]:
    """Admission whose model CostFitter fitted from steps of a known cost (decodes and
    chunks mixed, as a colocated replica measures them)."""
    truth = LinearPrefillTime(0.02, 0.0005, 0.00001, 0.000001)
    rng = random.Random(0)
    fitter = CostFitter(block_bytes=1, window=64, min_samples=8, refit_every=8)
    gate = ColocatedAdmission(slo)
    assert gate.judge(load(), 10, 0) is None  # no model yet: admit when nothing is queued
    for _ in range(64):
        chunks = [(1, rng.randrange(16, 512)) for _ in range(rng.randrange(0, 24))]
        chunks += [(rng.randrange(1, 256), rng.randrange(0, 256)) for _ in range(2)]
        seconds = truth.base + sum(truth(n, c) - truth.base for n, c in chunks)
        fitter.add_prefill_step(chunks, seconds)
        fitter.refit(gate)
    assert gate.prefill_time is not None
    return gate, truth


def test_colocated_admission_with_a_fitted_model_matches_the_true_cost():
    gate, truth = fitted_admission(slo=1.0)
    fitted = gate.prefill_time
    assert isinstance(fitted, LinearPrefillTime)
    queued = [QueuedPrompt(200, 0, 32) for _ in range(6)]
    decodes = [RunningDecode(50, 300) for _ in range(20)]
    busy = load(queued, decodes, budget=256)
    want = sum(colocated_ttft(truth, busy, 200, 0))
    got = sum(colocated_ttft(fitted, busy, 200, 0))
    assert got == pytest.approx(want, rel=1e-3)


def test_colocated_admission_accepts_within_the_slo_and_refuses_with_retry_after():
    gate, _ = fitted_admission(slo=1.0)
    idle = gate.judge(load(budget=256), 200, 0)
    assert idle is not None and idle.meets_slo and idle.retry_after == 0.0
    queued = [QueuedPrompt(256, 0, 32) for _ in range(200)]
    busy = gate.judge(load(queued, budget=256), 200, 0)
    assert busy is not None and not busy.meets_slo
    # Retry-After: the excess over the SLO (the queue drains a second of work a second),
    # at least min_retry_after.
    assert busy.retry_after == pytest.approx(busy.predicted_ttft - 1.0)
    assert busy.retry_after >= gate.min_retry_after
    nearly = ColocatedAdmission(1.0, min_retry_after=5.0, prefill_time=LinearPrefillTime(0.6))
    j = nearly.judge(load([QueuedPrompt(256, 0, 1)], budget=256), 1, 0)
    assert j is not None and not j.meets_slo and j.retry_after == 5.0


# -- the Conductor on the shared rule ------------------------------------------------------
def old_early_rejection(c: Conductor, ttft: float, tbt: float) -> tuple[str, float]:
    """The Conductor's early-rejection rule before it called ``judge_ttft`` (no decode_full
    case): the reason and the TTFT part of the retry."""
    if adm.slo_load(ttft, tbt, c.ttft_slo, c.tbt_slo) <= 1:
        return "", 0.0
    ttft_ratio, tbt_ratio = ttft / c.ttft_slo, tbt / c.tbt_slo
    reason = "ttft_slo" if ttft_ratio >= tbt_ratio else "tbt_slo"
    retry = adm.ttft_retry_after(ttft, c.ttft_slo) if ttft_ratio > 1 else 0.0
    return reason, retry


@pytest.mark.parametrize("mode", ["early", "predictive", "none"])
def test_the_conductor_decides_as_before(mode):
    rng = random.Random(7)
    c = Conductor(
        lambda new, cached: 0.001 * new + 0.0001 * cached,
        lambda batch, blocks: 0.01 + 0.001 * batch + 0.00001 * blocks,
        lambda blocks: 0.01 * blocks,
        ttft_slo=2.0,
        tbt_slo=0.05,
        admission=mode,
    )
    seen = set()
    for i in range(300):
        prompt = rng.randrange(1, 2000)
        hashes = list(range(i * 1000, i * 1000 + prompt // 16))
        req = ConductorRequest(f"r{i}", hashes, prompt, rng.randrange(1, 256), 16)
        prefills = [
            PrefillInstance(f"p{k}", queued_tokens=rng.randrange(0, 4000), cached=set(hashes[:k]))
            for k in range(2)
        ]
        decodes = [
            DecodeInstance(
                f"d{k}",
                num_running=(n := rng.randrange(0, 40)),
                used_blocks=n * rng.randrange(1, 20),
                total_blocks=1000,
            )
            for k in range(2)
        ]
        d = c.schedule(req, prefills, decodes, now=0.0)
        seen.add(d.reason)
        if d.reason == "decode_full":
            continue
        if mode == "none":
            assert d.accepted
            continue
        reason, ttft_retry = old_early_rejection(c, d.predicted_ttft, d.predicted_tbt)
        assert d.reason == reason
        assert d.accepted == (reason == "")
        if reason and d.predicted_tbt <= c.tbt_slo:  # TTFT alone: its retry is the excess
            assert d.retry_after == max(c.min_retry_after, ttft_retry)
        elif reason:
            assert d.retry_after is not None and d.retry_after >= ttft_retry
    if mode != "none":
        assert {"", "ttft_slo", "tbt_slo"} <= seen


# -- config --------------------------------------------------------------------------------
def test_a_colocated_group_may_set_a_ttft_slo():
    g = ReplicaGroupConfig.model_validate({"name": "a", "admission": {"ttft_slo": 2.5}})
    assert g.admission is not None and g.admission.ttft_slo == 2.5
    assert ReplicaGroupConfig.model_validate({"name": "b"}).admission is None
    with pytest.raises(ValueError, match="ttft_slo"):
        ReplicaGroupConfig.model_validate({"name": "c", "admission": {"ttft_slo": 0}})
    with pytest.raises(ValueError, match="conductor"):
        ReplicaGroupConfig.model_validate(
            {"name": "d", "num_prefill": 1, "num_decode": 1, "admission": {"ttft_slo": 1.0}}
        )


def test_before_any_step_is_measured_only_an_empty_queue_admits():
    gate = ColocatedAdmission(2.0, min_retry_after=1.5)
    assert gate.judge(load([], [RunningDecode(10, 10)]), 10, 0) is None
    j = gate.judge(load([QueuedPrompt(10, 0, 1)]), 10, 0)
    assert j is not None and not j.meets_slo and j.retry_after == 1.5


def test_measured_prediction_error_scales_predictions():
    # Every step costs 0.1 s: an idle request is predicted 0.1 s, and waiting counts too.
    gate = ColocatedAdmission(1.0, prefill_time=LinearPrefillTime(0.1))
    queued = [QueuedPrompt(64, 0, 1)] * 7  # 7 steps ahead, ours the 8th: 0.8 s
    assert gate.judge(load(queued), 1, 0).predicted_ttft == pytest.approx(0.8)
    assert not gate.judge(load(queued), 1, 0, waited=0.3).meets_slo
    assert gate.correction == 1.0
    # First tokens came 1.5x later than predicted (most of the time): predictions follow.
    for i in range(10):
        gate.observe(1.0, 1.5 if i < 9 else 1.0)
    assert gate.correction == 1.5
    j = gate.judge(load(queued), 1, 0)
    assert j.predicted_ttft == pytest.approx(1.2) and not j.meets_slo
    assert j.retry_after == pytest.approx(1.0)  # 0.2 s over, at least min_retry_after


# -- decode steps' overrun of the model ----------------------------------------------------
def test_step_overruns_give_a_quantile_of_measured_over_predicted_never_below_one():
    o = adm.StepOverruns(window=10, min_steps=4)
    for _ in range(3):
        o.add(0.3, 0.1)
    assert o.margin(0.9) == 1.0  # fewer than min_steps: no margin yet
    o.add(0.1, 0.1)
    assert o.margin(0.9) == pytest.approx(3.0)
    assert o.margin(0.0) == pytest.approx(1.0)
    for _ in range(10):  # the window keeps the last 10: faster than predicted
        o.add(0.05, 0.1)
    assert o.margin(0.9) == 1.0  # a fast host never loosens admission below the model
    o.add(0.0, 0.1)  # an unmeasured step is not a ratio
    o.add(0.1, 0.0)
    assert len(o.ratios) == 10
    with pytest.raises(ValueError):
        o.margin(1.5)
    with pytest.raises(ValueError):
        adm.StepOverruns(window=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap_steps"])
def test_a_colocated_engine_fits_its_cost_model_from_every_completed_step(overlap):
    from actors import SamplingParams
    from actors.serving.colocated_engine import ColocatedEngine

    engine = ColocatedEngine.build(ttft_slo=60.0, block_size=4, overlap_steps=overlap)
    builder = engine.request_builder()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(builder.build(list(range(3, 12)), params))  # alone: none measured yet
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert engine.fitter is not None
    chunks = [chunk for step, _ in engine.fitter.prefill for chunk in step]
    assert len(engine.fitter.prefill) == steps  # one sample per step that completed
    assert chunks[0] == (9, 0) and (1, 9) in chunks  # its prompt, then its first decode
