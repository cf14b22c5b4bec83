"""The dense deployment plan (placement/dense_plan.py) and its simulated replay
(sim/plan_replay.py): which layout a trace's load picks, and whether the replay can tell a
plan that meets the SLOs from one that does not."""

from __future__ import annotations

import random

import pytest

from actors.serving.config import ServeConfig
from placement.dense_plan import (
    DenseSLO,
    Layout,
    TraceStats,
    search_dense_plan,
    trace_stats,
)
from placement.model_specs import get_model
from placement.moe_plan import Hardware, Workload, search_plan
from placement.serve_plan import dense_serve_args
from sim.metrics import RequestStats
from sim.plan_replay import dense_cluster, judge, replay
from sim.workload import TraceRequest

A100 = Hardware.named("A100")
LLAMA8 = get_model("llama3-8b")
SLO = DenseSLO(ttft_s=30.0, tpot_s=0.150)


def poisson(n: int, rate: float, lo: int, hi: int, out: int, seed: int = 0) -> list[TraceRequest]:
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(TraceRequest(f"r{i}", t, rng.randint(lo, hi), out))
    return reqs


def stats_of(reqs: list[TraceRequest]) -> TraceStats:
    return trace_stats((r.arrival, r.input_len, r.output_len) for r in reqs)


SHORT = poisson(400, 20.0, 200, 1000, 200)  # chat-like prompts, 20 requests/s
LONG = poisson(100, 0.05, 100_000, 200_000, 200)  # 100K-200K-token prompts, one per 20 s


def test_trace_stats_by_hand():
    s = trace_stats([(0.0, 100, 10), (2.0, 300, 30), (4.0, 200, 20)])
    assert s.rate == pytest.approx(2 / 4.0)
    assert s.input_quantiles == (100, 200, 300)
    assert s.mean_output == pytest.approx(20)
    assert s.max_tokens == 330
    assert s.p90_input == 300
    assert s.mean_context == pytest.approx(200 + 10)
    with pytest.raises(ValueError):
        trace_stats([])


def test_long_context_trace_picks_a_long_context_layout_and_short_does_not():
    slo = DenseSLO(ttft_s=10.0, tpot_s=0.150)
    short = search_dense_plan(LLAMA8, [A100], stats_of(SHORT), slo)
    long = search_dense_plan(LLAMA8, [A100], stats_of(LONG), slo)
    lay_s = short.layout if short.mode == "colocated" else short.prefill
    lay_l = long.layout if long.mode == "colocated" else long.prefill
    assert lay_s is not None and lay_l is not None
    assert (lay_s.spp, lay_s.kvp) == (1, 1)
    # A 150K-token prompt takes longer than the 10 s TTFT SLO on one tp group, even of 8
    # GPUs: the plan pipelines it over stages on prefill-only instances.
    assert lay_l.spp * lay_l.kvp > 1
    assert long.prefill_share > short.prefill_share
    # The simulator agrees: replayed on their plans, both traces meet the SLOs.
    for plan, reqs in ((short, SHORT), (long, LONG)):
        result = replay(dense_cluster(plan, LLAMA8, A100, 10.0, 0.150), reqs, 10.0, 0.150)
        assert result.holds, (plan.describe(), result.line())


def test_pd_prefill_share_grows_with_prompt_length():
    short = search_dense_plan(LLAMA8, [A100], stats_of(SHORT), SLO, modes=("pd",))
    long = search_dense_plan(LLAMA8, [A100], stats_of(LONG), SLO, modes=("pd",))
    assert short.mode == long.mode == "pd"
    assert long.prefill_share > short.prefill_share
    assert long.prefill is not None and long.prefill.spp > 1


def test_more_load_needs_more_replicas_and_the_cost_is_their_price():
    slow = search_dense_plan(LLAMA8, [A100], stats_of(SHORT), SLO, modes=("colocated",))
    fast = search_dense_plan(
        LLAMA8, [A100], stats_of(poisson(400, 80.0, 200, 1000, 200)), SLO, modes=("colocated",)
    )
    assert fast.replicas > slow.replicas
    for plan in (slow, fast):
        assert plan.layout is not None
        assert plan.gpus == plan.replicas * plan.layout.gpus
        assert plan.cost == pytest.approx(plan.gpus * A100.gpu.price)


def test_cheaper_gpu_type_wins_when_both_fit():
    cheap = Hardware.named("L20")
    plan = search_dense_plan(LLAMA8, [A100, cheap], stats_of(SHORT), SLO)
    only_a100 = search_dense_plan(LLAMA8, [A100], stats_of(SHORT), SLO)
    assert plan.cost <= only_a100.cost


def test_impossible_slos_and_moe_models_are_refused():
    with pytest.raises(ValueError, match="raise the SLOs"):
        search_dense_plan(LLAMA8, [A100], stats_of(SHORT), DenseSLO(0.001, 0.001))
    with pytest.raises(ValueError, match="MoE"):
        search_dense_plan(get_model("dbrx"), [A100], stats_of(SHORT), SLO)


