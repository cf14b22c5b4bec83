"""Building clusters by name: the cost model, instance specs, the real policy objects.

``ClusterConfig`` holds every knob the CLI exposes; ``build_cluster`` returns a fresh
cluster (a cluster runs one trace once). Policy names:

- colocated: the runtime router's names (``policies.routing.ROUTING_POLICIES``: ``random``,
  ``round_robin``, ``least_loaded``, ``power_of_two``, ``prefix_aware``,
  ``consistent_hash``; ``-`` may stand for ``_``);
- disaggregated: ``random`` and ``least_loaded`` (load-balancing) pick the prefill instance
  by those routing policies; ``local`` is the Conductor without cross-instance KV copies
  (local cache-aware, Mooncake section 4.1); ``conductor`` is the global Conductor with
  copies and hot-block replication (section 4.2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from placement.cost_model import CostModel, RooflineCostModel, decode_time, prefill_time
from placement.gpus import get_gpu
from placement.model_specs import get_model
from policies.conductor import Conductor
from policies.routing import ROUTING_POLICIES, make_routing_policy, routing_name
from sim.cluster import ClusterBase, InstanceSpec
from sim.colocated import ColocatedCluster
from sim.disaggregated import DisaggregatedCluster

COLOCATED_POLICIES = ROUTING_POLICIES.names()
ROUTED_PD_POLICIES = ("random", "least_loaded")  # routing policies that pick the prefill
PD_POLICIES = (*ROUTED_PD_POLICIES, "local", "conductor")


@dataclass
class ClusterConfig:
    mode: str = "pd"  # "pd" | "colocated"
    policy: str = "conductor"
    instances: int = 16  # colocated: replicas; pd: prefill + decode
    prefill: int | None = None  # pd: prefill instances (default half)
    model: str = "llama2-70b"
    gpu: str = "A800"
    tp: int = 8
    block_size: int = 512
    ttft_slo: float = 30.0
    tbt_slo: float = 0.1
    admission: str = "none"  # pd: none | early | predictive | baseline
    colocated_budget: int = 2048  # chunked-prefill token budget per iteration
    prefill_budget: int = 16384
    prefill_cache_tokens: int = 3_000_000  # Mooncake 5.3.2: 3M tokens of cache per node
    nic_bandwidth: float = 87e9
    decode_duration: float | None = None  # t_d for predictive admission (default: 343 x TBT SLO)
    seed: int = 0


def make_cost(cfg: ClusterConfig) -> RooflineCostModel:
    return RooflineCostModel(get_model(cfg.model), get_gpu(cfg.gpu), tp=cfg.tp)


def make_conductor(cfg: ClusterConfig, cost: CostModel, global_cache: bool) -> Conductor:
    bs = cfg.block_size
    kv = get_model(cfg.model).kv_bytes_per_token
    if global_cache:

        def transfer(blocks: int) -> float:
            return blocks * bs * kv / cfg.nic_bandwidth
    else:

        def transfer(blocks: int) -> float:
            return math.inf  # local cache-aware: never copy from another instance

    admission = "none" if cfg.admission == "baseline" else cfg.admission

    # Pure functions of their arguments, asked for every instance at every arrival: memoised.
    @functools.lru_cache(maxsize=1 << 16)
    def prefill(new: int, cached: int) -> float:
        return prefill_time(cost, new, cached, cfg.prefill_budget)

    @functools.lru_cache(maxsize=1 << 16)
    def decode_tbt(batch: int, blocks: int) -> float:
        return decode_time(cost, batch, blocks * bs)

    return Conductor(
        prefill_time=prefill,
        decode_tbt=decode_tbt,
        transfer_time=transfer,
        ttft_slo=cfg.ttft_slo,
        tbt_slo=cfg.tbt_slo,
        replication_threshold=2.0 if global_cache else math.inf,
        admission=admission,
        decode_duration=cfg.decode_duration or 343 * cfg.tbt_slo,  # mean output at the SLO
    )


def build_cluster(cfg: ClusterConfig, cost: CostModel | None = None) -> ClusterBase:
    cost = cost or make_cost(cfg)
    bs = cfg.block_size
    hbm_blocks = make_cost(cfg).kv_capacity_tokens() // bs
    if cfg.mode == "colocated":
        spec = InstanceSpec(cost, hbm_blocks, bs, token_budget=cfg.colocated_budget)
        return ColocatedCluster(cfg.instances, spec, make_routing_policy(cfg.policy, cfg.seed))
    if cfg.mode != "pd":
        raise ValueError(f"mode must be 'pd' or 'colocated', not {cfg.mode!r}")
    policy = routing_name(cfg.policy)
    if policy not in PD_POLICIES:
        raise ValueError(f"unknown P/D policy {cfg.policy!r}; known: {', '.join(PD_POLICIES)}")
    n_prefill = cfg.prefill if cfg.prefill is not None else cfg.instances // 2
    n_decode = cfg.instances - n_prefill
    if n_prefill <= 0 or n_decode <= 0:
        raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
    pspec = InstanceSpec(
        cost, max(hbm_blocks, cfg.prefill_cache_tokens // bs), bs, token_budget=cfg.prefill_budget
    )
    dspec = InstanceSpec(cost, hbm_blocks, bs, token_budget=cfg.colocated_budget, max_num_seqs=512)
    routed = policy in ROUTED_PD_POLICIES
    return DisaggregatedCluster(
        n_prefill,
        n_decode,
        pspec,
        dspec,
        make_conductor(cfg, cost, global_cache=policy == "conductor"),
        get_model(cfg.model).kv_bytes_per_token,
        nic_bandwidth=cfg.nic_bandwidth,
        prefill_policy=make_routing_policy(policy, cfg.seed) if routed else None,
        baseline_admission=cfg.admission == "baseline",
        num_layers=get_model(cfg.model).num_layers,
    )
