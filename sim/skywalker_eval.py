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

Two workloads. Open loop: the trace's requests at its own (scaled) timestamps, each
session's region drawn from the diurnal curve (``sim.regional_workload``). Closed loop (the
paper's, section 5.1; ``clients > 0``): ``clients`` per region on average, their number
following the same diurnal curve, each running one conversation at a time turn by turn
(``sim.closed_loop``), for ``duration`` seconds, one diurnal period.

Each run gives throughput (open loop: completed requests per second of the run's span,
first arrival to last finish; closed loop: answers that reached their clients within
``duration``, per second), P50/P90 TTFT at the client, prefix-cache hit ratio, requests
forwarded. ``fewest_replicas`` searches, per system, the smallest total replica count
(spread over the regions as evenly as it divides, us first) whose P90 TTFT meets an SLO.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from policies.region_balancer import BalancerConfig
from policies.routing import make_routing_policy
from sim.closed_loop import ClientLoad, ClosedLoopClients, conversations
from sim.cluster import InstanceSpec
from sim.metrics import summarize
from sim.presets import ClusterConfig, make_cost
from sim.regional_workload import split_regions
from sim.regions import MultiRegionCluster
from sim.traces import load_trace
from sim.workload import TraceRequest

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
    "global round robin": "round_robin",
    "global least load": "least_loaded",
    "global consistent hashing": "consistent_hash",
    "global prefix-aware": "prefix_aware",
}
SYSTEMS = (*SKYWALKER_SYSTEMS, *GLOBAL_SYSTEMS)


@dataclass
class RegionRun:
    system: str
    trace: str
    limit: int | None  # requests read from the trace (None: all)
    speed: float
    replicas_per_region: int
    trace_dir: str | None = None
    model: str = "llama3-8b"
    gpu: str = "L40S"
    amplitude: float = 0.8
    seed: int = 0
    probe_interval: float = 0.1
    purpose: str = "compare"  # "compare": the systems side by side; "search": replica counts
    clients: int = 0  # closed loop: mean clients per region (0: open-loop replay)
    duration: float = 0.0  # closed loop: seconds of issuing turns (one diurnal period)
    replicas_total: int = 0  # if set: this many replicas in all, instead of per region
    replicas_by_region: tuple[int, ...] = ()  # if set: each region's count, in REGIONS order
    poisson_rate: float = 0.0  # if set: the trace's requests at this steady Poisson rate (req/s)
    kv_tokens: int = 0  # if set: each replica's KV capacity in tokens, instead of the GPU's


def replica_split(run: RegionRun) -> dict[str, int]:
    """Region -> replicas: ``replicas_by_region`` as given, else ``replicas_total`` spread as
    evenly as it divides (the first regions get the remainder), else ``replicas_per_region``
    each."""
    if run.replicas_by_region:
        if len(run.replicas_by_region) != len(REGIONS) or min(run.replicas_by_region) < 1:
            raise ValueError(f"replicas_by_region needs {len(REGIONS)} counts, each at least 1")
        return dict(zip(REGIONS, run.replicas_by_region, strict=True))
    if run.replicas_total <= 0:
        return dict.fromkeys(REGIONS, run.replicas_per_region)
    q, r = divmod(run.replicas_total, len(REGIONS))
    if q == 0:
        raise ValueError(f"replicas_total must be at least {len(REGIONS)}, one per region")
    return {g: q + (1 if i < r else 0) for i, g in enumerate(REGIONS)}


def steady_arrivals(reqs: list[TraceRequest], rate: float, seed: int) -> list[TraceRequest]:
    """The requests in trace order at Poisson arrivals of ``rate`` per second from 0: the
    trace's lengths and prefixes with an aggregate load that does not swing."""
    rng = random.Random(seed)
    t = 0.0
    out: list[TraceRequest] = []
    for r in reqs:
        out.append(replace(r, arrival=t))
        t += rng.expovariate(rate)
    return out


