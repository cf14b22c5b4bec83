"""MegaScale-Infer's deployment-plan search (placement/moe_plan.py) on the paper's inputs:
Mixtral 8x22B and DBRX (Table 4), the GPUs and prices of Table 3, TPOT <= 150 ms."""

from __future__ import annotations

import dataclasses

import pytest

from placement.model_specs import get_model
from placement.moe_plan import (
    Hardware,
    LinearTime,
    Workload,
    attention_time,
    balanced_attention_nodes,
    colocated_plan,
    evaluate,
    expert_time,
    iteration_time,
    largest_batch,
    min_micro_batches,
    search_plan,
)

# The paper's workload: median input 571 and output 159 tokens, so a decoding request
# holds about 571 + 159 / 2 tokens of KV on average.
WORKLOAD = Workload(avg_context=571 + 159 / 2, tpot_slo_s=0.150)
TABLE_3 = ("L20", "H800", "A800", "H20", "L40S")


def test_micro_batch_rule():
    # m >= 2 (1 + Tc / Tf): 3 with fast communication (Tc < Tf / 2), 4 with slower.
    assert min_micro_batches(0.1, 1.0) == 3
    assert min_micro_batches(0.49, 1.0) == 3
    assert min_micro_batches(0.5, 1.0) == 3  # exactly 2 * 1.5
    assert min_micro_batches(0.51, 1.0) == 4
    assert min_micro_batches(0.99, 1.0) == 4
    assert min_micro_batches(0.0, 1.0) == 2
    with pytest.raises(ValueError):
        min_micro_batches(0.1, 0.0)


def test_iteration_time_is_eq5_when_constraint_3_holds_and_has_a_bubble_otherwise():
    ta, te, tc, layers = 1.0, 0.8, 0.3, 10
    tf = max(ta, te)
    for m in (3, 4):  # m * Tf >= 2 (Tf + Tc)
        assert iteration_time(ta, te, tc, m, layers) == pytest.approx(
            (ta + te + 2 * tc) + tf * (m * layers - 1)
        )
    # m = 1: nothing overlaps, every layer is a full round trip.
    assert iteration_time(ta, te, tc, 1, layers) == pytest.approx(layers * (ta + te + 2 * tc))
    # m = 2 cannot hide the communication: the period is the round trip, not 2 Tf.
    assert iteration_time(ta, te, tc, 2, layers) > (ta + te + 2 * tc) + tf * (2 * layers - 1)


def test_balance_picks_attention_nodes_around_k1_E_over_k3_K():
    model = get_model("dbrx")  # E = 16, K = 4
    ta, te = LinearTime(3.0, 0.0), LinearTime(4.0, 0.0)
    assert balanced_attention_nodes(ta, te, model) == [3]  # 3 * 16 / (4 * 4) = 3
    assert balanced_attention_nodes(LinearTime(2.5, 0.0), te, model) == [2, 3]
    assert balanced_attention_nodes(LinearTime(0.1, 0.0), te, model) == [1]


def test_linear_times_grow_with_batch_and_shrink_with_tensor_parallelism():
    model, hw = get_model("mixtral-8x22b"), Hardware.named("A800")
    a1, a4 = attention_time(model, hw, 1, 650), attention_time(model, hw, 4, 650)
    e1, e4 = expert_time(model, hw, 1), expert_time(model, hw, 4)
    for line in (a1, a4, e1, e4):
        assert line.per_token > 0 and line.fixed > 0
    assert a4(256) < a1(256) and e4(256) < e1(256)
    # Attention reads the KV of every context token: longer contexts cost more per token.
    assert attention_time(model, hw, 1, 4000).per_token > a1.per_token


