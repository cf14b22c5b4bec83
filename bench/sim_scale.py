"""How simulator wall time grows with cluster size, at a fixed load per instance.

For N instances (half prefill, half decode, the Conductor) the workload is N / 16 copies of
the first ``--requests`` requests of the Mooncake conversation trace, interleaved: copy k
keeps the trace's arrival times shifted by ``k / copies`` of the mean gap between arrivals,
gets its own request ids, and its own hash ids (disjoint from every other copy's, so copies
share no prefixes with each other, only within themselves). Every size therefore sees the
16-instance run's load per instance, request mix and simulated duration, and the same
number of requests per instance. Prints one line per size, then the growth table (wall time
per simulated request, relative to the smallest size).

  python bench/sim_scale.py --requests 300 --sizes 16,128,1024
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from sim.presets import ClusterConfig, build_cluster
from sim.traces import load_trace
from sim.workload import TraceRequest


def tiled(reqs: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """``copies`` interleaved copies of ``reqs`` (see the module docstring)."""
    if copies <= 1:
        return list(reqs)
    span = max((r.arrival for r in reqs), default=0.0)
    gap = span / max(1, len(reqs) - 1)
    stride = 1 + max((max(r.hash_ids or (0,)) for r in reqs), default=0)
    out = []
    for k in range(copies):
        shift = gap * k / copies
        for r in reqs:
            ids = None if r.hash_ids is None else tuple(h + k * stride for h in r.hash_ids)
            out.append(
                replace(
                    r,
                    request_id=f"{r.request_id}#{k}",
                    arrival=r.arrival + shift,
                    hash_ids=ids,
                    session_id=None if r.session_id is None else f"{r.session_id}#{k}",
                )
            )
    out.sort(key=lambda r: r.arrival)
    return out


def run_size(n: int, requests: int, mode: str, policy: str, trace_dir: str | None) -> dict:
    base = load_trace("conversation", trace_dir, limit=requests)
    reqs = tiled(base, max(1, n // 16))
    cluster = build_cluster(ClusterConfig(mode=mode, policy=policy, instances=n))
    t0 = time.perf_counter()
    stats = cluster.run(reqs)
    wall = time.perf_counter() - t0
    done = sum(1 for s in stats if s.rejected is None)
    return {
        "instances": n,
        "requests": len(reqs),
        "completed": done,
        "wall_s": wall,
        "events": cluster.loop.fired,
        "per_request_ms": 1e3 * wall / len(reqs),
    }


def growth_table(rows: list[dict]) -> list[str]:
    """Markdown table of the rows; per-request cost relative to the first row."""
    out = [
        "| instances | requests | wall (s) | events | per request (ms) | vs smallest |",
        "|---|---|---|---|---|---|",
    ]
    base = rows[0]["per_request_ms"] if rows else 1.0
    for r in rows:
        out.append(
            f"| {r['instances']:,} | {r['requests']:,} | {r['wall_s']:.1f} | {r['events']:,} | "
            f"{r['per_request_ms']:.2f} | {r['per_request_ms'] / base:.2f}x |"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=300, help="trace requests per 16 instances")
    p.add_argument("--sizes", default="16,128,1024")
    p.add_argument("--mode", default="pd")
    p.add_argument("--policy", default="conductor")
    p.add_argument("--trace-dir", default=None)
    p.add_argument(
        "--out", default="docs/figures/sim_scale.json", help="rows as JSON for the report"
    )
    a = p.parse_args()
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        r = run_size(n, a.requests, a.mode, a.policy, a.trace_dir)
        rows.append(r)
        print(
            f"instances {n:5d}  requests {r['requests']:6d}  wall {r['wall_s']:7.1f} s  "
            f"events {r['events']:9d}  per request {r['per_request_ms']:6.2f} ms",
            flush=True,
        )
    print()
    print("\n".join(growth_table(rows)))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"requests_per_16": a.requests, "mode": a.mode, "policy": a.policy}
        Path(a.out).write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