def test_judge_counts_requests_within_both_slos():
    def rec(rid: str, ttft: float, gaps: list[float]) -> RequestStats:
        s = RequestStats(rid, 0.0, 10, len(gaps) + 1)
        t = ttft
        s.on_token(t)
        for g in gaps:
            t += g
            s.on_token(t)
        s.on_finish(t)
        return s

    rejected = RequestStats("x", 0.0, 10, 5)
    rejected.on_reject("full", 1.0)
    stats = [rec("a", 1.0, [0.1, 0.1]), rec("b", 5.0, [0.1]), rec("c", 1.0, [0.3]), rejected]
    r = judge(stats, ttft_s=2.0, tpot_s=0.2, target=0.5)
    assert (r.requests, r.met) == (4, 1)
    assert not r.holds and "do NOT hold" in r.line()
    assert judge(stats[:1], 2.0, 0.2, 0.9).holds


def test_replay_holds_for_the_plan_and_not_for_a_third_of_it():
    reqs = poisson(400, 60.0, 200, 1000, 100, seed=3)
    plan = search_dense_plan(LLAMA8, [A100], stats_of(reqs), SLO, modes=("colocated",))
    assert plan.replicas >= 3
    ok = replay(dense_cluster(plan, LLAMA8, A100, SLO.ttft_s, SLO.tpot_s), reqs, 30.0, 0.15)
    assert ok.holds, ok.line()
    import dataclasses

    small = dataclasses.replace(plan, replicas=max(1, plan.replicas // 3))
    bad = replay(dense_cluster(small, LLAMA8, A100, SLO.ttft_s, SLO.tpot_s), reqs, 30.0, 0.15)
    assert bad.attainment < ok.attainment and not bad.holds, bad.line()


def test_pd_plan_replays_on_a_disaggregated_cluster():
    reqs = poisson(200, 5.0, 2000, 8000, 50, seed=4)
    plan = search_dense_plan(LLAMA8, [A100], stats_of(reqs), SLO, modes=("pd",))
    cluster = dense_cluster(plan, LLAMA8, A100, SLO.ttft_s, SLO.tpot_s)
    result = replay(cluster, reqs, SLO.ttft_s, SLO.tpot_s)
    assert result.requests == 200 and result.holds, result.line()
    roles = sorted(i.role for i in cluster.instances())
    assert roles.count("prefill") == plan.num_prefill
    assert roles.count("decode") == plan.num_decode


def test_dense_serve_args_validate_for_both_modes():
    colo = search_dense_plan(LLAMA8, [A100], stats_of(LONG), SLO, modes=("colocated",))
    cfg = ServeConfig.model_validate(dense_serve_args(colo, None, "m", SLO))
    (g,) = cfg.groups
    assert (
        colo.layout == Layout(g.engine.tp, g.engine.spp, g.engine.kvp)
        and g.num_replicas == colo.replicas
    )
    pd = search_dense_plan(LLAMA8, [A100], stats_of(LONG), SLO, modes=("pd",))
    cfg = ServeConfig.model_validate(dense_serve_args(pd, None, "m", SLO))
    (g,) = cfg.groups
    assert (g.num_prefill, g.num_decode) == (pd.num_prefill, pd.num_decode)
    assert g.prefill is not None and g.decode is not None and pd.prefill is not None
    assert (g.prefill.tp, g.prefill.spp) == (pd.prefill.tp, pd.prefill.spp)
    assert g.conductor is not None and g.conductor.tbt_slo == SLO.tpot_s


def test_moe_plan_cost_of_a_decode_batch_is_the_plans_iteration_time():
    from placement.moe_cost import MoEPlanCost

    model, hw = get_model("mixtral-8x22b"), Hardware.named("A800")
    work = Workload(avg_context=650)
    plan = search_plan(model, [hw], None, work)
    cost = MoEPlanCost(plan, model, hw, hw)
    # Every request decodes one token over 649 cached ones (650 after this token).
    t = cost.batch_time([(1, 649)] * plan.batch)
    assert t == pytest.approx(plan.t_iter, rel=1e-3)
    # Prefill chunks cost more than a decode step of as many requests.
    assert cost.batch_time([(512, 0)] * 4) > cost.batch_time([(1, 649)] * 4)
    assert cost.kv_capacity_tokens() > plan.batch * 650


def test_moe_replicas_follow_the_decode_load_and_the_replay_runs_the_plan():
    import dataclasses

    from sim.plan_replay import moe_cluster, moe_replicas

    model, hw = get_model("mixtral-8x22b"), Hardware.named("A800")
    plan = search_plan(model, [hw], None, Workload(avg_context=650))
    reqs = poisson(200, 50.0, 400, 900, 100, seed=5)
    assert moe_replicas(plan, reqs) == 1  # ~50 x 100 x TPOT requests at once << the batch
    # Little's law: rate x mean output x TPOT requests decode at once, batch per replica.
    rate = (len(reqs) - 1) / (reqs[-1].arrival - reqs[0].arrival)
    small = dataclasses.replace(plan, batch=10)
    want = -(-rate * 100 * plan.t_iter // 10)
    assert moe_replicas(small, reqs) == want > 1
    assert moe_replicas(plan, reqs[:1]) == 1
    cluster = moe_cluster(plan, model, hw, hw, 1)
    result = replay(cluster, reqs, ttft_s=5.0, tpot_s=0.150)
    assert result.holds, result.line()
    assert result.tpot_p90 <= plan.t_iter * 1.05  # never above the full batch's iteration
