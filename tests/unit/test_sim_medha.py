"""Medha's scheduler ablation in the simulator, small: the real scheduler and pool timed by
the roofline, short requests behind a long one."""

from __future__ import annotations

from sim.medha import MedhaWorkload, run_config, workload
from sim.workload import TraceRequest


def test_slack_scheduling_ends_head_of_line_blocking_behind_a_long_prompt():
    w = MedhaWorkload(qps=2.0, num_requests=30, long_fraction=0.0, seed=3)
    shorts = workload(w)
    # one 200K-token request arrives first; the short ones arrive behind it
    reqs = [TraceRequest("long", 0.0, 200_000, 50)] + shorts
    fcfs = run_config("fcfs", reqs)
    ilrs = run_config("ilrs+ppb", reqs, target=0.1)
    lrs = run_config("lrs", reqs)
    assert fcfs.finished == ilrs.finished == lrs.finished == 31
    # FCFS: the long prompt takes every step's budget; the short ones wait behind it
    assert fcfs.short_ttft_p50 > 5 * ilrs.short_ttft_p50
    assert fcfs.short_ttft_p50 > 5 * lrs.short_ttft_p50
