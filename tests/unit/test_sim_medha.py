"""Medha's scheduler ablation in the simulator, small: the real scheduler and pool timed by
the roofline, short requests behind a long one."""

from __future__ import annotations

from sim.medha import CONFIGS, Layout, MedhaWorkload, run_config, workload
from sim.workload import TraceRequest


def test_slack_scheduling_ends_head_of_line_blocking_behind_a_long_prompt():
    w = MedhaWorkload(qps=2.0, num_requests=30, long_fraction=0.0, seed=3)
    shorts = workload(w)
    # one 200K-token request arrives first; the short ones arrive behind it
    reqs = [TraceRequest("long", 0.0, 200_000, 50)] + shorts
    tp8 = Layout(spp=1)  # no pipelining: the long prompt's prefill spans the short arrivals
    fcfs = run_config("fcfs", reqs, layout=tp8)
    ilrs = run_config("ilrs+ppb", reqs, target=0.1, layout=tp8)
    lrs = run_config("lrs", reqs, layout=tp8)
    assert fcfs.finished == ilrs.finished == lrs.finished == 31
    # FCFS: the long prompt takes every step's budget; the short ones wait behind it
    assert fcfs.short_ttft_p50 > 5 * ilrs.short_ttft_p50
    assert fcfs.short_ttft_p50 > 5 * lrs.short_ttft_p50


def test_kv_parallelism_shortens_a_long_requests_decode_and_the_report_shows_both_layouts():
    from sim.report_medha import MedhaRuns, medha_section

    two_d = Layout("llama3-70b", "H100", tp=8, spp=8)
    three_d = Layout("llama3-70b", "H100", tp=8, spp=4, kvp=2, kvp_rank_tokens=100_000)
    # one 300K-token request (three KV groups' worth in 3D: it spans both) and short ones
    shorts = workload(MedhaWorkload(qps=2.0, num_requests=10, long_fraction=0.0, seed=1))
    reqs = [TraceRequest("long", 0.0, 300_000, 20)] + shorts
    two = run_config("ilrs", reqs, chunk=8192, layout=two_d)
    three = run_config("ilrs", reqs, chunk=8192, layout=three_d)
    assert two.finished == three.finished == 11
    # its decode reads 300K tokens of KV: split over two groups, each step is shorter
    assert three.long_tpot_p50 < 0.95 * two.long_tpot_p50
    sched = [run_config(name, shorts, layout=Layout()) for name in CONFIGS]
    lines = medha_section(MedhaRuns(10, 11, {1.0: sched}, {2.0: (two, three)}, 1.0))
    text = "\n".join(lines)
    assert "| 2 | 2D |" in text and "| 2 | 3D |" in text and "ilrs+ppb" in text
