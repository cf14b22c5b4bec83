"""The SkyWalker comparison behind the report's multi-region section (``python -m sim regions``).

Three regions (us, eu, asia) with one-way delays 40 / 80 / 100 ms, colocated llama3-8b
replicas on one L40S each (the cost model's stand-in for the paper's L4), a trace split into
regions by a diurnal curve offset by a third of a period per region (``sim.regional_workload``;
one period spans the replayed slice). Systems, all driven by the runtime's own policy objects:

- SkyWalker: one ``RegionBalancer`` per region, selective pushing by pending requests, prefix
  trie, forwarding to peers by snapshot trie; SkyWalker-CH: the same with session hashing;
- region-local: the SkyWalker balancers with forwarding off (each region on its own);
- SkyWalker with an exact local index: the local view is each replica's real cache (what a
  ``PrefixIndex`` fed by block events holds) instead of the trie of what was sent;
- one global balancer in us with blind pushing: round robin, least load, consistent hashing
  on the session id, and the prefix-aware policy (``policies.routing``).

Each run gives throughput (completed requests per second of the run's span, first arrival
to last finish), P50/P90 TTFT at the client, prefix-cache hit ratio, requests forwarded; the
sweep over replicas per region gives the fewest replicas that meet a P90 TTFT SLO.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from policies.region_balancer import BalancerConfig
from sim.cluster import InstanceSpec
from sim.metrics import summarize
from sim.presets import ClusterConfig, make_cost, routing_policy
from sim.regional_workload import split_regions
from sim.regions import MultiRegionCluster
from sim.traces import load_trace

REGIONS = ("us", "eu", "asia")
DELAY = {("us", "eu"): 0.04, ("us", "asia"): 0.08, ("eu", "asia"): 0.1}
SKYWALKER_SYSTEMS = {
    "SkyWalker": BalancerConfig(),
    "SkyWalker-CH": BalancerConfig(choice="hash"),
    "region-local": BalancerConfig(forward=False),
    "SkyWalker, exact local index": BalancerConfig(),
}
EXACT_LOCAL = {"SkyWalker, exact local index"}
GLOBAL_SYSTEMS = {
    "global round robin": "round-robin",
    "global least load": "least-loaded",
    "global consistent hashing": "consistent-hash",
    "global prefix-aware": "prefix-aware",
}
SYSTEMS = (*SKYWALKER_SYSTEMS, *GLOBAL_SYSTEMS)


@dataclass
class RegionRun:
    system: str
    trace: str
    limit: int
    speed: float
    replicas_per_region: int
    trace_dir: str | None = None
    model: str = "llama3-8b"
    gpu: str = "L40S"
    amplitude: float = 0.8
    seed: int = 0
    probe_interval: float = 0.1
    purpose: str = "compare"  # "compare": the systems side by side; "sweep": replica counts


def build(run: RegionRun) -> tuple[MultiRegionCluster, list]:
    cfg = ClusterConfig(model=run.model, gpu=run.gpu, tp=1)
    cost = make_cost(cfg)
    spec = InstanceSpec(cost, cost.kv_capacity_tokens() // cfg.block_size, cfg.block_size, 2048)
    reqs = load_trace(run.trace, run.trace_dir, limit=run.limit, speed=run.speed)
    period = max(r.arrival for r in reqs) or 1.0
    reqs, region_of = split_regions(reqs, REGIONS, period, run.amplitude, run.seed)
    replicas = dict.fromkeys(REGIONS, run.replicas_per_region)
    if run.system in SKYWALKER_SYSTEMS:
        cluster = MultiRegionCluster(
            replicas,
            spec,
            DELAY,
            region_of,
            balancer=SKYWALKER_SYSTEMS[run.system],
            probe_interval=run.probe_interval,
            exact_local=run.system in EXACT_LOCAL,
        )
    elif run.system in GLOBAL_SYSTEMS:
        policy = routing_policy(GLOBAL_SYSTEMS[run.system], run.seed)
        cluster = MultiRegionCluster(replicas, spec, DELAY, region_of, global_policy=policy)
    else:
        raise ValueError(f"unknown system {run.system!r}; known: {', '.join(SYSTEMS)}")
    return cluster, reqs


def execute(run: RegionRun) -> dict:
    cluster, reqs = build(run)
    t0 = time.perf_counter()
    stats = cluster.run(reqs)
    wall = time.perf_counter() - t0
    s = summarize(stats, ttft_slo=float("inf"), tbt_slos=())
    assert s.completed + s.rejected == s.arrived, "a request went missing"
    start = min(r.arrival for r in reqs)
    span = s.makespan - start
    out_tokens = sum(st.output_len for st in stats if st.done)
    return asdict(run) | {
        "completed": s.completed,
        "rejected": s.rejected,
        "throughput_rps": s.completed / span if span > 0 else 0.0,
        "output_tok_s": out_tokens / span if span > 0 else 0.0,
        "ttft_p50": s.ttft_p50,
        "ttft_p90": s.ttft_p90,
        "ttft_mean": s.ttft_mean,
        "hit_ratio": s.cache_hit_ratio,
        "forwarded": cluster.forwarded,
        "wall_s": wall,
    }


def plan(
    trace_dir: str | None,
    limit: int,
    speed: float,
    per_region: int,
    sweep: tuple[int, ...],
    azure_limit: int,
    azure_speed: float,
    heavy_speed: float | None = None,
) -> list[RegionRun]:
    """Every system on both traces at ``per_region``; the replica sweep (SkyWalker,
    region-local, global least load) at ``speed``; SkyWalker and region-local swept again
    at ``heavy_speed`` if given."""
    runs = [RegionRun(s, "conversation", limit, speed, per_region, trace_dir) for s in SYSTEMS]
    runs += [
        RegionRun(s, "azure-conv", azure_limit, azure_speed, per_region, trace_dir) for s in SYSTEMS
    ]
    for n in sweep:
        if n == per_region:
            continue
        for s in ("SkyWalker", "region-local", "global least load"):
            runs.append(RegionRun(s, "conversation", limit, speed, n, trace_dir, purpose="sweep"))
    if heavy_speed:
        for n in sweep:
            for s in ("SkyWalker", "region-local"):
                runs.append(
                    RegionRun(s, "conversation", limit, heavy_speed, n, trace_dir, purpose="sweep")
                )
    return runs


def run_all(runs: list[RegionRun], jobs: int = 1) -> list[dict]:
    if jobs <= 1:
        return [execute(r) for r in runs]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(execute, runs))


def write_results(path: Path, rows: list[dict], slo: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Where the traces were read from is this machine's business, not the report's.
    rows = [{k: v for k, v in r.items() if k != "trace_dir"} for r in rows]
    path.write_text(json.dumps({"ttft_slo_p90": slo, "rows": rows}, indent=1) + "\n")
