"""Agent trajectories from the conversation trace (``sim.agent_trajectories``) at cluster
scale in the DualPath simulator (``sim.dualpath``: the same ``policies.dualpath`` scheduler
and read-path choice the live P/D group runs), next to the live bench's figures
(``bench/agents.py --json``). ``python -m sim agents`` prints it.

Every trajectory starts at 0 and each next turn arrives its pause (a tool's run time or
the user's gap from the trace) after the previous answer; per variant: each turn's TTFT
p50/p99, the trajectory completion time (p50 and the last), goodput (turns per second
whose TTFT met the SLO, over the whole run) and the storage links' max/avg bytes.
Variants: ``basic`` (the prefill read path, as live ``pd-prefill``), ``dual`` and
``dual+sched`` (as live ``dualpath``). The colocated setup has no counterpart here: this
model has no HBM prefix cache, every turn's past is read from the store.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.agent_trajectories import AgentTrajectory, build_trajectories, summary
from sim.dualpath import VARIANTS, DualPathConfig, DualPathSim
from sim.events import Event
from sim.metrics import percentile
from sim.traces import load_trace
from sim.workload import TraceRequest

LIVE_SETUPS = ("colocated", "pd-prefill", "dualpath")
LIVE_OF = {"basic": "pd-prefill", "dual+sched": "dualpath"}


@dataclass(frozen=True)
class AgentSimResult:
    variant: str
    ttft_p50: float
    ttft_p99: float
    completion_p50: float
    completion: float  # the last trajectory's end
    goodput: float  # turns per second with TTFT <= slo
    storage_max_over_avg: float


class _TrackedSim(DualPathSim):
    """``DualPathSim`` that also keeps each trajectory's end (its last answer's)."""

    def __init__(self, cfg: DualPathConfig, variant: str) -> None:
        super().__init__(cfg, variant)
        self.traj_end: dict[int, float] = {}

    def _decode_done(self, r: Any, now: float) -> list[Event]:
        self.traj_end[r.traj] = now
        return super()._decode_done(r, now)


def simulate(
    trajs: Sequence[AgentTrajectory], cfg: DualPathConfig, variant: str, ttft_slo: float
) -> AgentSimResult:
    sim = _TrackedSim(cfg, variant)
    res = sim.run([t.as_sim() for t in trajs])
    good = sum(t <= ttft_slo for t in sim.ttfts)
    return AgentSimResult(
        variant,
        statistics.median(sim.ttfts),
        percentile(sim.ttfts, 99),
        statistics.median(sim.traj_end.values()),
        res.completion_time,
        good / res.completion_time,
        res.storage_max_over_avg,
    )


def agents_section(
    requests: Sequence[TraceRequest] | None = None,
    trajectories: int = 512,
    seed: int = 0,
    pd: tuple[int, int] = (8, 16),
    ttft_slo: float = 4.0,
    live: dict[str, dict[str, float]] | None = None,
) -> list[str]:
    """The section's lines; ``requests`` the conversation trace (loaded when None),
    ``live`` the bench's medians per setup (``bench/agents.py --json``)."""
    trace = load_trace("conversation") if requests is None else requests
    trajs = build_trajectories(trace, trajectories, seed=seed)
    s = summary(trajs)
    p, d = pd
    cfg = DualPathConfig(num_prefill=p, num_decode=d)
    lines = [
        "## Agent trajectories (simulated, cluster scale)",
        "",
        f"{trajectories} trajectories from the conversation trace ({s['turns']:.0f} turns, "
        f"{s['mean_turns']:.0f} per trajectory; first prompt {s['mean_first']:.0f} tokens, "
        f"appends {s['mean_append']:.0f}, answers {s['mean_output']:.0f}, final context "
        f"{s['mean_final_context']:.0f} on average; {s['tool_share']:.0%} of later turns "
        f"follow a tool, median tool pause {s['median_tool_pause_s']:.1f} s), all started "
        f"at 0, on {p} prefill and {d} decode engines (`DualPathConfig` otherwise: "
        "6.25 GB/s storage and 50 GB/s compute links per engine, 70 KB of KV per token). "
        f"Goodput: turns per second with TTFT <= {ttft_slo:g} s.",
        "",
        "| variant | turn TTFT p50 (s) | p99 (s) | completion p50 (s) | last (s) | "
        "goodput (turns/s) | storage max/avg |",
        "|---|---|---|---|---|---|---|",
    ]
    results = {v: simulate(trajs, cfg, v, ttft_slo) for v in VARIANTS}
    for v, r in results.items():
        lines.append(
            f"| {v} | {r.ttft_p50:.2f} | {r.ttft_p99:.2f} | {r.completion_p50:.0f} | "
            f"{r.completion:.0f} | {r.goodput:.2f} | {r.storage_max_over_avg:.2f} |"
        )
    base, best = results["basic"], results["dual+sched"]
    lines += [
        "",
        f"Turn TTFT p50 basic/dual+sched: {base.ttft_p50 / best.ttft_p50:.2f}; completion "
        f"time: {base.completion / best.completion:.2f}. Paper (arXiv 2602.21548): up to "
        "1.87x offline throughput, 1.96x online capacity.",
        "",
    ]
    if live:
        lines += live_lines(live, results)
    return lines


def live_lines(
    live: dict[str, dict[str, float]], results: dict[str, AgentSimResult] | None = None
) -> list[str]:
    """The live bench's medians, with the simulated variant each one stands for."""
    lines = [
        "Live (`bench/agents.py`, CPU, bench model, scaled trajectories), medians of runs:",
        "",
        "| setup | turn TTFT p50 (ms) | p99 (ms) | completion p50 (s) | goodput (turns/s) | "
        "cached | simulated TTFT p50 (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    sim_of = {live_name: v for v, live_name in LIVE_OF.items()}
    for setup in LIVE_SETUPS:
        m = live.get(setup)
        if m is None:
            continue
        v = sim_of.get(setup)
        simulated = f"{results[v].ttft_p50:.2f} ({v})" if results and v else "n/a"
        lines.append(
            f"| {setup} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
            f"{m['completion_p50_s']:.1f} | {m['goodput_turns_s']:.2f} | "
            f"{m['cached_share']:.0%} | {simulated} |"
        )
    lines.append("")
    return lines


def load_live(path: str | Path) -> dict[str, dict[str, float]]:
    return dict(json.loads(Path(path).read_text())["medians"])
