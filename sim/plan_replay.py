"""Replay a trace on a deployment plan (``python -m sim plan``) and say whether its
SLOs hold: the plan's instances become simulated instances (the runtime's scheduler and
block pool), timed by the same cost model the planner used.

- dense colocated (``DensePlan`` mode "colocated"): ``replicas`` instances of the plan's
  ``tp x spp x kvp`` roofline, least-loaded routing, chunked prefill of
  ``dense_plan.CHUNK`` tokens;
- dense P/D (mode "pd"): the Conductor over ``num_prefill`` prefill and ``num_decode``
  decode instances, each side timed by its own layout, KV moving at ``NIC_BW`` (admission
  "none": a request is refused only when no decode instance has room for its KV, and a
  refused request counts as a miss);
- MoE (``MoEPlan``): ``replicas`` instances timed by ``placement.moe_cost.MoEPlanCost``
  (attention/expert ping-pong), at most the plan's global batch each.

A request meets the SLOs when it finished, its TTFT <= ``ttft_s`` and its TPOT (mean
token gap) <= ``tpot_s``; the SLOs hold when at least ``target`` of the requests do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from placement.cost_model import RooflineCostModel, decode_time, prefill_time
from placement.dense_plan import CHUNK, DensePlan, Layout
from placement.model_specs import ModelSpec
from placement.moe_cost import MoEPlanCost
from placement.moe_plan import Hardware, MoEPlan
from policies.conductor import Conductor
from policies.routing import LeastLoaded
from sim.cluster import ClusterBase, InstanceSpec
from sim.colocated import ColocatedCluster
from sim.disaggregated import DisaggregatedCluster
from sim.metrics import RequestStats, percentile
from sim.workload import TraceRequest

BLOCK = 512  # simulated KV block (the Mooncake trace's hash-id block)
NIC_BW = 87e9  # bytes/s of KV transfer per instance (Mooncake's measured 4 x 200 Gbps)


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    met: int  # finished within both SLOs
    ttft_p90: float
    tpot_p90: float
    ttft_s: float
    tpot_s: float
    target: float

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 0.0

    @property
    def holds(self) -> bool:
        return self.requests > 0 and self.attainment >= self.target

    def line(self) -> str:
        verdict = "hold" if self.holds else "do NOT hold"
        return (
            f"simulated replay of {self.requests} requests: {self.attainment:.1%} meet TTFT <= "
            f"{self.ttft_s:g} s and TPOT <= {self.tpot_s * 1e3:g} ms (target "
            f"{self.target:.0%}): the SLOs {verdict}; TTFT p90 {self.ttft_p90:.2f} s, "
            f"TPOT p90 {self.tpot_p90 * 1e3:.1f} ms"
        )


def judge(
    stats: Sequence[RequestStats], ttft_s: float, tpot_s: float, target: float
) -> ReplayResult:
    done = [s for s in stats if s.done]
    met = sum(
        1
        for s in done
        if s.ttft is not None and s.ttft <= ttft_s and (s.tpot or 0.0) <= tpot_s + 1e-12
    )
    return ReplayResult(
        requests=len(stats),
        met=met,
        ttft_p90=percentile([s.ttft for s in done if s.ttft is not None], 90),
        tpot_p90=percentile([s.tpot for s in done if s.tpot is not None], 90),
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        target=target,
    )


def _roofline(model: ModelSpec, hw: Hardware, layout: Layout) -> RooflineCostModel:
    return RooflineCostModel(model, hw.gpu, tp=layout.tp, spp=layout.spp, kvp=layout.kvp)


def _blocks(cost: RooflineCostModel | MoEPlanCost) -> int:
    return max(1, cost.kv_capacity_tokens() // BLOCK)


def dense_cluster(
    plan: DensePlan, model: ModelSpec, hw: Hardware, ttft_s: float, tpot_s: float
) -> ClusterBase:
    if plan.mode == "colocated":
        assert plan.layout is not None
        cost = _roofline(model, hw, plan.layout)
        spec = InstanceSpec(cost, _blocks(cost), BLOCK, token_budget=CHUNK, max_num_seqs=1024)
        return ColocatedCluster(plan.replicas, spec, LeastLoaded())
    assert plan.prefill is not None and plan.decode is not None
    p_cost, d_cost = _roofline(model, hw, plan.prefill), _roofline(model, hw, plan.decode)
    pspec = InstanceSpec(p_cost, _blocks(p_cost), BLOCK, token_budget=CHUNK)
    dspec = InstanceSpec(d_cost, _blocks(d_cost), BLOCK, token_budget=CHUNK, max_num_seqs=1024)
    kv = model.kv_bytes_per_token

    @functools.lru_cache(maxsize=1 << 16)
    def prefill(new: int, cached: int) -> float:
        return prefill_time(p_cost, new, cached, CHUNK)

    @functools.lru_cache(maxsize=1 << 16)
    def decode_tbt(batch: int, blocks: int) -> float:
        return decode_time(d_cost, batch, blocks * BLOCK)

    conductor = Conductor(
        prefill_time=prefill,
        decode_tbt=decode_tbt,
        transfer_time=lambda blocks: blocks * BLOCK * kv / NIC_BW,
        ttft_slo=ttft_s,
        tbt_slo=tpot_s,
        replication_threshold=2.0,
        admission="none",
    )
    return DisaggregatedCluster(
        plan.num_prefill,
        plan.num_decode,
        pspec,
        dspec,
        conductor,
        kv,
        nic_bandwidth=NIC_BW,
        num_layers=model.num_layers,
    )


def moe_cluster(
    plan: MoEPlan, model: ModelSpec, hw_a: Hardware, hw_e: Hardware, replicas: int
) -> ClusterBase:
    cost = MoEPlanCost(plan, model, hw_a, hw_e)
    spec = InstanceSpec(
        cost, _blocks(cost), BLOCK, token_budget=max(CHUNK, plan.batch), max_num_seqs=plan.batch
    )
    return ColocatedCluster(replicas, spec, LeastLoaded())


def moe_replicas(plan: MoEPlan, requests: Sequence[TraceRequest]) -> int:
    """Replicas the trace's decode load needs: by Little's law ``rate x mean output x TPOT``
    requests decode at once, at most the plan's global batch per replica."""
    if len(requests) < 2:
        return 1
    arrivals = sorted(r.arrival for r in requests)
    span = arrivals[-1] - arrivals[0]
    if span <= 0:
        return 1
    rate = (len(requests) - 1) / span
    mean_out = sum(r.output_len for r in requests) / len(requests)
    return max(1, math.ceil(rate * mean_out * plan.t_iter / plan.batch - 1e-12))


def replay(
    cluster: ClusterBase,
    requests: Sequence[TraceRequest],
    ttft_s: float,
    tpot_s: float,
    target: float = 0.9,
) -> ReplayResult:
    stats = cluster.run(list(requests))
    return judge(stats, ttft_s, tpot_s, target)
