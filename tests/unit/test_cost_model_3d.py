"""Medha's long-context layouts in the roofline: sequence pipelining (Eq. 4) and KV
parallelism (Eq. 5), and a 1M-token request simulated on a 3D layout."""

from __future__ import annotations

import pytest

from placement.cost_model import RooflineCostModel, prefill_time
from placement.gpus import get_gpu
from placement.model_specs import get_model


def llama8b(spp: int = 1, kvp: int = 1, **kw) -> RooflineCostModel:
    return RooflineCostModel(get_model("llama3-8b"), get_gpu("H100"), tp=8, spp=spp, kvp=kvp, **kw)


def test_one_stage_one_group_is_the_plain_roofline():
    batch = [(512, 4096), (1, 300), (1, 9000)]
    plain = RooflineCostModel(get_model("llama3-8b"), get_gpu("H100"), tp=8)
    assert llama8b().batch_time(batch) == plain.batch_time(batch)
    assert llama8b().stage_time(batch) == plain.batch_time(batch)
    assert llama8b().kv_capacity_tokens() == plain.kv_capacity_tokens()


def test_sequence_pipelining_divides_a_long_prefill_by_the_stages():
    one = prefill_time(llama8b(), 1_000_000, 0, 4096)
    for spp in (2, 4, 8):
        t = prefill_time(llama8b(spp=spp), 1_000_000, 0, 4096)
        # Eq. 4: T/spp plus the hops; near-linear scaling (Medha reports 80%+)
        assert one / spp < t < 1.15 * one / spp
    # a decode does not overlap with itself: its latency passes every stage (Fig. 10)
    decode = [(1, 2_000_000)]
    assert llama8b().batch_time(decode) < llama8b(spp=4).batch_time(decode)
    assert llama8b(spp=4).batch_time(decode) < 1.1 * llama8b().batch_time(decode)
    assert llama8b(spp=4).kv_capacity_tokens() > 4 * llama8b().kv_capacity_tokens()


def test_kv_parallelism_splits_attention_only_and_only_for_requests_that_span_groups():
    limit = 1_000_000
    one, two = llama8b(spp=4), llama8b(spp=4, kvp=2, kvp_rank_tokens=limit)
    long = [(1, 4_000_000)]  # spans two groups once past the limit
    assert two.kvp_groups(4_000_001) == 2 and two.kvp_groups(1000) == 1
    t1, t2 = one.batch_time(long), two.batch_time(long)
    m = one.model
    attn = one._kv * 4_000_001 / one._bandwidth  # decode attention reads every KV byte
    # Eq. 5: T_attn / p + (T - T_attn) + comm
    assert t2 == pytest.approx(t1 - attn / 2, rel=0.05)
    assert t1 / 2 < t2 < t1
    # a short request stays on one group: no split and no gather
    short = [(1, 2000), (300, 0)]
    assert two.batch_time(short) == pytest.approx(one.batch_time(short))
    assert m.num_layers == 32 and two.kv_capacity_tokens() == 2 * one.kv_capacity_tokens()


def test_a_million_token_request_on_a_3d_layout_is_simulated_with_short_ones():
    from policies.routing import RoundRobin
    from sim.cluster import InstanceSpec
    from sim.colocated import ColocatedCluster
    from sim.instance import SchedulingSpec
    from sim.workload import TraceRequest

    def ttft(cost: RooflineCostModel) -> dict[str, float]:
        blocks = cost.kv_capacity_tokens() // 512
        sched = SchedulingSpec("ilrs", target_batch_time=0.2)
        spec = InstanceSpec(cost, blocks, 512, token_budget=16384, scheduling=sched)
        reqs = [TraceRequest("long", 0.0, 1_000_000, 8)]
        reqs += [TraceRequest(f"s{i}", 1.0 + i, 2000, 32) for i in range(5)]
        cluster = ColocatedCluster(1, spec, RoundRobin())
        stats = cluster.run(reqs)
        cluster.check_integrity()
        assert all(s.finish is not None for s in stats)
        return {s.request_id: s.ttft for s in stats}

    flat = ttft(llama8b())
    three_d = ttft(llama8b(spp=4, kvp=2, kvp_rank_tokens=524_288))
    # the pipeline cuts the long prompt's TTFT; short ones are not stuck behind it
    assert three_d["long"] < 0.5 * flat["long"]
    assert max(v for k, v in three_d.items() if k != "long") < 0.1 * three_d["long"]
