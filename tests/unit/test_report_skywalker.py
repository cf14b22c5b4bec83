"""The multi-region report section: ratios against SkyWalker, the fewest replicas meeting
the SLO, and replacing the section in place."""

import json

from sim.report_skywalker import HEADER, replace_section, skywalker_section


def row(system, n, p90, tput=1.0, p50=1.0, trace="conversation"):
    return {
        "system": system, "trace": trace, "limit": 10, "speed": 1.0, "replicas_per_region": n,
        "model": "m", "gpu": "g", "amplitude": 0.8, "probe_interval": 0.1,
        "throughput_rps": tput, "output_tok_s": 1.0, "ttft_p50": p50, "ttft_p90": p90,
        "hit_ratio": 0.5, "forwarded": 0,
    }  # fmt: skip


def test_section_ratios_and_fewest_replicas(tmp_path):
    rows = [
        row("SkyWalker", 2, 2.0, tput=2.0, p50=0.5),
        row("global least load", 2, 8.0, tput=1.0, p50=1.0),
        row("region-local", 2, 6.0),
        row("SkyWalker", 1, 4.0),
        row("region-local", 1, 9.0),
        row("region-local", 3, 4.5),
    ]
    path = tmp_path / "sky.json"
    path.write_text(json.dumps({"ttft_slo_p90": 5.0, "rows": rows}))
    text = "\n".join(skywalker_section(path))
    assert (
        "| global least load | 1.000 | 1 | 1.00 | 8.00 | 50.0% | 0 | 2.00x | 2.00x | 4.00x |"
        in text
    )
    assert "| SkyWalker | 4.00 | 2.00 | - | 3 |" in text  # 1 per region meets 5 s: 3 replicas
    assert "| region-local | 9.00 | 6.00 | 4.50 | 9 |" in text
    assert "3 replicas, region-local with 9: 67% fewer" in text


def test_replace_section_in_place(tmp_path):
    report = tmp_path / "r.md"
    report.write_text("# R\n\n## Sim-to-real\n\nx\n")
    replace_section(report, [HEADER, "", "one", ""])
    replace_section(report, [HEADER, "", "two", ""])
    text = report.read_text()
    assert text.count(HEADER) == 1 and "two" in text and "one" not in text
    assert text.index(HEADER) < text.index("## Sim-to-real")
