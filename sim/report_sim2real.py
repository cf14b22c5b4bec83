"""The sim-to-real section of ``docs/sim_report.md``, from ``python -m sim sim2real``'s JSON
(``sim.sim_to_real.run_sim_to_real``: per trace, a spread over repeats and one record per
repeat)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET = 0.15


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _spread(d: dict[str, float]) -> str:
    return f"{_pct(d['median'])} ({_pct(d['min'])} to {_pct(d['max'])})"


def _median_of(runs: list[dict[str, Any]], key: str) -> float:
    xs = sorted(r[key] for r in runs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _trace_row(name: str, t: dict[str, Any]) -> str:
    runs = t["runs"]
    ok = max(t["ttft_median_rel_err"]["median"], t["tpot_median_rel_err"]["median"]) <= TARGET
    return (
        f"| {name} | {t['requests']} | {1000 * _median_of(runs, 'measured_ttft_median_s'):.1f} / "
        f"{1000 * _median_of(runs, 'predicted_ttft_median_s'):.1f} ms "
        f"| {_spread(t['ttft_median_rel_err'])} "
        f"| {1000 * _median_of(runs, 'measured_tpot_median_s'):.2f} / "
        f"{1000 * _median_of(runs, 'predicted_tpot_median_s'):.2f} ms "
        f"| {_spread(t['tpot_median_rel_err'])} "
        f"| {_pct(t['step_median_rel_err_heldout']['median'])} "
        f"| {_pct(t['split_ttft_median_rel_err']['median'])} / "
        f"{_pct(t['split_tpot_median_rel_err']['median'])} | {'yes' if ok else '**no**'} |"
    )


def sim2real_section(path: Path) -> list[str]:
    lines = ["## Sim-to-real (live CPU engine, tiny model)", ""]
    if not path.exists():
        return lines + [f"No `{path}`: run `python -m sim sim2real` first.", ""]
    d = json.loads(path.read_text())
    if d.get("format") != 2:
        return lines + [f"`{path.name}` is from an older format: rerun `python -m sim sim2real`."]
    traces: dict[str, Any] = d["traces"]
    first = next(iter(traces.values()))["runs"][0]
    lines += [
        f"From `python -m sim sim2real --requests {d['requests']} --repeats {d['repeats']} "
        f"--passes {d['passes']}` (`{path.name}`): every trace, the first {d['requests']} "
        "requests each, lengths / 16",
        f"(hash-id blocks of 32 tokens), arrival gaps x {d['arrival_scale']:g}. Each repeat of "
        "each trace runs on a fresh",
        "`actors.engine.replica_controller.ReplicaController` (the tiny model, torch with "
        f"{d['torch_threads']} thread):",
        "",
        "1. **Warm-up** (untimed): every step shape once (each token count 1..256, each decode",
        "   batch 1..32), so oneDNN's kernel for every row count exists before timing. The",
        "   packed linears now keep 8192 kernels (`kernels/cpu_linear.py`); with oneDNN's",
        "   default 1024 a 256-token budget cycled more shapes than it holds, so a step of a",
        "   row count not seen lately rebuilt its kernels (1-2 ms), live and in calibration.",
        "2. **Calibration, on no trace**: a timed pass of that sweep and of a grid of step shapes",
        "   (`sim/step_grid.py`: prefill chunks of 1-256 tokens at cached offsets 128-768,",
        "   decode batches of 1-32 at contexts 16-640, chunks riding with 1-32 decodes) right",
        "   before the replay, and the grid again right after it "
        f"({first['calibration_steps']} steps): the shared",
        "   machine's speed drifts over minutes, so the fit brackets the replay. The replica's",
        "   own runtime predictor is fitted from them by the fitter it refits with online",
        "   (`policies.pd_costs.fit_prefill_time`: base + new tokens + context + attention",
        "   pairs + requests, non-negative least squares on *relative* residuals, worst 10% of",
        "   steps trimmed). Fitted on absolute seconds (as before), the few 5-8 ms chunks",
        "   outweighed the many 1 ms decodes: on the same measurements TPOT errors reached",
        "   76-87% on a light trace (nearly all one-decode steps), against at most 20% fitted",
        "   on relative residuals.",
        f"3. **Evaluation**: the trace replayed live {d['passes']} times on the same engine "
        "(per request, the",
        "   median over passes: a light trace's replay lasts a fraction of a second, so one "
        "burst of",
        "   load would decide it) and once in the simulator (one colocated instance timed by the",
        "   fitted predictor). No step of any trace is in the fit.",
        "",
    ]
    if d.get("clock", "cpu") == "cpu":
        lines += [
            "**Clock.** The replay's timeline advances by the engine thread's CPU time while it "
            "works and jumps",
            "to the next arrival while it idles; tokens are stamped at the end of the iteration "
            "that produced",
            "them. Every step is computed for real; what is left out is time stolen by the "
            "other processes",
            "sharing this machine's 2 cores (`--clock wall` replays in wall time).",
            "",
        ]
    lines += [
        "Per trace, the median over repeats (min to max) of the per-request median relative "
        "error, and the",
        "medians themselves (measured / predicted, median over repeats):",
        "",
        "| trace | requests | TTFT measured / predicted | TTFT median err "
        "| TPOT measured / predicted | TPOT median err | step median err "
        "| split model: TTFT / TPOT err | within 15% |",
        "|---|---|---|---|---|---|---|---|---|",
        *[_trace_row(name, t) for name, t in traces.items()],
        "",
        f"Fitted step model of the first repeat of the first trace: {first['fit']}.",
        "",
    ]
    met = [
        name
        for name, t in traces.items()
        if max(t["ttft_median_rel_err"]["median"], t["tpot_median_rel_err"]["median"]) <= TARGET
    ]
    each = sum(
        1
        for t in traces.values()
        for r in t["runs"]
        if max(r["ttft_median_rel_err"], r["tpot_median_rel_err"]) <= TARGET
    )
    total = sum(len(t["runs"]) for t in traces.values())
    lines += [
        f"Target (median TTFT and TPOT error within 15%, every trace): "
        f"**{'met' if len(met) == len(traces) else 'not met'}** "
        f"({len(met)} of {len(traces)} traces by the median over repeats; {each} of {total} "
        "single repeats).",
        "The step median error is per iteration of the trace (held out): single steps are "
        "noisier than",
        "per-request times, which average many steps; a repeat measured while a co-tenant "
        "loads the other",
        "hyperthread runs slower than its calibration, which no model of the engine predicts.",
        "",
    ]
    return lines


def replace_section(report: Path, section: list[str]) -> None:
    """Put ``section`` into ``report`` in place of the old sim-to-real section (up to the
    next ``## `` heading), else at the end."""
    text = report.read_text().splitlines() if report.exists() else []
    head = next((k for k, t in enumerate(text) if t.startswith(section[0])), None)
    if head is None:
        text += section
    else:
        end = next((k for k in range(head + 1, len(text)) if text[k].startswith("## ")), len(text))
        text[head:end] = section
    report.write_text("\n".join(text) + "\n")
