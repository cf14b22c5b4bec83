"""SkyWalker's cost experiment (paper section 2.2 and 5.2): replicas provisioned for each
region's own peak against replicas provisioned for the global peak, at the same SLO
attainment (``python -m sim skywalker-cost``).

Workload: a trace split over three regions (us, eu, asia) by a diurnal curve whose peaks are
a third of a period apart (``sim.regional_workload``, one period spans the replayed slice):
each region's load swings by ``1 +- amplitude`` around its mean, their sum stays the trace's.

SLO attainment of a region: the share of the requests its clients sent whose first token
reached them within ``ttft_slo`` (a request not answered counts as a miss). A provisioning
meets the target when every region's attainment is at least ``target``.

- Region peak: region-local serving (each region's ``RegionBalancer`` with forwarding off,
  so regions are independent). Each region gets the fewest replicas at which its own clients
  meet the target, found by bisection on all three counts at once (one run per step).
- Global peak: SkyWalker (the same balancers, forwarding to peers), the fewest replicas in
  all, spread evenly over the regions (the reservation for the global peak, partitioned),
  at which every region meets the target.

Arrivals: the trace's requests (lengths, in order) at a steady Poisson rate, so the sum of
the regions' loads is flat as in the paper's Figure 3 (``poisson_rate=0``: the trace's own
timestamps, whose bursts every region shares). Replicas: llama3-8b on the cost model's
L40S, with the KV capacity of the paper's L4 (``kv_tokens``).

Both use the runtime's own ``policies.region_balancer`` objects in ``sim.regions``. The
ratio of the two totals is the cost saving; ``demand_ratio`` (the sum of each region's peak
arrival rate over the peak of their sum, over ``windows`` windows) is what an ideal pooling
would save on this trace.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from sim.metrics import RequestStats
from sim.skywalker_eval import REGIONS, RegionRun, build


@dataclass(frozen=True)
class CostSetup:
    trace: str = "azure-conv"  # short prompts: TTFT misses come from load, not prompt length
    trace_dir: str | None = None
    limit: int = 4000  # requests read from the trace
    speed: float = 16.0
    poisson_rate: float = 25.0  # steady aggregate arrivals, req/s (0: the trace's own times)
    # Each replica's KV capacity, tokens (0: the cost model's GPU's). The paper's replica is
    # one L4 (24 GB) with Llama-3.1-8B: ~5.6 GB left after 16 GB of weights and headroom, at
    # 128 KiB per token, holds ~45k tokens. (The L40S stand-in's 207k tokens let a replica
    # admit so much that nothing ever waits: selective pushing then never sees it busy.)
    kv_tokens: int = 45_000
    amplitude: float = 0.8
    ttft_slo: float = 2.0  # seconds, at the client
    target: float = 0.95  # SLO attainment every region must reach
    max_per_region: int = 16
    seed: int = 0
    windows: int = 12  # for demand_ratio


def _run(setup: CostSetup, system: str, counts: tuple[int, ...]) -> RegionRun:
    return RegionRun(
        system,
        setup.trace,
        setup.limit,
        setup.speed,
        0,
        setup.trace_dir,
        amplitude=setup.amplitude,
        seed=setup.seed,
        purpose="cost",
        replicas_by_region=counts,
        poisson_rate=setup.poisson_rate,
        kv_tokens=setup.kv_tokens,
    )


def attainment(stats: list[RequestStats], region_of: dict[str, str], slo: float) -> dict:
    """Region -> share of its clients' requests answered within ``slo``."""
    sent = dict.fromkeys(REGIONS, 0)
    met = dict.fromkeys(REGIONS, 0)
    for st in stats:
        g = region_of[st.request_id]
        sent[g] += 1
        met[g] += st.ttft is not None and st.rejected is None and st.ttft <= slo
    return {g: met[g] / sent[g] if sent[g] else 1.0 for g in REGIONS}


def simulate(setup: CostSetup, system: str, counts: tuple[int, ...]) -> dict:
    cluster, reqs = build(_run(setup, system, counts))
    stats = cluster.run(reqs)
    att = attainment(stats, dict(cluster.region_of), setup.ttft_slo)
    overall = sum(att[g] * sum(1 for r in cluster.region_of.values() if r == g) for g in REGIONS)
    return {
        "system": system,
        "replicas": list(counts),
        "total": sum(counts),
        "attainment": att,
        "attainment_all": overall / max(1, len(cluster.region_of)),
        "forwarded": cluster.forwarded,
    }


