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
GLOBALS = (
    "global round robin",
    "global least load",
    "global consistent hashing",
    "global prefix-aware",
)


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


def _label(r: dict) -> str:
    """A run's workload, for titles: the trace, open or closed loop, its load."""
    name = TRACE_NAMES.get(r["trace"], r["trace"])
    if r.get("clients", 0) > 0:
        return (
            f"{name}, closed loop: {r['clients']} clients per region on average "
            f"(diurnal), {r['duration']:g} s"
        )
    return f"{name}, open loop: first {r['limit']} requests at {r['speed']:g}x"


def _group_key(r: dict) -> tuple:
    return (r["trace"], r.get("clients", 0), r["speed"], r["limit"])


def fewest(runs: list[dict], slo: float) -> dict | None:
    """The run with the fewest replicas that meets the SLO, or None."""
    ok = [r for r in runs if r["ttft_p90"] <= slo]
    return min(ok, key=lambda r: r["replicas_total"]) if ok else None


def _search(rows: list[dict], slo: float) -> tuple[list[str], dict[tuple, dict[str, int]]]:
    """The replica-search tables, and each group's fewest count per system."""
    lines: list[str] = []
    found: dict[tuple, dict[str, int]] = {}
    search = [r for r in rows if r.get("purpose") == "search"]
    for key in dict.fromkeys(_group_key(r) for r in search):
        group = [r for r in search if _group_key(r) == key]
        lines += [
            f"### Replicas needed for P90 TTFT <= {slo:g} s: {_label(group[0])}",
            "",
            "Fewest replicas in all (spread over the three regions, us first) found by "
            "bisection; P90 TTFT at",
            "that count and at one fewer (which missed), and every count tried.",
            "",
            "| system | fewest replicas | P90 there (s) | P90 one fewer (s) | throughput there "
            "(req/s) | counts tried (P90 s) |",
            "|---|---|---|---|---|---|",
        ]
        found[key] = {}
        for system in dict.fromkeys(r["system"] for r in group):
            runs = sorted(
                (r for r in group if r["system"] == system), key=lambda r: r["replicas_total"]
            )
            best = fewest(runs, slo)
            tried = ", ".join(f"{r['replicas_total']}: {r['ttft_p90']:.2f}" for r in runs)
            if best is None:
                most = runs[-1]["replicas_total"]
                lines.append(f"| {system} | none up to {most} | - | - | - | {tried} |")
                continue
            n = best["replicas_total"]
            found[key][system] = n
            below = next((r for r in runs if r["replicas_total"] == n - 1), None)
            p90_below = f"{below['ttft_p90']:.2f}" if below else "-"
            lines.append(
                f"| {system} | {n} | {best['ttft_p90']:.2f} | {p90_below} | "
                f"{best['throughput_rps']:.2f} | {tried} |"
            )
        sky, local = found[key].get("SkyWalker"), found[key].get("region-local")
        lines.append("")
        if sky and local:
            change = (
                f"{100 * (1 - sky / local):.0f}% fewer"
                if sky <= local
                else f"{100 * (sky / local - 1):.0f}% more"
            )
            lines += [
                f"SkyWalker meets the SLO with {sky} replicas, region-local serving with {local}: "
                f"{change} (the paper: 9 instead of 12, 25% fewer).",
                "",
            ]
    return lines, found


def _ratio_range(sky: dict, others: list[dict], key: str, invert: bool) -> str:
    vals = [
        (sky[key] / o[key]) if not invert else (o[key] / sky[key])
        for o in others
        if o[key] > 0 and sky[key] > 0
    ]
    if not vals:
        return "-"
    return f"{min(vals):.2f}-{max(vals):.2f}x"