def test_memory_constraints_refuse_plans_that_do_not_fit():
    model = get_model("mixtral-8x22b")
    l40s, a800 = Hardware.named("L40S"), Hardware.named("A800")
    # One Mixtral expert over 56 layers is ~34 GB: fits a 48 GB L40S, so tp_e = 1 is allowed.
    assert evaluate(model, a800, 1, 1, l40s, 1, 3, 8, WORKLOAD) is not None
    # The KV of m micro-batches must fit the attention node (Eq. 8).
    assert evaluate(model, a800, 1, 1, l40s, 1, 3, 100_000, WORKLOAD) is None
    tiny_gpu = Hardware.named("L20", gpus_per_node=1)
    dbrx = get_model("dbrx")
    assert evaluate(dbrx, tiny_gpu, 1, 1, tiny_gpu, 1, 3, 1, WORKLOAD) is not None
    # Mixtral's attention, embeddings and experts: a 1-GPU L20 attention node holds it, but
    # no expert of 34 GB fits 90% of a 24 GB card.
    small = Hardware(dataclasses.replace(tiny_gpu.gpu, mem_bytes=24e9), 1e9)
    assert evaluate(model, a800, 1, 1, small, 1, 3, 1, WORKLOAD) is None


def test_largest_batch_is_the_largest_that_meets_the_slo():
    model, hw = get_model("dbrx"), Hardware.named("A800")
    plan = largest_batch(model, hw, 2, 4, hw, 2, 3, WORKLOAD)
    assert plan is not None and plan.t_iter <= WORKLOAD.tpot_slo_s
    assert plan.batch == plan.b_a * plan.m * plan.n_a
    assert plan.b_e == pytest.approx(plan.b_a * plan.n_a * model.top_k / model.num_experts)
    bigger = evaluate(model, hw, 2, 4, hw, 2, 3, plan.b_a + 1, WORKLOAD)
    assert bigger is None or bigger.t_iter > WORKLOAD.tpot_slo_s
    # An SLO no plan can meet.
    assert largest_batch(model, hw, 2, 4, hw, 2, 3, Workload(650, tpot_slo_s=1e-4)) is None
    with pytest.raises(ValueError, match="raise the SLO"):
        search_plan(model, [hw], None, Workload(650, tpot_slo_s=1e-4))


@pytest.mark.parametrize("name", ["mixtral-8x22b", "dbrx"])
def test_search_meets_the_slo_and_beats_every_other_candidate(name):
    model, hw = get_model(name), Hardware.named("A800")
    plan = search_plan(model, [hw], None, WORKLOAD)
    assert plan.t_iter <= WORKLOAD.tpot_slo_s
    assert plan.gpu_a == plan.gpu_e == "A800" and plan.n_e == model.num_experts
    # Constraint 1: the chosen n_a balances the two modules (within 25%).
    assert plan.t_a == pytest.approx(plan.t_e, rel=0.25)
    # No other (tp_a, n_a, tp_e, m) near it has a higher throughput per cost.
    for tp_a in (1, 2, 4, 8):
        for tp_e in (1, 2, 4, 8):
            for n_a in range(1, 12):
                for m in (3, 4):
                    other = largest_batch(model, hw, tp_a, n_a, hw, tp_e, m, WORKLOAD)
                    if other is not None:
                        assert other.throughput_per_cost <= plan.throughput_per_cost * 1.0001 or (
                            n_a
                            not in balanced_attention_nodes(
                                attention_time(model, hw, tp_a, WORKLOAD.avg_context),
                                expert_time(model, hw, tp_e),
                                model,
                            )
                        )


def test_three_micro_batches_when_communication_is_fast():
    """Mixtral 8x22B on A800 with one 200 Gbps NIC per GPU: Tc < Tf / 2, the rule gives
    m = 3, and the search (over m in 3..4, as Algorithm 1) picks m = 3."""
    plan = search_plan(get_model("mixtral-8x22b"), [Hardware.named("A800")], None, WORKLOAD)
    t_f = max(plan.t_a, plan.t_e)
    assert plan.t_c < t_f / 2
    assert min_micro_batches(plan.t_c, t_f) == 3
    assert plan.m == 3


