"""The MegaScale-Infer section of the simulator report (sim/report_moe.py): the model's
qualitative results that the paper reports, and the section's placement in the report."""

from __future__ import annotations

from sim.report_moe import HEADER, ablation, decode_rows, heterogeneous_rows, replace_section


def test_disaggregated_beats_colocated_per_gpu_on_every_gpu_and_model():
    rows = decode_rows()
    assert {(r.model, r.gpu) for r in rows} == {
        (m, g) for m in ("mixtral-8x22b", "dbrx") for g in ("A800", "H20", "L40S")
    }
    for r in rows:
        assert r.ratio > 1.0, r


def test_heterogeneous_puts_attention_on_h20_and_experts_on_l40s():
    for _, gpu_a, gpu_e, per_cost, _, colocated in heterogeneous_rows():
        assert (gpu_a, gpu_e) == ("H20", "L40S")
        assert per_cost > colocated


def test_micro_batch_ablation_has_the_papers_shape():
    for name in ("mixtral-8x22b", "dbrx"):
        t = ablation(name)
        assert 1.5 < t[2] / t[1] <= 2.0  # m 1->2: two modules overlap, at most 2x
        assert t[3] / t[2] > 1.0  # m 2->3 hides the communication
        assert abs(t[4] / t[3] - 1.0) < 0.05  # m 3->4: nothing left to hide


def test_replace_section_is_idempotent(tmp_path):
    report = tmp_path / "r.md"
    report.write_text("# R\n\n## A\n\nx\n\n## Simulator speed\n\ny\n")
    replace_section(report, [HEADER, "", "one", ""])
    replace_section(report, [HEADER, "", "two", ""])
    text = report.read_text()
    assert text.count(HEADER) == 1 and "two" in text and "one" not in text
    assert text.index(HEADER) < text.index("## Simulator speed") and "x" in text
