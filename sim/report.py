"""Write ``docs/sim_report.md`` and its figures from the experiment results.

Paper figures are quoted from the text of Mooncake (FAST'25, ``shared/papers/mooncake.txt``)
and its arXiv version (``shared/papers/README.md``); numbers that live only in the papers'
plots are not in the text we have, and the report says so rather than guessing them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from sim.capacity import capacity
from sim.experiments import RunResult
from sim.presets import ClusterConfig

TBT_SLOS = (0.1, 0.2, 0.3)


def _plots(figdir: Path, sched: list[RunResult], cap: list[RunResult]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figdir.mkdir(parents=True, exist_ok=True)
    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sched:
        n = len(r.ttfts)
        ax.plot(r.ttfts, [(i + 1) / n for i in range(n)], label=r.spec.label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.set_title("Prefill scheduling, conversation trace, 8P+8D")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(figdir / "ttft_cdf.png", dpi=120)
    plt.close(fig)
    names.append("ttft_cdf.png")

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    labels = sorted({r.spec.label for r in cap})
    for ax, slo in zip(axes, TBT_SLOS, strict=True):
        for label in labels:
            pts = sorted(
                (r.spec.speed, r.summary.attainment[slo]) for r in cap if r.spec.label == label
            )
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
        ax.axhline(90, color="grey", ls="--", lw=0.8)
        ax.set_title(f"TTFT <= 30 s, TBT <= {int(slo * 1000)} ms")
        ax.set_xlabel("replay speed (x trace rate)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests meeting both SLOs (%)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figdir / "capacity.png", dpi=120)
    plt.close(fig)
    names.append("capacity.png")
    return names


def _fmt_row(r: RunResult) -> str:
    s = r.summary
    return (
        f"| {r.spec.label} | {s.ttft_mean:.2f} | {s.ttft_p50:.2f} | {s.ttft_p90:.2f} | "
        f"{s.ttft_p99:.2f} | {1000 * s.tbt_mean:.0f} | {100 * s.cache_hit_ratio:.1f}% | "
        f"{r.blocks_copied} | {r.prefill_busy_s / 3600:.2f} | {r.wall_s:.1f} |"
    )


def _overload_analysis(base: ClusterConfig, over: list[RunResult]) -> list[str]:
    """Is the decode pool ever near its TBT SLO? The numbers that decide it."""
    from placement.cost_model import decode_time
    from placement.model_specs import get_model
    from sim.presets import make_cost

    if not over:
        return []
    cost = make_cost(base)
    kv_tokens = over[0].decode_kv_tokens or cost.kv_capacity_tokens()
    kv_per_token = get_model(base.model).kv_bytes_per_token
    per_req = 12_035 + 343  # the paper's Table 2 means for this trace: input + output
    full_batch = max(1, kv_tokens // per_req)
    tbt_full = decode_time(cost, full_batch, full_batch * per_req)
    slo = over[0].spec.cfg.tbt_slo
    lines = [
        "### Is the decode pool ever loaded?",
        "",
        "All admission modes can differ only if some decode instance nears the TBT SLO or",
        "fills its KV. The decode side of the overload runs, and what the model allows:",
        "",
        "| admission | decode peak batch | decode peak KV use | TBT p90 (ms) | TBT mean (ms) "
        "| prefill busy (node h) |",
        "|---|---|---|---|---|---|",
    ]
    for r in over:
        s = r.summary
        lines.append(
            f"| {r.spec.label} | {r.decode_peak_batch} | {100 * r.decode_peak_kv:.0f}% | "
            f"{1000 * s.tbt_p90:.0f} | {1000 * s.tbt_mean:.0f} | {r.prefill_busy_s / 3600:.2f} |"
        )
    lines += [
        "",
        f"- KV capacity of one decode instance: {kv_tokens:,} tokens "
        f"({kv_per_token / 1024:.0f} KiB per token for `{base.model}` with GQA; "
        f"8 x 80 GB x {cost.mem_util:g} minus {cost.model.weight_bytes / 1e9:.0f} GB of weights),",
        f"  i.e. about {full_batch} requests of the trace's mean length "
        f"({per_req:,} tokens) at once.",
        f"- Roofline TBT of a decode instance whose KV is full of such requests (batch "
        f"{full_batch}): {1000 * tbt_full:.0f} ms, against the {1000 * slo:.0f} ms SLO.",
        "",
    ]
    if tbt_full <= slo:
        lines += [
            "So in this model no decode instance can break the TBT SLO at all: before its batch is",
            "large enough to, its KV is full, and the Conductor's `decode_full` check (room for "
            "the",
            "request's lifetime blocks) is what would refuse. That needs many more concurrent "
            "decodes",
            "than the prefill pool can feed: at 2x the prefill pool is the bottleneck (the "
            "TTFT SLO",
            "rejects), so decode sees at most the prefill pool's throughput. The decode model was",
            "checked for the errors the brief suspected: the decode batch is not capped below the",
            "KV limit (`max_num_seqs` 512, token budget 2,048), and the KV capacity is that of GQA",
            "LLaMA2-70B on 8 x 80 GB. Neither is a modelling error; the equal counts are what a",
            "roofline of this hardware predicts. The paper's real decode nodes are slower than a",
            "roofline (kernel launches, sampling, a real attention kernel over 12k-token contexts)",
            "and ran the arXiv trace (23,000 requests, not public), so its decode pool was loaded;",
            "we do not tune our model toward its counts. What would separate the modes here is a",
            "decode predictor fitted on real GPU decode steps (`placement/fitted.py`), which we",
            "cannot measure on this machine.",
            "",
        ]
    return lines


def _sim2real_section(path: Path) -> list[str]:
    lines = ["## Sim-to-real (live CPU engine, tiny model)", ""]
    if not path.exists():
        return lines + [f"No `{path}`: run `python -m sim sim2real` first.", ""]
    d = json.loads(path.read_text())
    lo, hi = d["calibration_slice"]
    lines += [
        f"From `python -m sim sim2real --requests {d['requests']}` (`{path.name}`). "
        f"Calibration: trace requests {lo}-{hi - 1}",
        f"replayed live on `actors.replica_controller.ReplicaController` ({d['calibration_steps']} iterations, each "
        "batch read from the engine's own",
        "scheduler step), fitted by `placement.fitted.SplitFittedCostModel`. Evaluation "
        f"(held out): the first {d['requests']}",
        "trace requests replayed live and in the simulator (lengths / 16, hash-id blocks of "
        f"32 tokens, arrival gaps x {d['arrival_scale']:g},",
        f"torch with {d['torch_threads']} thread: stable step times on this 2-core machine).",
        "",
        "| | measured median | predicted median | median rel. error | p90 rel. error |",
        "|---|---|---|---|---|",
        f"| TTFT | {1000 * d['measured_ttft_median_s']:.0f} ms | "
        f"{1000 * d['predicted_ttft_median_s']:.0f} ms | {100 * d['ttft_median_rel_err']:.1f}% | "
        f"{100 * d['ttft_p90_rel_err']:.0f}% |",
        f"| TPOT | {1000 * d['measured_tpot_median_s']:.1f} ms | "
        f"{1000 * d['predicted_tpot_median_s']:.1f} ms | {100 * d['tpot_median_rel_err']:.1f}% | "
        f"{100 * d['tpot_p90_rel_err']:.0f}% |",
        "",
        f"Fitted weights (s): {d['fit']}. Per-iteration median error on the held-out steps: "
        f"{100 * d['step_median_rel_err_heldout']:.0f}%.",
    ]
    ok = d["ttft_median_rel_err"] <= 0.15 and d["tpot_median_rel_err"] <= 0.15
    lines += [
        "",
        "Target (median error within 15% for both): "
        + ("**met**." if ok else "**not met** in this run."),
        "Run to run the live medians move by several points (CPU timing on a shared 2-core VM),",
        "and pure-decode steps (about 2 ms) are where the per-iteration fit is least accurate.",
        "",
    ]
    return lines


def _speed_section(path: Path, whole: RunResult | None) -> list[str]:
    lines = ["## Simulator speed", ""]
    if whole is not None:
        target = "met" if whole.wall_s < 30 else "not met"
        lines += [
            f"Whole conversation trace ({whole.summary.arrived:,} requests) on 8P + 8D with the "
            f"Conductor at 1x, run alone: **{whole.wall_s:.1f} s** wall on this 2-core machine,",
            f"{whole.events:,} events (target 30 s: {target}). Decode iterations run in place "
            "when nothing else",
            "is due before they end (no heap round trip), the Conductor's views are kept and "
            "refreshed only",
            "for instances that changed, and the scheduler/KV hot paths were tightened without "
            "changing behaviour.",
            "",
        ]
    if not path.exists():
        return lines + [f"No `{path}`: run `python bench/sim_scale.py` first.", ""]
    d = json.loads(path.read_text())
    rows = d["rows"]
    n = d["config"]["requests_per_16"]
    lines += [
        f"`python bench/sim_scale.py --requests {n}` (`{path.name}`): N / 16 interleaved "
        "copies of the first",
        f"{n} trace requests (disjoint hash ids), so load per instance, requests per instance "
        "and simulated",
        "duration are those of the 16-instance run; P/D + Conductor.",
        "",
        "| instances | requests | wall (s) | events | per request (ms) | vs 16 |",
        "|---|---|---|---|---|---|",
    ]
    base = rows[0]["per_request_ms"]
    for r in rows:
        lines.append(
            f"| {r['instances']:,} | {r['requests']:,} | {r['wall_s']:.1f} | {r['events']:,} | "
            f"{r['per_request_ms']:.2f} | {r['per_request_ms'] / base:.2f}x |"
        )
    lines += [
        "",
        "What still grows with the instance count is the Conductor's own work: Algorithm 1 "
        "scores every",
        "prefill instance and decode selection every decode instance, per request "
        "(O(instances) by design).",
        "",
    ]
    return lines


def write_report(
    path: Path,
    base: ClusterConfig,
    sched: list[RunResult],
    cap: list[RunResult],
    over: list[RunResult],
    notes: Sequence[str] = (),
    whole: RunResult | None = None,
) -> None:
    figdir = path.parent / "figures"
    _plots(figdir, sched, cap)
    rel = "figures"
    lines = [
        "# Simulator report: Mooncake conversation trace",
        "",
        "Generated by `python -m sim report` (see `python -m sim --help`). Every run drives the",
        "runtime's own `policies.scheduler.Scheduler`, `policies.routing` policies,",
        "`policies.conductor.Conductor`, `store.block_pool.BlockPool` and chained hashing;",
        "the GPU is replaced by the roofline cost model in `placement/cost_model.py`.",
        "",
        "## Setup",
        "",
        f"- Model `{base.model}` on 8 x `{base.gpu}` per instance, tensor parallel {base.tp}",
        "  (the paper: a dummy LLaMA-70B on 8 x A800-SXM4-80GB nodes, one instance per node).",
        "- 16 instances: 8 prefill + 8 decode for the P/D cluster, 16 colocated replicas for",
        "  the vLLM-like baseline (chunked prefill, token budget "
        f"{base.colocated_budget}, prefix caching on, round-robin routing).",
        f"- KV block {base.block_size} tokens (one trace hash id = one block); prefill",
        f"  instances cache {base.prefill_cache_tokens:,} tokens of prefix (the paper's 3M",
        "  tokens per node in section 5.3.2, HBM and DRAM as one tier); decode instances hold",
        "  what HBM leaves after the weights.",
        f"- KV transfer {base.nic_bandwidth / 1e9:.0f} GB/s per instance (the paper's measured",
        "  87 GB/s over 4 x 200 Gbps). SLOs: TTFT <= 30 s; TBT (mean of the longest 10% of",
        "  a request's token gaps) <= 100 / 200 / 300 ms.",
        "",
        "## Prefill scheduling (the paper's Figure 5)",
        "",
        f"Whole trace at {sched[0].spec.speed:g}x, no admission control.",
        "",
        "| prefill selection | TTFT mean (s) | p50 | p90 | p99 | TBT mean (ms) | cache hit "
        "| blocks copied | prefill busy (GPU-node h) | sim wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[_fmt_row(r) for r in sched],
        "",
        f"![TTFT CDF]({rel}/ttft_cdf.png)",
        "",
    ]
    local = next((r for r in sched if r.spec.cfg.policy == "local"), None)
    glob = next((r for r in sched if r.spec.cfg.policy == "conductor"), None)
    if local and glob and local.summary.ttft_mean > 0:
        gain = 1 - glob.summary.ttft_mean / local.summary.ttft_mean
        lines += [
            f"Global over local cache-aware: mean TTFT {100 * gain:.0f}% lower here; the paper",
            "reports 14% lower (section 4.2). The bar heights of its Figure 5 are not in the",
            "text we have, so only that ratio is compared.",
            "",
        ]
    lines += ["## Effective request capacity (the paper's Figure 1)", ""]
    limit = cap[0].spec.limit if cap else None
    lines += [
        f"First {limit or 'all'} requests of the trace, replayed at several speeds; capacity",
        "is the highest speed at which 90% of requests meet both SLOs (interpolated).",
        "",
        "| system | " + " | ".join(f"capacity @ TBT {int(1000 * s)} ms" for s in TBT_SLOS) + " |",
        "|---|" + "---|" * len(TBT_SLOS),
    ]
    for label in sorted({r.spec.label for r in cap}):
        curve = {r.spec.speed: r.summary for r in cap if r.spec.label == label}
        caps = [f"{capacity(curve, s, 0.9):.2f}x" for s in TBT_SLOS]
        lines.append(f"| {label} | " + " | ".join(caps) + " |")
    lines += [
        "",
        "| system | speed | "
        + " | ".join(f"attain @ {int(1000 * s)} ms" for s in TBT_SLOS)
        + " | TTFT p90 (s) | TBT p90 (ms) |",
        "|---|---|" + "---|" * (len(TBT_SLOS) + 2),
    ]
    for r in sorted(cap, key=lambda r: (r.spec.label, r.spec.speed)):
        s = r.summary
        att = " | ".join(f"{100 * s.attainment[t]:.1f}%" for t in TBT_SLOS)
        lines.append(
            f"| {r.spec.label} | {r.spec.speed:g}x | {att} | {s.ttft_p90:.1f} | "
            f"{1000 * s.tbt_p90:.0f} |"
        )
    lines += [
        "",
        f"![capacity]({rel}/capacity.png)",
        "",
        "## Overload: early rejection",
        "",
        f"Whole trace at {over[0].spec.speed:g}x, P/D with the Conductor, TBT SLO "
        f"{int(1000 * over[0].spec.cfg.tbt_slo)} ms.",
        "",
        "| admission | arrived | rejected (ours) | by reason | completed | attain @ TBT SLO "
        "| paper: rejected (23,000 requests) |",
        "|---|---|---|---|---|---|---|",
    ]
    paper = {"baseline": "4,183", "early": "3,771", "predictive": "3,589"}
    for r in over:
        s = r.summary
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.rejections.items())) or "-"
        lines.append(
            f"| {r.spec.label} | {s.arrived} | {s.rejected} | {reasons} | {s.completed} | "
            f"{100 * s.attainment[r.spec.cfg.tbt_slo]:.1f}% | {paper[r.spec.cfg.admission]} |"
        )
    lines += ["", *_overload_analysis(base, over)]
    lines += _sim2real_section(path.parent / "figures" / "sim2real.json")
    lines += _speed_section(path.parent / "figures" / "sim_scale.json", whole)
    lines += ["## Where we differ from the paper, and why", "", *notes, ""]
    path.write_text("\n".join(lines))
