"""The multi-region report section: ratios against SkyWalker, the fewest replicas meeting
the SLO, and replacing the section in place."""

import json

from sim.report_skywalker import HEADER, replace_section, skywalker_section


def row(system, n, p90, tput=1.0, p50=1.0, trace="conversation", purpose="compare", total=0):
    return {
        "system": system, "trace": trace, "limit": None, "speed": 1.0, "replicas_per_region": n,
        "model": "m", "gpu": "g", "amplitude": 0.8, "probe_interval": 0.1, "clients": 4,
        "duration": 60.0, "purpose": purpose, "replicas_total": total,
        "throughput_rps": tput, "output_tok_s": 1.0, "ttft_p50": p50, "ttft_p90": p90,
        "hit_ratio": 0.5, "forwarded": 0,
    }  # fmt: skip


def search(system, total, p90):
    return row(system, 0, p90, purpose="search", total=total)


def test_section_ratios_fewest_replicas_and_the_paper_table(tmp_path):
    rows = [
        row("SkyWalker", 2, 2.0, tput=2.0, p50=0.5),
        row("global least load", 2, 8.0, tput=1.0, p50=1.0),
        row("global round robin", 2, 4.0, tput=2.5, p50=2.0),
        row("region-local", 2, 6.0),
        search("SkyWalker", 3, 4.0),
        search("SkyWalker", 6, 2.0),
        search("region-local", 3, 9.0),
        search("region-local", 5, 6.0),
        search("region-local", 6, 4.5),
        search("global least load", 36, 5.5),
    ]
    path = tmp_path / "sky.json"
    path.write_text(json.dumps({"ttft_slo_p90": 5.0, "rows": rows}))
    text = "\n".join(skywalker_section(path))
    assert (
        "| global least load | 1.000 | 1 | 1.00 | 8.00 | 50.0% | 0 | 2.00x | 2.00x | 4.00x |"
        in text
    )
    assert "| SkyWalker | 3 | 4.00 | - | 1.00 | 3: 4.00, 6: 2.00 |" in text  # lo met the SLO
    assert "| region-local | 6 | 4.50 | 6.00 | 1.00 | 3: 9.00, 5: 6.00, 6: 4.50 |" in text
    assert "| global least load | none up to 36 | - | - | - | 36: 5.50 |" in text
    assert "3 replicas, region-local serving with 6: 50% fewer" in text
    # next to the paper: SkyWalker against the global balancers as ranges, replicas vs local
    assert "| 0.80-2.00x | 2.00-4.00x | 2.00-4.00x | 50% / 50/50% | 3 vs 6 |" in text


def test_replace_section_in_place(tmp_path):
    report = tmp_path / "r.md"
    report.write_text("# R\n\n## Sim-to-real\n\nx\n")
    replace_section(report, [HEADER, "", "one", ""])
    replace_section(report, [HEADER, "", "two", ""])
    text = report.read_text()
    assert text.count(HEADER) == 1 and "two" in text and "one" not in text
    assert text.index(HEADER) < text.index("## Sim-to-real")
