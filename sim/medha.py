"""Medha's scheduler ablation (section 5.4, Figure 22), simulated: FCFS, EDF, LRS and ILRS
with prefill-prefill batching on one colocated instance, over short requests mixed with a
few very long ones.

The instance is the real scheduler and block pool timed by the roofline of a ``Layout``
(by default the paper's: Llama-3 8B on A100s, TP8 x SPP2; with ``spp > 1`` a step of prompt
chunks only holds the instance for its first stage, so a long prompt's chunks pipeline;
``kvp > 1`` splits a request's attention over the KV-parallel groups holding it). The
workload: Poisson arrivals at ``qps``; short
requests with log-normal lengths (ShareGPT-like: input median 600, output median 250,
inputs capped at 8K), and a share ``long_fraction`` of long ones with inputs uniform in
[128K, 1M] and outputs of median 500. Deadlines are 3x each request's predicted prefill
time alone, at least ``min_slo`` seconds (Medha derives them from isolated runs).

Configurations (each with a token budget of ``chunk`` except the last):

  fcfs      FCFS, fixed chunks of ``chunk`` tokens (Sarathi-Serve)
  edf       earliest deadline first, fixed chunks
  lrs       least remaining slack (seconds), fixed chunks
  ilrs      slack relative to the SLO, fixed chunks
  ilrs+ppb  ILRS, adaptive chunks under ``target`` seconds per step and prefill-prefill
            batching (share at most 0.5)

Reported per configuration: median and p90 TTFT of all requests and of the short ones, the
median TTFT normalized by each request's own prefill time alone, the long ones' median
TTFT, median TPOT.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from placement.cost_model import RooflineCostModel, prefill_time
from placement.gpus import get_gpu
from placement.model_specs import get_model
from policies.routing import RoundRobin
from sim.cluster import InstanceSpec
from sim.colocated import ColocatedCluster
from sim.instance import SchedulingSpec
from sim.metrics import percentile
from sim.workload import TraceRequest

CONFIGS = ("fcfs", "edf", "lrs", "ilrs", "ilrs+ppb")


@dataclass(frozen=True)
class MedhaWorkload:
    qps: float = 0.5
    num_requests: int = 200
    long_fraction: float = 0.05
    long_min: int = 128_000
    long_max: int = 1_000_000
    seed: int = 0


def workload(w: MedhaWorkload) -> list[TraceRequest]:
    rng = random.Random(w.seed)
    t, out = 0.0, []
    for i in range(w.num_requests):
        t += rng.expovariate(w.qps)
        if rng.random() < w.long_fraction:
            n = rng.randint(w.long_min, w.long_max)
            o = max(1, int(rng.lognormvariate(math.log(500), 0.5)))
        else:
            n = min(8192, max(16, int(rng.lognormvariate(math.log(600), 1.0))))
            o = max(1, int(rng.lognormvariate(math.log(250), 0.8)))
        out.append(TraceRequest(f"r{i}", t, n, o))
    return out


@dataclass(frozen=True)
class Layout:
    """A replica's hardware and parallelism: ``tp`` GPUs per stage, ``spp`` pipeline stages,
    ``kvp`` KV-parallel groups, a request spilling to the next group past
    ``kvp_rank_tokens`` tokens (0: a group's capacity)."""

    model: str = "llama3-8b"
    gpu: str = "A100"
    tp: int = 8
    spp: int = 2
    kvp: int = 1
    kvp_rank_tokens: int = 0

    @property
    def label(self) -> str:
        parts = [f"TP{self.tp}"] + [f"SPP{self.spp}"] * (self.spp > 1)
        return " x ".join(parts + [f"KVP{self.kvp}"] * (self.kvp > 1))

    def cost(self) -> RooflineCostModel:
        return RooflineCostModel(
            get_model(self.model),
            get_gpu(self.gpu),
            tp=self.tp,
            spp=self.spp,
            kvp=self.kvp,
            kvp_rank_tokens=self.kvp_rank_tokens,
        )


@dataclass
class ConfigResult:
    name: str
    ttft_p50: float
    ttft_p90: float
    short_ttft_p50: float
    short_ttft_p90: float
    norm_ttft_p50: float  # TTFT / the request's prefill time alone
    long_ttft_p50: float
    tpot_p50: float
    finished: int
    tpot_p90: float = float("nan")
    long_tpot_p50: float = float("nan")  # the long requests' own decode steps


def run_config(
    name: str,
    requests: list[TraceRequest],
    chunk: int = 2048,
    target: float = 0.1,
    min_slo: float = 0.0,
    until: float = float("inf"),
    layout: Layout = Layout(),
) -> ConfigResult:
    cost = layout.cost()
    block = 512
    blocks = cost.kv_capacity_tokens() // block
    if name == "ilrs+ppb":
        sched = SchedulingSpec("ilrs", target_batch_time=target, min_ttft_slo=min_slo)
        spec = InstanceSpec(cost, blocks, block, token_budget=16384, scheduling=sched)
    elif name in ("fcfs", "edf", "lrs", "ilrs"):
        sched = SchedulingSpec(name, min_ttft_slo=min_slo)
        spec = InstanceSpec(cost, blocks, block, token_budget=chunk, chunk_size=chunk)
        spec.scheduling = sched
    else:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    cluster = ColocatedCluster(1, spec, RoundRobin())
    stats = cluster.run(requests, until)
    cluster.check_integrity()
    ttft = {s.request_id: s.ttft for s in stats if s.ttft is not None}
    lengths = {s.request_id: s.input_len for s in stats}
    short = [t for rid, t in ttft.items() if lengths[rid] <= 8192]
    long = [t for rid, t in ttft.items() if lengths[rid] > 8192]
    norm = [t / prefill_time(cost, lengths[rid], 0, chunk) for rid, t in ttft.items()]
    tpots = [s.tpot for s in stats if s.tpot is not None]
    long_tpots = [s.tpot for s in stats if s.tpot is not None and s.input_len > 8192]
    return ConfigResult(
        name,
        percentile(list(ttft.values()), 50),
        percentile(list(ttft.values()), 90),
        percentile(short, 50),
        percentile(short, 90),
        percentile(norm, 50),
        percentile(long, 50),
        statistics.median(tpots) if tpots else float("nan"),
        sum(1 for s in stats if s.finish is not None),
        percentile(tpots, 90),
        percentile(long_tpots, 50),
    )


def compare(w: MedhaWorkload, configs: tuple[str, ...] = CONFIGS) -> list[ConfigResult]:
    requests = workload(w)
    return [run_config(name, requests) for name in configs]


def format_table(w: MedhaWorkload, results: list[ConfigResult], layout: Layout = Layout()) -> str:
    lines = [
        f"Medha scheduler ablation, simulated: {layout.model} on {layout.gpu} "
        f"({layout.label}), qps {w.qps}, "
        f"{w.num_requests} requests, {w.long_fraction:.0%} long ({w.long_min}-{w.long_max})",
        "",
        "| config | TTFT p50 | TTFT p90 | short TTFT p50 | short TTFT p90 | "
        "TTFT / prefill alone p50 | long TTFT p50 | TPOT p50 | finished |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.ttft_p50:.2f}s | {r.ttft_p90:.2f}s | {r.short_ttft_p50:.2f}s | "
            f"{r.short_ttft_p90:.2f}s | {r.norm_ttft_p50:.1f} | {r.long_ttft_p50:.1f}s | "
            f"{r.tpot_p50 * 1e3:.1f}ms | "
            f"{r.finished} |"
        )
    return "\n".join(lines)
