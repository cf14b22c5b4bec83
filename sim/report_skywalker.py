"""The multi-region section of ``docs/sim_report.md``: SkyWalker against one global balancer
and against region-local serving, from ``docs/figures/skywalker.json`` (``python -m sim
regions`` writes it; ``sim.skywalker_eval`` says what each run is).

Paper figures (SkyWalker, ``shared/papers/skywalker.txt``): 1.12-2.06x higher throughput and
1.74-6.30x lower latency than existing balancers (section 5.1: P50/mean TTFT at 15.87-57.63%
of the baselines', P90 at 10.08-23.38%), and the same throughput as region-local serving
with 9 replicas instead of 12 (25% fewer, section 5.2).
"""

from __future__ import annotations

import json
from pathlib import Path

HEADER = "## Multi-region balancing (SkyWalker)"
TRACE_NAMES = {"conversation": "Mooncake conversation", "azure-conv": "Azure conversation"}


def _table(rows: list[dict]) -> list[str]:
    sky = next((r for r in rows if r["system"] == "SkyWalker"), None)
    lines = [
        "| system | throughput (req/s) | output (tok/s) | TTFT P50 (s) | TTFT P90 (s) | hit ratio "
        "| forwarded | vs SkyWalker: throughput | P50 | P90 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if sky is not None and r is not sky:
            vs = (
                f"{sky['throughput_rps'] / r['throughput_rps']:.2f}x | "
                f"{r['ttft_p50'] / sky['ttft_p50']:.2f}x | {r['ttft_p90'] / sky['ttft_p90']:.2f}x"
            )
        else:
            vs = "- | - | -"
        lines.append(
            f"| {r['system']} | {r['throughput_rps']:.3f} | {r['output_tok_s']:.0f} | "
            f"{r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {100 * r['hit_ratio']:.1f}% | "
            f"{r['forwarded']} | {vs} |"
        )
    return lines


def _sweep(rows: list[dict], slo: float, speed: float) -> list[str]:
    conv = [r for r in rows if r["trace"] == "conversation" and r["speed"] == speed]
    counts = sorted({r["replicas_per_region"] for r in conv})
    systems = [
        s
        for s in ("SkyWalker", "region-local", "global least load")
        if sum(1 for r in conv if r["system"] == s) > 1
    ]
    if not systems:
        return []
    lines = [
        f"Replicas needed for P90 TTFT <= {slo:g} s (Mooncake conversation slice at "
        f"{speed:g}x, the same load at every size):",
        "",
        "| system | " + " | ".join(f"{3 * n} replicas: P90 (s)" for n in counts) + " | fewest |",
        "|---|" + "---|" * (len(counts) + 1),
    ]
    fewest: dict[str, int | None] = {}
    for s in systems:
        by_n = {r["replicas_per_region"]: r for r in conv if r["system"] == s}
        cells = [f"{by_n[n]['ttft_p90']:.2f}" if n in by_n else "-" for n in counts]
        ok = [3 * n for n in counts if n in by_n and by_n[n]["ttft_p90"] <= slo]
        fewest[s] = min(ok) if ok else None
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {fewest[s] or 'none'} |")
    lines.append("")
    sky, local = fewest.get("SkyWalker"), fewest.get("region-local")
    if sky and local:
        lines += [
            f"SkyWalker meets the SLO with {sky} replicas, region-local with {local}: "
            f"{100 * (1 - sky / local):.0f}% fewer (the paper: 9 instead of 12, 25% fewer).",
            "",
        ]
    return lines


def _exact_note(rows: list[dict]) -> list[str]:
    """The trie against the exact block-event view as the local-region view."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        by = {r["system"]: r for r in rows if r["trace"] == trace}
        trie, exact = by.get("SkyWalker"), by.get("SkyWalker, exact local index")
        if trie and exact:
            out.append(
                f"- {TRACE_NAMES.get(trace, trace)}: hit ratio {100 * trie['hit_ratio']:.1f}% "
                f"with the trie, {100 * exact['hit_ratio']:.1f}% with the exact index; TTFT P90 "
                f"{trie['ttft_p90']:.2f} s vs {exact['ttft_p90']:.2f} s."
            )
    if not out:
        return []
    return [
        "Local view: the trie of what this balancer sent, or the exact index of what each "
        "replica holds",
        "(`SkyWalker, exact local index`: the replicas' own cached sets, what the router's "
        "`PrefixIndex` keeps",
        "from their stored/evicted block events):",
        "",
        *out,
        "",
        "Where the exact index should serve better as the local view: inside a region the "
        "balancer sits next",
        "to its replicas, so their event streams are cheap, and the index knows what a "
        "replica evicted (the",
        "trie keeps pointing at a replica after its cache dropped the prefix, until its own "
        "size bound evicts",
        "the entry) and what reached a replica through another balancer (requests forwarded "
        "in, a stand-in",
        "balancer during failover), which the trie never sees. The trie is what works across "
        "regions: a",
        "snapshot of what was forwarded to each peer needs no event stream over the WAN. In "
        "these runs the two",
        "local views end within about a point of hit ratio (the trie slightly ahead on "
        "Mooncake), so this",
        "simulation does not show the difference: the cases where the exact index wins "
        "(eviction under cache",
        "pressure, requests forwarded in) are a small share of this slice.",
        "",
    ]


def skywalker_section(path: Path) -> list[str]:
    lines = [HEADER, ""]
    if not path.exists():
        return lines + [f"No `{path.name}`: run `python -m sim regions` first.", ""]
    d = json.loads(path.read_text())
    rows = d["rows"]
    first = rows[0]
    lines += [
        "`python -m sim regions` (`sim/skywalker_eval.py`, results in "
        f"`figures/{path.name}`): three regions",
        "(us, eu, asia; one-way delays us-eu 40 ms, us-asia 80 ms, eu-asia 100 ms), "
        f"{first['model']} on one {first['gpu']}",
        "per replica (the cost model has no L4, the paper's GPU), a trace split into regions by "
        "a diurnal curve",
        f"(amplitude {first['amplitude']:g}, each region's peak a third of a period after the "
        "previous one; one period",
        "spans the slice; a conversation stays in its region). SkyWalker systems run "
        "`policies.region_balancer`",
        "(selective pushing by pending requests, probes every "
        f"{1000 * first['probe_interval']:.0f} ms, prefix trie, forwarding by snapshot",
        "trie, one hop at most); the global systems are one balancer in us pushing at once "
        "with an exact,",
        "instant view of every replica (idealised in their favour). Throughput is completed "
        "requests over the",
        "span from first arrival to last finish, TTFT is measured at the client (delays both "
        "ways).",
        "",
    ]
    same_size = [r for r in rows if r.get("purpose", "compare") == "compare"]
    for trace in dict.fromkeys(r["trace"] for r in same_size):
        tr = [r for r in same_size if r["trace"] == trace]
        t0 = tr[0]
        lines += [
            f"### {TRACE_NAMES.get(trace, trace)}: first {t0['limit']} requests at "
            f"{t0['speed']:g}x, {3 * t0['replicas_per_region']} replicas",
            "",
            *_table(tr),
            "",
        ]
    speeds = sorted({r["speed"] for r in rows if r["trace"] == "conversation"})
    for speed in speeds:
        lines += _sweep(rows, d["ttft_slo_p90"], speed)
    lines += _exact_note(same_size)
    notes = d.get("notes", [])
    lines += [
        "Paper: 1.12-2.06x throughput and 1.74-6.30x lower latency than existing balancers, "
        "25% fewer replicas",
        "than region-local serving at equal throughput. Why ours differ:",
        "",
        "- open-loop replay: throughput equals the offered load unless a system falls behind, "
        "so throughput",
        "  ratios stay near 1 below saturation; the paper's clients are closed-loop (one "
        "program at a time),",
        "  so there every second of latency is lost throughput;",
        "- the global baselines here see every replica exactly and at once; the paper's run "
        "in SkyServe and",
        "  probe over the WAN, and SGLang's router is not our prefix-aware policy;",
        "- a simulated replica is the roofline cost model over the real scheduler and block "
        "pool, not SGLang",
        "  on an L4; Mooncake's trace is long-prompt (12k tokens mean) with little reuse in "
        "a short slice,",
        "  while the paper's ToT workloads reach 90% hit ratios;",
        "- a conversation's later turns that SkyWalker forwards run away from the replica "
        "holding its earlier",
        "  turns (this trace has no prefix shared across regions), so its hit ratio sits "
        "below region-local's;",
        "  forwarding pays off only while a region's peak fills all its replicas, which at "
        "this load is rare,",
        "  so SkyWalker and region-local end close at the lighter load; at the heavier one "
        "the peak region",
        "  of region-local serving saturates with 9 replicas while SkyWalker spreads it;",
        "- the 5 s SLO (fixed before the runs) sits just above the P90 that long prompts set "
        "even with spare",
        "  replicas (about 4.1-4.7 s with 15 here), and replica counts move by a region's "
        "worth (3), so the",
        "  fewest-replica count ties easily; the P90 columns show the gap below it;",
        "- the global least-load and prefix-aware balancers push every request at once: they "
        "weigh a running",
        "  request at 16 prompt tokens, so replicas busy decoding long (12k-token) prompts "
        "keep getting new ones",
        "  until their KV cache is full and requests wait or are preempted (likely the cause "
        "of their P90; not",
        "  measured separately). Selective pushing stops at the first waiting request.",
        *notes,
        "",
    ]
    return lines


def replace_section(report: Path, section: list[str]) -> None:
    """Put ``section`` into ``report`` in place of an old one, else before the sim-to-real
    section, else at the end."""
    text = report.read_text().splitlines() if report.exists() else []
    if HEADER in text:
        i = text.index(HEADER)
        j = next(
            (k for k in range(i + 1, len(text)) if text[k].startswith("## ")),
            len(text),
        )
        text[i:j] = section
    else:
        anchor = next((k for k, t in enumerate(text) if t.startswith("## Sim-to-real")), len(text))
        text[anchor:anchor] = section
    report.write_text("\n".join(text) + "\n")
