"""Command line of the simulator.

  python -m sim run      one configuration over a trace; prints the summary
  python -m sim report   the Mooncake experiments -> docs/sim_report.md + docs/figures/
  python -m sim sim2real replay each trace's first requests on the live CPU engine with the
                         tiny model, fit the runtime predictor from a grid of timed steps,
                         compare predicted and measured TTFT / TPOT (--trace all: every trace)
  python -m sim regions  three regions: SkyWalker vs one global balancer vs region-local
                         -> docs/figures/skywalker.json and its section of the report
  python -m sim skywalker-cost  replicas for each region's peak vs for the global peak
  python -m sim medha    Medha's scheduler ablation (FCFS, EDF, LRS, ILRS + prefill-prefill
                         batching) on short requests mixed with 128K-1M-token ones
  python -m sim dualpath DualPath's agentic trajectories -> docs/sim_dualpath.md
  python -m sim agents   agent trajectories from the conversation trace on the DualPath
                         simulator, next to bench/agents.py's live figures (--live FILE)
  python -m sim moe      MegaScale-Infer's disaggregated vs colocated MoE decoding and the
                         micro-batch ablation (performance model) -> its report section
  python -m sim plan     a deployment plan (placement's search) for a model and GPUs,
                         replayed on a trace, optionally written as a Serve config YAML

Traces are found in ../shared/data/traces from the repository root; --trace-dir overrides.
Examples:
  python -m sim run --trace conversation --mode pd --policy conductor --admission early
  python -m sim run --mode colocated --policy prefix_aware --instances 16 --speed 2
  python -m sim report --jobs 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from sim.plan_cli import add_plan_args, plan_command
from sim.presets import COLOCATED_POLICIES, PD_POLICIES, ClusterConfig, build_cluster


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    p.add_argument(
        "--trace",
        default="conversation",
        help="conversation | synthetic | azure-code | azure-conv | a file path",
    )
    p.add_argument("--trace-dir", default=None, help="folder holding the trace files")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed (2 = twice as fast)")
    p.add_argument("--mode", default=d.mode, choices=["pd", "colocated"])
    p.add_argument(
        "--policy", default=d.policy, help=f"pd: {PD_POLICIES}; colocated: {COLOCATED_POLICIES}"
    )
    p.add_argument("--instances", type=int, default=d.instances)
    p.add_argument("--prefill", type=int, default=None, help="pd: prefill instances (default half)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--gpu", default=d.gpu)
    p.add_argument("--tp", type=int, default=d.tp)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo)
    p.add_argument("--tbt-slo", type=float, default=d.tbt_slo)
    p.add_argument(
        "--admission", default=d.admission, choices=["none", "early", "predictive", "baseline"]
    )
    p.add_argument(
        "--budget", type=int, default=d.colocated_budget, help="colocated/decode token budget"
    )
    p.add_argument("--seed", type=int, default=d.seed)


def _config(a: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        mode=a.mode, policy=a.policy, instances=a.instances, prefill=a.prefill, model=a.model,
        gpu=a.gpu, tp=a.tp, block_size=a.block_size, ttft_slo=a.ttft_slo, tbt_slo=a.tbt_slo,
        admission=a.admission, colocated_budget=a.budget, seed=a.seed,
    )  # fmt: skip


def cmd_run(a: argparse.Namespace) -> None:
    from sim.metrics import summarize
    from sim.traces import load_trace

    reqs = load_trace(a.trace, a.trace_dir, limit=a.limit, speed=a.speed)
    cluster = build_cluster(_config(a))
    t0 = time.perf_counter()
    stats = cluster.run(reqs)
    wall = time.perf_counter() - t0
    s = summarize(stats, a.ttft_slo, sorted({0.1, 0.2, 0.3, a.tbt_slo}))
    out = s.row() | {"attainment": {str(k): v for k, v in s.attainment.items()}}
    out |= {"wall_s": wall, "events": cluster.loop.fired}
    print(json.dumps(out, indent=1))


def cmd_report(a: argparse.Namespace) -> None:
    from sim.experiments import capacity_runs, overload_runs, prefill_scheduling, run_all
    from sim.report import write_report

    base = replace(_config(a), instances=16)
    speeds = [float(x) for x in a.speeds.split(",")]
    sched = prefill_scheduling(base, 1.0, a.limit)
    cap = capacity_runs(base, speeds, a.capacity_limit)
    over_slos = tuple(float(x) for x in a.overload_tbt_slos.split(","))
    over = overload_runs(base, a.overload_speed, a.limit, over_slos)
    for spec in sched + cap + over:
        spec.trace, spec.trace_dir = a.trace, a.trace_dir
    results = run_all(sched + cap + over, a.jobs)
    r_sched = results[: len(sched)]
    r_cap = results[len(sched) : len(sched) + len(cap)]
    r_over = results[len(sched) + len(cap) :]
    notes = Path(a.notes).read_text().splitlines() if a.notes and Path(a.notes).exists() else []
    # The speed section's whole-trace time, measured alone (not beside another job).
    from sim.experiments import RunSpec, execute

    whole_spec = RunSpec("P/D + Conductor", replace(base, mode="pd", policy="conductor"), 1.0)
    whole_spec.trace, whole_spec.trace_dir = a.trace, a.trace_dir
    whole = execute(whole_spec) if a.limit is None else None
    medha: list[str] = []
    if a.medha_requests:  # Medha's scheduling and 3D-vs-2D runs (sim/report_medha.py)
        from sim.report_medha import medha_section, run_medha

        medha = medha_section(run_medha(a.medha_requests))
    write_report(Path(a.out), base, r_sched, r_cap, r_over, notes, whole, medha)
    for r in results:
        print(
            f"{r.spec.label:45s} {r.spec.speed:4g}x  wall {r.wall_s:6.1f}s  "
            f"rejected {r.summary.rejected}"
        )
    print(f"wrote {a.out}")


def cmd_sim2real(a: argparse.Namespace) -> None:
    from sim.sim_to_real import run_sim_to_real
    from sim.traces import TRACES

    traces = list(TRACES) if a.trace == "all" else a.trace.split(",")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_sim_to_real(
        traces, a.trace_dir, a.requests, repeats=a.repeats, clock=a.clock, log=log, passes=a.passes
    )
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:  # the report reads it from here
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
        if a.report:
            from sim.report_sim2real import replace_section, sim2real_section

            replace_section(Path(a.report), sim2real_section(Path(a.out)))


def cmd_regions(a: argparse.Namespace) -> None:
    from sim.report_skywalker import replace_section, skywalker_section
    from sim.skywalker_eval import plan, run_all, run_searches, search_bases, write_results

    clients = tuple(int(x) for x in a.clients.split(",") if x)
    runs = plan(
        a.trace_dir, a.limit, a.speed, a.replicas, a.azure_limit, a.azure_speed, clients, a.duration
    )
    search_clients = tuple(int(x) for x in a.search_clients.split(",") if x)
    bases = search_bases(a.trace_dir, a.limit, a.search_speed, search_clients, a.duration)
    rows = run_all(runs, a.jobs)
    rows += run_searches(bases, a.ttft_slo, 3, a.search_max, a.jobs)
    for r in rows:
        print(
            f"{r['trace']:12s} {r['speed']:4g}x c{r['clients']} {r['system']:28s} "
            f"x{r['replicas_total'] or 3 * r['replicas_per_region']} "
            f"p50 {r['ttft_p50']:6.2f} p90 {r['ttft_p90']:6.2f} hit {r['hit_ratio']:.3f} "
            f"rps {r['throughput_rps']:.3f} fwd {r['forwarded']} wall {r['wall_s']:.0f}s"
        )
    out = Path(a.out)
    write_results(out, rows, a.ttft_slo)
    if a.report:
        replace_section(Path(a.report), skywalker_section(out))
    print(f"wrote {out}")


def cmd_skywalker_cost(a: argparse.Namespace) -> None:
    from sim.skywalker_cost import run_from_args

    run_from_args(a)


def cmd_medha(a: argparse.Namespace) -> None:
    from sim.medha import CONFIGS, MedhaWorkload, format_table, run_config, workload

    w = MedhaWorkload(a.qps, a.requests, a.long_fraction, seed=a.seed)
    reqs = workload(w)
    results = [run_config(name, reqs, a.chunk, a.target, a.min_slo) for name in CONFIGS]
    print(format_table(w, results))


def cmd_dualpath(a: argparse.Namespace) -> None:
    from sim.report_dualpath import dualpath_section

    text = "\n".join(["# DualPath, simulated", "", *dualpath_section(a.trajectories, a.seed)])
    print(text)
    if a.out:
        Path(a.out).write_text(text)


def cmd_agents(a: argparse.Namespace) -> None:
    from sim.report_agents import agents_section, load_live
    from sim.traces import load_trace

    live = load_live(a.live) if a.live else None
    trace = load_trace("conversation", a.trace_dir)
    pd = (a.prefill, a.decode)
    print("\n".join(agents_section(trace, a.trajectories, a.seed, pd, a.ttft_slo, live)))


def cmd_moe(a: argparse.Namespace) -> None:
    from sim.report_moe import moe_section, replace_section

    section = moe_section()
    print("\n".join(section))
    if a.report:
        replace_section(Path(a.report), section)
        print(f"updated {a.report}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="simulate one configuration")
    _add_cluster_args(p_run)
    p_run.set_defaults(fn=cmd_run)
    p_rep = sub.add_parser("report", help="write docs/sim_report.md and figures")
    _add_cluster_args(p_rep)
    p_rep.add_argument("--speeds", default="0.5,1,1.5,2,3,4", help="capacity sweep speeds")
    p_rep.add_argument("--capacity-limit", type=int, default=4000, help="requests per capacity run")
    p_rep.add_argument("--overload-speed", type=float, default=2.0)
    p_rep.add_argument(
        "--overload-tbt-slos",
        default="0.1,0.02,0.018",
        help="TBT SLOs (s) of the overload runs: the paper's, and one that loads our decode pool",
    )
    p_rep.add_argument("--jobs", type=int, default=2, help="parallel processes")
    p_rep.add_argument(
        "--medha-requests", type=int, default=200, help="requests per Medha run (0: skip)"
    )
    p_rep.add_argument("--out", default="docs/sim_report.md")
    p_rep.add_argument(
        "--notes",
        default="docs/figures/.report_notes.md",
        help="a file of markdown lines for the last section",
    )
    p_rep.set_defaults(fn=cmd_report)
    p_s2r = sub.add_parser("sim2real", help="live CPU engine vs. the simulator")
    p_s2r.add_argument(
        "--trace", default="all", help="all (every trace), or names / files, comma-separated"
    )
    p_s2r.add_argument("--trace-dir", default=None)
    p_s2r.add_argument("--requests", type=int, default=40, help="first N requests of each")
    p_s2r.add_argument("--seed", type=int, default=0, help="unused: the replay is deterministic")
    p_s2r.add_argument("--repeats", type=int, default=3, help="fresh engines per trace")
    p_s2r.add_argument("--passes", type=int, default=5, help="replays per engine (medians)")
    p_s2r.add_argument(
        "--clock", default="cpu", choices=["cpu", "wall"], help="the live replay's timeline"
    )
    p_s2r.add_argument("--out", default="docs/figures/sim2real.json", help="'' to not write")
    p_s2r.add_argument("--report", default="docs/sim_report.md", help="'' to not update it")
    p_s2r.set_defaults(fn=cmd_sim2real)
    p_reg = sub.add_parser("regions", help="multi-region SkyWalker comparison")
    p_reg.add_argument("--trace-dir", default=None)
    p_reg.add_argument("--limit", type=int, default=1000, help="Mooncake requests per run")
    p_reg.add_argument("--speed", type=float, default=0.5)
    p_reg.add_argument("--replicas", type=int, default=4, help="replicas per region")
    p_reg.add_argument("--azure-limit", type=int, default=3000)
    p_reg.add_argument("--azure-speed", type=float, default=8.0)
    p_reg.add_argument(
        "--clients", default="24,36", help="closed loop: mean clients per region, each a run"
    )
    p_reg.add_argument("--duration", type=float, default=300.0, help="closed loop: seconds")
    p_reg.add_argument(
        "--search-clients", default="24,36", help="closed-loop search loads (clients per region)"
    )
    p_reg.add_argument(
        "--search-speed", type=float, default=0.75, help="open-loop search speed (0: none)"
    )
    p_reg.add_argument("--search-max", type=int, default=36, help="most replicas searched")
    p_reg.add_argument("--ttft-slo", type=float, default=5.0, help="P90 TTFT SLO of the search")
    p_reg.add_argument("--jobs", type=int, default=2)
    p_reg.add_argument("--out", default="docs/figures/skywalker.json")
    p_reg.add_argument("--report", default="docs/sim_report.md", help="'' to not update it")
    p_reg.set_defaults(fn=cmd_regions)
    p_cost = sub.add_parser(
        "skywalker-cost", help="replicas for each region's peak vs the global peak, same SLO"
    )
    from sim.skywalker_cost import add_arguments

    add_arguments(p_cost)
    p_cost.set_defaults(fn=cmd_skywalker_cost)
    p_med = sub.add_parser("medha", help="Medha's scheduler ablation on long contexts")
    p_med.add_argument("--qps", type=float, default=1.5)
    p_med.add_argument("--requests", type=int, default=200)
    p_med.add_argument("--long-fraction", type=float, default=0.05)
    p_med.add_argument("--chunk", type=int, default=2048, help="fixed chunk (and budget)")
    p_med.add_argument("--target", type=float, default=0.1, help="ilrs+ppb step time (s)")
    p_med.add_argument("--min-slo", type=float, default=0.0, help="least TTFT SLO (s)")
    p_med.add_argument("--seed", type=int, default=0)
    p_med.set_defaults(fn=cmd_medha)
    p_dp = sub.add_parser("dualpath", help="DualPath's agentic trajectories, simulated")
    p_dp.add_argument("--trajectories", type=int, default=64)
    p_dp.add_argument("--seed", type=int, default=0)
    p_dp.add_argument("--out", default="docs/sim_dualpath.md", help="'' to not write")
    p_dp.set_defaults(fn=cmd_dualpath)
    p_ag = sub.add_parser("agents", help="agent trajectories from the trace, simulated")
    p_ag.add_argument("--trajectories", type=int, default=512)
    p_ag.add_argument("--prefill", type=int, default=8, help="prefill engines")
    p_ag.add_argument("--decode", type=int, default=16, help="decode engines")
    p_ag.add_argument("--ttft-slo", type=float, default=4.0, help="seconds, for goodput")
    p_ag.add_argument("--seed", type=int, default=0)
    p_ag.add_argument("--trace-dir", default=None, help="folder holding the trace files")
    p_ag.add_argument("--live", default=None, help="bench/agents.py --json output")
    p_ag.set_defaults(fn=cmd_agents)
    p_moe = sub.add_parser("moe", help="MegaScale-Infer's MoE section of the report")
    p_moe.add_argument("--report", default="docs/sim_report.md", help="'' to not update it")
    p_moe.set_defaults(fn=cmd_moe)
    p_plan = sub.add_parser(
        "plan", help="deployment plan: MoE attention/expert split, or a dense group's layout"
    )
    add_plan_args(p_plan)
    p_plan.set_defaults(fn=plan_command)
    a = parser.parse_args(argv)
    status: int | None = a.fn(a)
    return status or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