def test_four_micro_batches_hide_slow_communication_that_three_cannot():
    """With a slow network (Tc > Tf / 2) at the same micro-batch size, m = 3 leaves a bubble
    in every layer (period > 3 Tf) and m = 4 hides it."""
    model = get_model("dbrx")
    hw = Hardware.named("A800", nic_bw=10e9)
    plan = evaluate(model, hw, 2, 4, hw, 2, 3, 64, WORKLOAD)
    assert plan is not None
    t_f = max(plan.t_a, plan.t_e)
    assert t_f / 2 < plan.t_c < t_f and min_micro_batches(plan.t_c, t_f) == 4
    assert plan.t_a + plan.t_e + 2 * plan.t_c > 3 * t_f  # m = 3: bubble
    assert plan.t_a + plan.t_e + 2 * plan.t_c <= 4 * t_f  # m = 4: hidden


def test_micro_batch_ablation_follows_the_paper_shape():
    """At a fixed micro-batch size (the paper's Fig. 12 setup): m 1 -> 2 nearly doubles the
    throughput, m 2 -> 3 gains about 1 + Tc / Tf (the paper: 1.9x, then 1.10-1.38x)."""
    model, hw = get_model("dbrx"), Hardware.named("A800")
    best = search_plan(model, [hw], None, WORKLOAD)
    by_m = {
        m: evaluate(model, hw, best.tp_a, best.n_a, hw, best.tp_e, m, best.b_a // 2, WORKLOAD)
        for m in (1, 2, 3)
    }
    thr = {m: p.throughput for m, p in by_m.items() if p is not None}
    assert set(thr) == {1, 2, 3}
    p3 = by_m[3]
    assert p3 is not None
    ratio = p3.t_c / max(p3.t_a, p3.t_e)
    assert 1.6 < thr[2] / thr[1] <= 2.0
    assert 1.0 < thr[3] / thr[2] <= 1 + ratio + 1e-9


@pytest.mark.parametrize("name", ["mixtral-8x22b", "dbrx"])
def test_heterogeneous_h20_for_attention_and_l40s_for_experts(name):
    """The paper's heterogeneous cluster (H20 and L40S): H20, with more memory bandwidth and
    capacity per cost, takes attention; L40S, with more FLOPs per cost, takes the experts;
    and the mixed plan beats either GPU alone per cost."""
    model = get_model(name)
    hws = [Hardware.named("H20"), Hardware.named("L40S")]
    plan = search_plan(model, hws, hws, WORKLOAD)
    assert (plan.gpu_a, plan.gpu_e) == ("H20", "L40S")
    for hw in hws:
        alone = search_plan(model, [hw], None, WORKLOAD)
        assert plan.throughput_per_cost > alone.throughput_per_cost


def test_heterogeneous_over_all_of_table_3_for_dbrx():
    hws = [Hardware.named(g) for g in TABLE_3]
    plan = search_plan(get_model("dbrx"), hws, hws, WORKLOAD)
    assert (plan.gpu_a, plan.gpu_e) == ("H20", "L40S")


def test_dense_models_are_refused():
    hw = Hardware.named("A800")
    with pytest.raises(ValueError, match="dense"):
        evaluate(get_model("llama3-70b"), hw, 1, 1, hw, 1, 3, 1, WORKLOAD)


@pytest.mark.parametrize("name", ["mixtral-8x22b", "dbrx"])
def test_disaggregation_beats_colocated_per_gpu_on_ampere(name):
    """The paper's Fig. 8 direction: the disaggregated plan decodes more tokens per GPU than
    a colocated tensor-parallel replica under the same SLO and the same performance model."""
    model, hw = get_model(name), Hardware.named("A800")
    colocated = colocated_plan(model, hw, WORKLOAD)
    assert colocated.t_iter <= WORKLOAD.tpot_slo_s
    # Every GPU holds 1/tp of all weights plus the KV: 8 A800s, not fewer, for these models.
    assert colocated.tp == 8
    longer = colocated_plan(model, hw, Workload(WORKLOAD.avg_context * 4))
    assert longer.batch < colocated.batch  # KV memory binds
    plan = search_plan(model, [hw], None, WORKLOAD)
    assert plan.per_gpu_throughput > colocated.per_gpu_throughput