def build(run: RegionRun) -> tuple[MultiRegionCluster, list]:
    cfg = ClusterConfig(model=run.model, gpu=run.gpu, tp=1)
    cost = make_cost(cfg)
    kv_tokens = run.kv_tokens or cost.kv_capacity_tokens()
    spec = InstanceSpec(cost, kv_tokens // cfg.block_size, cfg.block_size, 2048)
    reqs = load_trace(run.trace, run.trace_dir, limit=run.limit, speed=run.speed)
    if run.poisson_rate > 0:
        reqs = steady_arrivals(reqs, run.poisson_rate, run.seed)
    clients: ClosedLoopClients | None = None
    if run.clients > 0:
        if run.duration <= 0:
            raise ValueError("a closed-loop run needs a positive duration")
        load = ClientLoad(run.clients, run.duration, run.duration, run.amplitude)
        clients = ClosedLoopClients(conversations(reqs), REGIONS, load)
        reqs = clients.initial()
        region_of = clients.region_of
    else:
        period = max(r.arrival for r in reqs) or 1.0
        reqs, region_of = split_regions(reqs, REGIONS, period, run.amplitude, run.seed)
    replicas = replica_split(run)
    follow = clients.answered if clients is not None else None
    if run.system in SKYWALKER_SYSTEMS:
        cluster = MultiRegionCluster(
            replicas,
            spec,
            DELAY,
            region_of,
            balancer=SKYWALKER_SYSTEMS[run.system],
            probe_interval=run.probe_interval,
            exact_local=run.system in EXACT_LOCAL,
            follow=follow,
        )
    elif run.system in GLOBAL_SYSTEMS:
        policy = make_routing_policy(GLOBAL_SYSTEMS[run.system], run.seed)
        cluster = MultiRegionCluster(
            replicas, spec, DELAY, region_of, global_policy=policy, follow=follow
        )
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
    if run.clients > 0:  # closed loop: answers back within the run's duration
        span = run.duration
        done = [st for st in stats if st.done and st.finish is not None and st.finish <= span]
    else:
        span = s.makespan - min(r.arrival for r in reqs)
        done = [st for st in stats if st.done]
    out_tokens = sum(st.output_len for st in done)
    return asdict(run) | {
        "completed": s.completed,
        "rejected": s.rejected,
        "throughput_rps": len(done) / span if span > 0 else 0.0,
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
    azure_limit: int,
    azure_speed: float,
    clients: tuple[int, ...],
    duration: float,
) -> list[RegionRun]:
    """Every system at ``per_region``: open loop on both traces, then closed loop on Mooncake's
    conversations at each client count."""
    runs = [RegionRun(s, "conversation", limit, speed, per_region, trace_dir) for s in SYSTEMS]
    runs += [
        RegionRun(s, "azure-conv", azure_limit, azure_speed, per_region, trace_dir) for s in SYSTEMS
    ]
    for c in clients:
        runs += [
            RegionRun(
                s, "conversation", None, 1.0, per_region, trace_dir, clients=c, duration=duration
            )
            for s in SYSTEMS
        ]
    return runs


def search_bases(
    trace_dir: str | None,
    limit: int,
    open_speed: float,
    clients: tuple[int, ...],
    duration: float,
) -> list[RegionRun]:
    """The replica searches: every system closed loop at each of ``clients`` per region;
    SkyWalker, region-local and global least load open loop at ``open_speed`` (0: none)."""
    bases = [
        RegionRun(s, "conversation", None, 1.0, 0, trace_dir, clients=c, duration=duration)
        for c in clients
        for s in SYSTEMS
    ]
    if open_speed > 0:
        bases += [
            RegionRun(s, "conversation", limit, open_speed, 0, trace_dir)
            for s in ("SkyWalker", "region-local", "global least load")
        ]
    return [replace(b, purpose="search") for b in bases]


def fewest_replicas(base: RegionRun, slo: float, lo: int, hi: int) -> list[dict]:
    """Bisection over the total replica count in ``[lo, hi]`` for the fewest whose P90 TTFT
    is within ``slo`` (assumes P90 does not rise with more replicas). Returns every run
    made; the answer is the smallest count among them that meets the SLO, none if ``hi``
    does not; the count below it was run and missed, unless the answer is ``lo``."""
    rows: dict[int, dict] = {}

    def meets(n: int) -> bool:
        if n not in rows:
            rows[n] = execute(replace(base, replicas_total=n))
        return bool(rows[n]["ttft_p90"] <= slo)

    if meets(hi):
        while lo < hi:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid + 1
    return [rows[n] for n in sorted(rows)]


def run_searches(bases: list[RegionRun], slo: float, lo: int, hi: int, jobs: int = 1) -> list[dict]:
    if jobs <= 1:
        return [row for b in bases for row in fewest_replicas(b, slo, lo, hi)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(fewest_replicas, b, slo, lo, hi) for b in bases]
        return [row for f in futures for row in f.result()]


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
