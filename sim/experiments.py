"""The experiment suite behind ``docs/sim_report.md``: one function per question, each a
list of independent runs (a ``RunSpec`` each) so they can run in parallel processes.

- prefill scheduling (Mooncake Fig. 5): random, load-balancing, local cache-aware and the
  global Conductor picking prefill instances in an 8P + 8D cluster;
- effective request capacity (Fig. 1): the P/D cluster against 16 colocated vLLM-like
  replicas with chunked prefill, attainment versus replay speed for each TBT SLO;
- overload (the paper's 2x run): rejections and SLO attainment with no admission control,
  the baseline, early rejection and early rejection with prediction, per TBT SLO.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from sim.metrics import Summary, summarize
from sim.presets import ClusterConfig, build_cluster
from sim.traces import load_trace


@dataclass
class RunSpec:
    label: str
    cfg: ClusterConfig
    speed: float = 1.0
    limit: int | None = None
    trace: str = "conversation"
    trace_dir: str | None = None
    tbt_slos: tuple[float, ...] = (0.1, 0.2, 0.3)


@dataclass
class RunResult:
    spec: RunSpec
    summary: Summary
    wall_s: float
    ttfts: list[float] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)
    blocks_copied: int = 0
    prefill_busy_s: float = 0.0
    events: int = 0
    decode_peak_batch: int = 0  # most requests in one decode iteration, any decode instance
    decode_peak_kv: float = 0.0  # highest share of a decode instance's KV blocks in use
    decode_kv_tokens: int = 0  # KV capacity of one decode instance, tokens


def execute(spec: RunSpec) -> RunResult:
    """Run one configuration end to end (top level, so a process pool can call it)."""
    reqs = load_trace(spec.trace, spec.trace_dir, limit=spec.limit, speed=spec.speed)
    cluster = build_cluster(spec.cfg)
    t0 = time.perf_counter()
    stats = cluster.run(reqs)
    wall = time.perf_counter() - t0
    summary = summarize(stats, spec.cfg.ttft_slo, spec.tbt_slos)
    assert summary.completed + summary.rejected == summary.arrived, "a request went missing"
    rejections: dict[str, int] = {}
    for s in stats:
        if s.rejected is not None:
            rejections[s.rejected] = rejections.get(s.rejected, 0) + 1
    prefill_busy = sum(
        i.busy_time for i in cluster.instances() if i.role in ("prefill", "colocated")
    )
    decodes = [i for i in cluster.instances() if i.role == "decode"]
    return RunResult(
        spec,
        summary,
        wall,
        ttfts=sorted(s.ttft for s in stats if s.done and s.ttft is not None),
        rejections=rejections,
        blocks_copied=getattr(cluster, "blocks_copied", 0),
        prefill_busy_s=prefill_busy,
        events=cluster.loop.fired,
        decode_peak_batch=max((d.peak_batch for d in decodes), default=0),
        decode_peak_kv=max((d.peak_blocks / d.pool.num_blocks for d in decodes), default=0.0),
        decode_kv_tokens=decodes[0].pool.num_blocks * decodes[0].block_size if decodes else 0,
    )


def prefill_scheduling(base: ClusterConfig, speed: float, limit: int | None) -> list[RunSpec]:
    names = {
        "random": "random",
        "least_loaded": "load-balancing",
        "local": "local cache-aware",
        "conductor": "global cache-aware (Conductor)",
    }
    return [
        RunSpec(label, replace(base, mode="pd", policy=p, admission="none"), speed, limit)
        for p, label in names.items()
    ]


def capacity_runs(base: ClusterConfig, speeds: list[float], limit: int | None) -> list[RunSpec]:
    pd = replace(base, mode="pd", policy="conductor", admission="none")
    colocated = replace(base, mode="colocated", policy="round_robin")
    out = []
    for s in speeds:
        out.append(RunSpec("P/D + Conductor (Mooncake-like)", pd, s, limit))
        out.append(RunSpec("colocated, chunked prefill (vLLM-like)", colocated, s, limit))
    return out


OVERLOAD_LABELS = {
    "none": "no admission control",
    "baseline": "baseline",
    "early": "early rejection",
    "predictive": "with prediction",
}


def overload_runs(
    base: ClusterConfig, speed: float, limit: int | None, tbt_slos: tuple[float, ...] = (0.1,)
) -> list[RunSpec]:
    """Each admission mode under each TBT SLO, P/D with the Conductor. The predictive mode's
    uniform decode time t_d is the trace's mean output (343 tokens, the paper's Table 2)
    decoding at the SLO's pace, unless ``base.decode_duration`` sets it."""
    out = []
    for slo in tbt_slos:
        t_d = base.decode_duration or 343 * slo
        for a, label in OVERLOAD_LABELS.items():
            cfg = replace(
                base, mode="pd", policy="conductor", admission=a, tbt_slo=slo, decode_duration=t_d
            )
            out.append(RunSpec(label, cfg, speed, limit, tbt_slos=(slo,)))
    return out


def run_all(specs: list[RunSpec], jobs: int = 1) -> list[RunResult]:
    if jobs <= 1:
        return [execute(s) for s in specs]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(execute, specs))
