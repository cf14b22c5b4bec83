"""Scenarios small enough to check by hand against the cost model."""

from __future__ import annotations

import pytest

from placement.cost_model import RooflineCostModel, prefill_time
from placement.gpus import get_gpu
from placement.model_specs import get_model
from policies.routing import RoundRobin
from sim.cluster import InstanceSpec
from sim.colocated import ColocatedCluster
from sim.presets import ClusterConfig, build_cluster
from sim.workload import TraceRequest


def cost():
    return RooflineCostModel(get_model("llama3-8b"), get_gpu("H100"), tp=1)


def one_instance(budget=4096):
    spec = InstanceSpec(cost(), num_blocks=1000, block_size=16, token_budget=budget)
    return ColocatedCluster(1, spec, RoundRobin())


def test_single_request_ttft_and_tpot_are_the_cost_model_s():
    c = cost()
    cluster = one_instance()
    [s] = cluster.run([TraceRequest("a", 1.0, 1000, 5, (7, 8), trace_block_size=512)])
    # One prefill iteration of 1000 tokens, then one decode iteration per further token,
    # each over a context one longer.
    assert s.ttft == pytest.approx(c.batch_time([(1000, 0)]))
    gaps = [c.batch_time([(1, 1000 + i)]) for i in range(4)]
    assert s.tpot == pytest.approx(sum(gaps) / 4)
    assert s.tbt == pytest.approx(max(gaps))  # 10% of 4 gaps rounds up to the longest one
    assert s.finish == pytest.approx(1.0 + s.ttft + sum(gaps))


def test_chunked_prefill_and_a_prefix_hit():
    c = cost()
    cluster = one_instance(budget=512)
    a = TraceRequest("a", 0.0, 1024, 1, (1, 2), trace_block_size=512)
    b = TraceRequest("b", 100.0, 1024, 1, (1, 3), trace_block_size=512)  # shares block 1
    sa, sb = cluster.run([a, b])
    assert sa.ttft == pytest.approx(c.batch_time([(512, 0)]) + c.batch_time([(512, 512)]))
    assert sb.cached_tokens == 512
    assert sb.ttft == pytest.approx(c.batch_time([(512, 512)]))


def test_disaggregated_ttft_is_the_prefill_and_the_first_gap_holds_the_streaming_tail():
    cfg = ClusterConfig(
        mode="pd",
        policy="conductor",
        instances=2,
        model="llama3-8b",
        gpu="H100",
        tp=1,
        block_size=16,
        prefill_budget=8192,
        prefill_cache_tokens=10_000,
        nic_bandwidth=10e9,
    )
    c = cost()
    cluster = build_cluster(cfg, c)
    [s] = cluster.run([TraceRequest("a", 0.0, 2000, 3, (1, 2, 3, 4), trace_block_size=512)])
    assert s.ttft == pytest.approx(prefill_time(c, 2000))
    # KV streams layer by layer during the prefill: what is left after it is the part the
    # NIC could not hide behind the prefill, plus the last layer's share.
    transfer = 2000 * c.model.kv_bytes_per_token / 10e9
    tail = max(0.0, transfer - c.batch_time([(2000, 0)])) + transfer / c.model.num_layers
    first_gap = tail + c.batch_time([(1, 2000)])
    second_gap = c.batch_time([(1, 2001)])
    assert s.finish - s.arrival == pytest.approx(s.ttft + first_gap + second_gap)
    assert s.tbt == pytest.approx(first_gap)
