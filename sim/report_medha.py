"""Medha's scheduling comparison and its 3D-vs-2D parallelism result, simulated: the Medha
section of ``docs/sim_report.md`` (``python -m sim report``), our figures next to the paper's.

1. Scheduling (paper section 5.4, Figure 22): Llama-3 8B on A100s, TP8 x SPP2; ShareGPT-like
   short requests with 5% of 128K-1M tokens (``sim.medha.workload``); FCFS, EDF, LRS (slack
   in seconds), ILRS (slack relative to the SLO; the paper's "LRS with normalization") with
   fixed chunks, and ILRS with adaptive chunks and prefill-prefill batching (Medha's
   scheduler), at the paper's low and high loads.
2. 3D vs 2D (paper section 5.3, Figures 17 and 18): Llama-3 70B on H100s, TP8 in both,
   SPP8 (2D) against SPP4 x KVP2 (3D, a request spilling to the second KV group past
   ``KVP_RANK_TOKENS``), the same short requests with 5% of 2M tokens, ILRS with fixed
   2048-token chunks (Medha's adaptive chunks at 2M tokens of context make tens of
   thousands of tiny steps: minutes per run here).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sim.medha import CONFIGS, ConfigResult, Layout, MedhaWorkload, run_config, workload

SCHED_LAYOUT = Layout("llama3-8b", "A100", tp=8, spp=2)
SCHED_QPS = (0.25, 1.75)  # the paper's low and high load
KVP_RANK_TOKENS = 1_000_000  # a 2M-token request spans both KV groups
LAYOUT_2D = Layout("llama3-70b", "H100", tp=8, spp=8)
LAYOUT_3D = Layout("llama3-70b", "H100", tp=8, spp=4, kvp=2, kvp_rank_tokens=KVP_RANK_TOKENS)
PAR_QPS = (0.25, 1.75)
LONG_3D = 2_000_000


@dataclass
class MedhaRuns:
    requests: int
    par_requests: int
    sched: dict[float, list[ConfigResult]]  # qps -> one result per CONFIGS entry
    par: dict[float, tuple[ConfigResult, ConfigResult]]  # qps -> (2D, 3D)
    wall_s: float


def run_medha(requests: int = 200, seed: int = 0, par_requests: int = 100) -> MedhaRuns:
    t0 = time.perf_counter()
    sched = {}
    for qps in SCHED_QPS:
        reqs = workload(MedhaWorkload(qps, requests, 0.05, seed=seed))
        sched[qps] = [run_config(name, reqs, layout=SCHED_LAYOUT) for name in CONFIGS]
    par = {}
    for qps in PAR_QPS:
        w = MedhaWorkload(qps, par_requests, 0.05, LONG_3D, LONG_3D, seed=seed)
        reqs = workload(w)
        par[qps] = (
            run_config("ilrs", reqs, layout=LAYOUT_2D),
            run_config("ilrs", reqs, layout=LAYOUT_3D),
        )
    return MedhaRuns(requests, par_requests, sched, par, time.perf_counter() - t0)


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def _sched_rows(results: Sequence[ConfigResult]) -> list[str]:
    return [
        f"| {r.name} | {_s(r.ttft_p50)} | {_s(r.ttft_p90)} | {r.norm_ttft_p50:.1f} "
        f"| {_s(r.short_ttft_p50)} | {_s(r.long_ttft_p50)} | {1e3 * r.tpot_p50:.0f} ms "
        f"| {r.finished} |"
        for r in results
    ]


def medha_section(runs: MedhaRuns) -> list[str]:
    lines = [
        "## Medha: scheduling and 3D parallelism (simulated)",
        "",
        f"`sim/report_medha.py`, {runs.requests} requests per run (Poisson arrivals; short "
        "ones ShareGPT-like:",
        "input median 600, output median 250, inputs at most 8K), the real scheduler and block "
        "pool timed by",
        "the roofline of the layout (with SPP a step of prompt chunks only holds the first "
        "stage, so a long",
        "prompt's chunks pipeline; with KVP a request's attention splits over the KV groups "
        "holding it, plus",
        "the all-gather of partial outputs). TTFT deadlines: 3x each request's prefill time "
        "alone. Took",
        f"{runs.wall_s:.0f} s.",
        "",
        f"### Scheduling: Llama-3 8B, {SCHED_LAYOUT.label} on A100s, 5% requests of 128K-1M tokens",
        "",
        "fcfs / edf / lrs / ilrs: fixed 2048-token chunks and budget, one prefill at a time "
        "after decodes",
        "(lrs: least slack in seconds; ilrs: slack relative to the SLO, the paper's \"LRS with "
        'normalization").',
        "ilrs+ppb: Medha's scheduler (ILRS, adaptive chunks keeping a step under 0.1 s, "
        "prefill-prefill",
        "batching). Normalized TTFT: TTFT / the request's own prefill time alone (the paper's "
        "Figure 22 metric).",
        "",
    ]
    for qps, results in runs.sched.items():
        lines += [
            f"At {qps:g} QPS:",
            "",
            "| scheduler | TTFT p50 | TTFT p90 | normalized TTFT p50 | short TTFT p50 "
            "| long TTFT p50 | TPOT p50 | finished |",
            "|---|---|---|---|---|---|---|---|",
            *_sched_rows(results),
            "",
        ]
    high = runs.sched[max(runs.sched)]
    by = {r.name: r for r in high}
    ratio = by["ilrs"].ttft_p50 / by["ilrs+ppb"].ttft_p50
    norm_ratio = by["ilrs"].norm_ttft_p50 / by["ilrs+ppb"].norm_ttft_p50
    lrs_ratio = by["lrs"].ttft_p50 / by["ilrs+ppb"].ttft_p50
    edf_fcfs = by["edf"].ttft_p50 > 0.5 * by["fcfs"].ttft_p50
    lines += [
        f"**Against the paper.** At {max(runs.sched):g} QPS Medha's scheduler has "
        f"{ratio:.2f}x lower median TTFT than ILRS",
        f"with fixed chunks (normalized TTFT {norm_ratio:.2f}x) and {lrs_ratio:.2f}x lower "
        "than LRS; the paper reports",
        "1.6-1.8x against its normalized LRS (Figure 22), from space sharing: a short prefill "
        "rides in the",
        "room a long one's chunk leaves instead of waiting its turn. FCFS is head-of-line "
        "blocked behind the",
        "long prompts, as in the paper. "
        + (
            "EDF degrades towards FCFS here, as in the paper."
            if edf_fcfs
            else "EDF does not degrade to FCFS here (the paper's EDF does at 1.75 QPS): our "
            "deadlines scale with each request's own prefill time, so a long request's "
            "deadline is far off and EDF serves the short ones first, as the slack orders do."
        ),
        "The paper measures real A100s with its own SLOs; ours is a roofline with 3x-prefill "
        "deadlines, so",
        "the direction is what to compare, not the seconds.",
        "",
    ]
    lines += [
        f"### 3D vs 2D: Llama-3 70B on H100s, {LAYOUT_2D.label} (2D) vs {LAYOUT_3D.label} (3D)",
        "",
        f"{runs.par_requests} requests per run: the same short ones with 5% of "
        f"{LONG_3D // 1_000_000}M tokens (the paper: ShareGPT4 plus",
        "5% 2M-token requests, 64 H100s in both setups). ILRS with fixed 2048-token chunks "
        "(Medha's adaptive",
        "chunks at 2M tokens of context make tens of thousands of small steps, minutes per run "
        "here). In 3D a",
        f"request holds at most {KVP_RANK_TOKENS // 1000}K tokens of KV per group, so each "
        "long one spans both groups.",
        "",
        "| QPS | layout | TTFT p50 | TTFT p90 | long TTFT p50 | TPOT p50 | TPOT p90 "
        "| long requests' TPOT p50 | finished |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for qps, (two, three) in runs.par.items():
        for label, r in (("2D", two), ("3D", three)):
            lines.append(
                f"| {qps:g} | {label} | {_s(r.ttft_p50)} | {_s(r.ttft_p90)} "
                f"| {_s(r.long_ttft_p50)} | {1e3 * r.tpot_p50:.0f} ms "
                f"| {1e3 * r.tpot_p90:.0f} ms | {1e3 * r.long_tpot_p50:.0f} ms | {r.finished} |"
            )
    two, three = runs.par[max(runs.par)]
    lines += [
        "",
        f"**Against the paper.** At {max(runs.par):g} QPS, 2D's TPOT over 3D's: "
        f"{two.tpot_p50 / three.tpot_p50:.2f}x at p50 and "
        f"{two.tpot_p90 / three.tpot_p90:.2f}x at p90; the long",
        f"requests' own TPOT {two.long_tpot_p50 / three.long_tpot_p50:.2f}x; 3D's median "
        f"TTFT is {three.ttft_p50 / two.ttft_p50:.2f}x 2D's and the long ones' "
        f"{three.long_ttft_p50 / two.long_ttft_p50:.2f}x.",
        "The paper reports over 2x lower TPOT at p50 and p90 at 1.75 QPS (Figure 18) with "
        "similar median",
        "TTFT and a slightly lower peak throughput for 3D (Figure 17). The mechanisms are "
        "there: KVP halves",
        "the KV reads of a step holding a 2M-token request (its decode is faster, the long "
        "requests' TPOT",
        "column), and SPP8 pipelines a long prompt's chunks over twice the stages, so 2D "
        "prefills it faster.",
        "Where the short requests' TPOT does not move, it is because in these runs they "
        "rarely share a",
        "step with a long request's decode: a 2M-token prefill here takes longer than the "
        "short requests'",
        "whole arrival window, and our simulator pipelines only steps that sample no token "
        "(a step with a",
        "decode in it pays every stage), so the long prompts reach decode after most short "
        "ones are done.",
        "The paper's absolute figures come from real H100s over a longer run.",
        "",
    ]
    return lines