def demand_ratio(setup: CostSetup) -> float:
    """Sum over regions of each one's peak arrivals per window, over the peak of their sum."""
    cluster, reqs = build(_run(setup, "region-local", (1,) * len(REGIONS)))
    t0 = min(r.arrival for r in reqs)
    span = max(r.arrival for r in reqs) - t0 or 1.0
    counts = {g: [0] * setup.windows for g in REGIONS}
    for r in reqs:
        w = min(setup.windows - 1, int((r.arrival - t0) / span * setup.windows))
        counts[cluster.region_of[r.request_id]][w] += 1
    total = [sum(counts[g][w] for g in REGIONS) for w in range(setup.windows)]
    return sum(max(c) for c in counts.values()) / max(total)


def region_peak(setup: CostSetup) -> tuple[tuple[int, ...] | None, list[dict]]:
    """Region-local: each region's fewest replicas meeting the target (None if
    ``max_per_region`` does not), by one bisection per region run side by side."""
    n = len(REGIONS)
    rows = [simulate(setup, "region-local", (setup.max_per_region,) * n)]
    if min(rows[0]["attainment"].values()) < setup.target:
        return None, rows
    lo, hi = [1] * n, [setup.max_per_region] * n
    while lo != hi:
        mid = tuple((a + b) // 2 if a < b else b for a, b in zip(lo, hi, strict=True))
        row = simulate(setup, "region-local", mid)
        rows.append(row)
        for k, g in enumerate(REGIONS):
            if lo[k] == hi[k]:
                continue
            if row["attainment"][g] >= setup.target:
                hi[k] = mid[k]
            else:
                lo[k] = mid[k] + 1
    final = tuple(hi)
    if all(tuple(r["replicas"]) != final for r in rows):
        rows.append(simulate(setup, "region-local", final))
    return final, rows


def even(total: int) -> tuple[int, ...]:
    q, r = divmod(total, len(REGIONS))
    return tuple(q + (1 if i < r else 0) for i in range(len(REGIONS)))


def global_peak(setup: CostSetup, hi: int) -> tuple[int | None, list[dict]]:
    """SkyWalker: the fewest replicas in all (spread evenly) at which every region meets the
    target, by bisection in ``[len(REGIONS), hi]``."""
    rows: dict[int, dict] = {}

    def meets(n: int) -> bool:
        if n not in rows:
            rows[n] = simulate(setup, "SkyWalker", even(n))
        return min(rows[n]["attainment"].values()) >= setup.target

    lo = len(REGIONS)
    if not meets(hi):
        return None, list(rows.values())
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi, [rows[n] for n in sorted(rows)]


def experiment(setup: CostSetup) -> dict:
    local, local_rows = region_peak(setup)
    hi = sum(local) if local else setup.max_per_region * len(REGIONS)
    glob, global_rows = global_peak(setup, hi)
    ratio = sum(local) / glob if local and glob else None
    return {
        "setup": asdict(setup) | {"trace_dir": None},
        "demand_ratio": demand_ratio(setup),
        "region_peak": list(local) if local else None,
        "global_peak": glob,
        "ratio": ratio,
        "runs": local_rows + global_rows,
    }


def format_result(res: dict) -> list[str]:
    s = res["setup"]
    rate = s["poisson_rate"]
    pace = f"Poisson {rate:g} req/s" if rate > 0 else f"{s['speed']:g}x its own times"
    kv = f", {s['kv_tokens']} KV tokens per replica" if s["kv_tokens"] else ""
    lines = [
        f"trace {s['trace']} ({s['limit']} requests, {pace}), three regions, diurnal"
        f" amplitude {s['amplitude']:g}; SLO: TTFT <= {s['ttft_slo']:g} s for at least"
        f" {s['target']:.0%} of each region's requests{kv}",
        f"demand: sum of region peaks / global peak = {res['demand_ratio']:.2f}",
        "system        replicas (us eu asia)  total  attainment us/eu/asia  all    forwarded",
    ]
    for r in res["runs"]:
        att = "/".join(f"{r['attainment'][g]:.2f}" for g in REGIONS)
        lines.append(
            f"{r['system']:13s} {' '.join(f'{x:3d}' for x in r['replicas']):22s} "
            f"{r['total']:5d}  {att:21s}  {r['attainment_all']:.3f}  {r['forwarded']}"
        )
    lines.append(f"region peak: {res['region_peak']}  global peak: {res['global_peak']}")
    ratio = res["ratio"]
    lines.append(
        "skywalker replicas region-peak/global: "
        + (f"{ratio:.2f}" if ratio is not None else "n/a (no provisioning met the target)")
    )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    for f in fields(CostSetup):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(f.type), str)
        p.add_argument(flag, type=kind, default=f.default)
    p.add_argument("--out", default="docs/figures/skywalker_cost.json", help="'' to not write")


def run_from_args(a: argparse.Namespace) -> None:
    setup = CostSetup(**{f.name: getattr(a, f.name) for f in fields(CostSetup)})
    res = experiment(setup)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(format_result(res)))
