"""bench/serve_profile.py (``bench/serve.py --cpu-profile``): which part of the system a
thread is charged to, and the CPU-time deltas between two snapshots of /proc."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench import serve_profile as sp
from bench.proc_table import descendants

linux = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")


def test_parts_by_process_title():
    ours, client = {10, 11, 12, 13, 14, 15, 16}, 99

    def part(cmdline: str, pid: int) -> str:
        return sp._process_part(cmdline, pid, ours, client)

    assert part("ray::ServeReplica:meridian:OpenAIIngress", 10) == "ingress"
    assert part("ray::ServeReplica:meridian:Router", 11) == "router"
    assert part("ray::ServeReplica:meridian:main", 12) == "replica"
    assert part("ray::ProxyActor", 13) == "Serve proxy"
    assert part("ray::ServeController", 14) == "Serve controller"
    assert part("/venv/lib/ray/core/src/ray/raylet/raylet --x", 15) == "raylet + GCS"
    assert part("/venv/bin/python -m ray.dashboard.agent", 16) == "Ray other"
    # the same titles outside the serve run's process tree are someone else's work
    assert part("ray::ServeReplica:meridian:main", 50) == sp.OTHER
    assert part("anything", client) == sp.CLIENT
    assert part("VLLM::EngineCore", 60) == sp.VLLM_ENGINE
    assert part("/venv/bin/python -m vllm.entrypoints.openai.api_server", 61) == sp.VLLM_SERVER


def test_descendants_follow_parent_links():
    parents = {1: 0, 2: 1, 3: 2, 4: 1, 5: 0, 6: 5}
    assert descendants(1, parents) == {1, 2, 3, 4}


def test_reading_sums_deltas_by_part_and_counts_new_threads_from_zero():
    before = {
        (1, 1): sp.TaskTimes(sp.ENGINE, 10.0, 1.0),
        (1, 2): sp.TaskTimes("ingress", 5.0, 0.0),
    }
    after = {
        (1, 1): sp.TaskTimes(sp.ENGINE, 11.5, 1.25),
        (1, 2): sp.TaskTimes("ingress", 5.5, 0.0),
        (1, 3): sp.TaskTimes("ingress", 0.25, 0.0),  # started during the run
    }
    r = sp.reading("meridian", before, after, seconds=2.0, tokens=100)
    assert r.cpu == {sp.ENGINE: 1.5, "ingress": 0.75}
    assert r.cores(sp.ENGINE) == 0.75
    assert r.engine_threads == 1 and r.engine_waited == 0.25


@linux
def test_snapshot_charges_this_process_to_the_client():
    me = os.getpid()
    before = sp.snapshot(None, me)
    end = time.process_time() + 0.1
    while time.process_time() < end:  # 0.1 s of CPU on this thread
        pass
    after = sp.snapshot(None, me)
    r = sp.reading("x", before, after, seconds=1.0, tokens=1)
    assert r.cpu[sp.CLIENT] >= 0.05  # clock ticks: 10 ms apiece
    assert {t.part for (pid, _), t in after.items() if pid == me} == {sp.CLIENT}