def _paper_table(rows: list[dict], found: dict[tuple, dict[str, int]]) -> list[str]:
    """Our ratios next to the paper's, per comparison group with the global baselines."""
    lines = [
        "### Next to the paper",
        "",
        "SkyWalker against the four global balancers (round robin, least load, consistent "
        "hashing, prefix-aware),",
        "as ranges over the four; above 1.00x SkyWalker is ahead. Replicas: fewest meeting "
        "the SLO, SkyWalker",
        "against region-local serving.",
        "",
        "| workload | throughput | TTFT P50 lower by | TTFT P90 lower by | hit ratio SkyWalker "
        "/ global | replicas vs region-local |",
        "|---|---|---|---|---|---|",
        "| paper (section 5) | 1.12-2.06x | 1.74-6.30x (P50/mean at 15.87-57.63%) | "
        "4.28-9.92x (P90 at 10.08-23.38%) | 37-47% / 11-31% (conversations) | 9 vs 12 (25% "
        "fewer) |",
    ]
    compare = [r for r in rows if r.get("purpose", "compare") == "compare"]
    for key in dict.fromkeys(_group_key(r) for r in compare):
        group = {r["system"]: r for r in compare if _group_key(r) == key}
        sky = group.get("SkyWalker")
        others = [group[s] for s in GLOBALS if s in group]
        if sky is None or not others:
            continue
        hits = "/".join(f"{100 * o['hit_ratio']:.0f}" for o in others)
        reps = "-"
        for skey, f in found.items():
            if skey == key and "SkyWalker" in f and "region-local" in f:
                reps = f"{f['SkyWalker']} vs {f['region-local']}"
        lines.append(
            f"| {_label(sky)} | {_ratio_range(sky, others, 'throughput_rps', False)} | "
            f"{_ratio_range(sky, others, 'ttft_p50', True)} | "
            f"{_ratio_range(sky, others, 'ttft_p90', True)} | "
            f"{100 * sky['hit_ratio']:.0f}% / {hits}% | {reps} |"
        )
    return lines + [""]


# Read with the tables above; written after the runs (the simulation is deterministic, so
# a rerun of the same code gives the same tables).
WHY = [
    "### Why ours differ from the paper",
    "",
    "What the closed loop fixed. Replayed open-loop, every system's throughput is the "
    "offered load (the",
    "throughput ratios of the open-loop tables are 1.00-1.04x below saturation) and the "
    "cache barely matters:",
    "a conversation's next turn comes minutes later and its blocks are gone (hit ratios "
    "4-10%). With the",
    "paper's clients, a turn follows its answer, hit ratios reach the paper's range "
    "(SkyWalker about 36% at 24",
    "clients per region, the paper 37-47%; round robin about 7%, the paper 11-17%; least "
    "load about 21%, the",
    "paper 28-31%), and latency costs throughput. Against round robin (no prefix "
    "affinity) and consistent",
    "hashing (session affinity with blind pushing: bursty sessions pile onto one replica, "
    "P90 TTFT of 30 s",
    "and more) SkyWalker then gains in the paper's range (1.10-1.28x throughput, "
    "3.7-6.2x lower P90).",
    "",
    "Where it does not: least load and the global prefix-aware balancer end within a few "
    "percent of",
    "SkyWalker's throughput, and below its P90 TTFT. Likely causes, not separately measured:",
    "",
    "- the global balancers here see every replica's queue and cache exactly and at once "
    "(idealised in",
    "  their favour); the paper's run in SkyServe and learn replica state over the WAN, "
    "and SGLang's router",
    "  is not our prefix-aware policy, which weighs load against cached blocks;",
    "- Mooncake prompts are long (12k tokens mean): a prefill takes seconds on the "
    "simulated L40S, so the",
    "  round trip through us that a global balancer adds for eu and asia clients (up to "
    "0.32 s, asia to us",
    "  to an asia replica and back) is a small share of TTFT; in the paper (short ChatBot "
    "Arena / WildChat",
    "  prompts, about 300 ms prefill on an L4) it is about as long as the prefill;",
    "- a replica holds about 200k tokens of KV (llama3-8b on an L40S), 17 Mooncake "
    "contexts: at 36 clients",
    "  per region the peak region's conversations no longer fit its replicas' caches and "
    "every system's hit",
    "  ratio falls (SkyWalker's to about 13%), so prefix affinity buys little there;",
    "- a turn SkyWalker forwards runs away from its conversation's cache (this trace "
    "shares no prefix across",
    "  regions beyond the first block), so its hit ratio sits below region-local "
    "serving's when it forwards",
    "  much.",
    "",
    "Against region-local serving (the paper's section 5.2: 1.07-1.18x throughput, 9 "
    "replicas instead of",
    "12): at 24 clients per region the regional peaks (1.8x the mean, about the paper's "
    "3:1:1 skew) still",
    "fit four replicas, little is forwarded and the two tie; at 36 clients the peak "
    "region of region-local",
    "serving saturates and SkyWalker's forwarding gains throughput and halves P90 TTFT "
    "at 12 replicas.",
    "",
    "The replica searches do not reproduce the paper's saving. Closed loop, SkyWalker "
    "needs as many",
    "replicas as region-local serving at 24 clients per region and one more at 36; open "
    "loop at 0.75x it",
    "needs two fewer (13% here, 25% in the paper). The idealised global balancers need "
    "the fewest (least",
    "load and prefix-aware, at both loads): one exact view over every replica pools the "
    "regions' diurnal",
    "peaks completely, and the WAN round trip they pay is small against Mooncake's "
    "prefills. SkyWalker",
    "forwards only once every local replica has a pending request (queueing has begun), "
    "to a peer with",
    "free replicas and a short queue, and a forwarded turn loses its conversation's cache "
    "(hit ratio at",
    "equal replica counts below region-local serving's). With the exact local index "
    "SkyWalker needs fewer",
    "replicas than with the trie at 36 clients: under cache pressure the trie keeps "
    "pointing at replicas",
    "that evicted the prefix (a likely cause; the hit ratios in the search rows agree). "
    "The paper measures",
    "equal throughput at a fixed skew (US always at 3x); ours is a P90 TTFT SLO over a "
    "whole diurnal",
    "period, where each region is at its peak only part of the time.",
    "",
    "A simulated replica is the roofline cost model over the real scheduler and block "
    "pool, not SGLang on",
    "an L4, and the ToT workloads (90% hit ratios in the paper) have no trace here.",
    "",
]


def _exact_note(rows: list[dict]) -> list[str]:
    """The trie against the exact block-event view as the local-region view."""
    out = []
    for key in dict.fromkeys(_group_key(r) for r in rows):
        by = {r["system"]: r for r in rows if _group_key(r) == key}
        trie, exact = by.get("SkyWalker"), by.get("SkyWalker, exact local index")
        if trie and exact:
            out.append(
                f"- {_label(trie)}: hit ratio {100 * trie['hit_ratio']:.1f}% "
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
        "snapshot of what was forwarded to each peer needs no event stream over the WAN.",
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
        "per replica (the cost model has no L4, the paper's GPU). SkyWalker systems run "
        "`policies.region_balancer`",
        "(selective pushing by pending requests, probes every "
        f"{1000 * first['probe_interval']:.0f} ms, prefix trie, forwarding by snapshot",
        "trie, one hop at most); the global systems are one balancer in us pushing at once "
        "with an exact,",
        "instant view of every replica (idealised in their favour); requests from eu and asia "
        "pay the way to",
        "us and, when served elsewhere, on to the replica's region. Round robin and least "
        "load ignore prefixes,",
        "consistent hashing keys on the session (conversation), prefix-aware ranks by cached "
        "blocks and load.",
        "TTFT is measured at the client (delays both ways).",
        "",
        "Two workloads, both with a diurnal curve per region (amplitude "
        f"{first['amplitude']:g}, each region's peak a third",
        "of a period after the previous one, the global total steady):",
        "",
        "- closed loop (the paper's setup, section 5.1; `sim/closed_loop.py`): each region "
        "has a number of",
        "  clients following the curve; a client runs one Mooncake conversation at a time, "
        "each turn sent when",
        "  the previous answer arrived, so a turn finds its predecessor's blocks in the cache "
        "that served it",
        "  (the prefix reuse of the paper's conversation workloads). Throughput: answers that "
        "reached their",
        "  clients within the run, per second; here every second of latency is lost "
        "throughput, as in the paper;",
        "- open loop: the trace's requests at their (scaled) timestamps, each session's "
        "region drawn from the",
        "  curve. Throughput is completed requests over the span from first arrival to last "
        "finish, so it equals",
        "  the offered load unless a system falls behind; consecutive turns arrive minutes "
        "apart (the trace's",
        "  own gaps, median two minutes) and find their blocks evicted, so the cache matters "
        "little.",
        "",
    ]
    compare = [r for r in rows if r.get("purpose", "compare") == "compare"]
    for key in dict.fromkeys(_group_key(r) for r in compare):
        group = [r for r in compare if _group_key(r) == key]
        lines += [
            f"### {_label(group[0])}, {3 * group[0]['replicas_per_region']} replicas",
            "",
            *_table(group),
            "",
        ]
    search_lines, found = _search(rows, d["ttft_slo_p90"])
    lines += search_lines
    lines += _paper_table(rows, found)
    lines += _exact_note(compare)
    lines += [*WHY, *d.get("notes", []), ""]
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
