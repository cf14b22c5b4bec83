"""Cores and resources of a heterogeneous MoE plan: each worker's share of its kind's cores
(``worker_cores``), pinning a process (``pin_process``) and the engine options' checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.engine.config import EngineConfig
from actors.moe.messages import worker_cores

MOE = dict(attention_workers=1, expert_workers=2)


def test_worker_cores_are_disjoint_runs_or_shared_when_too_few():
    assert [worker_cores([4, 5, 6, 7, 8], 2, i) for i in range(2)] == [[4, 5, 6], [7, 8]]
    assert [worker_cores([3, 1, 2], 3, i) for i in range(3)] == [[1], [2], [3]]
    assert [worker_cores([5], 3, i) for i in range(3)] == [[5], [5], [5]]
    assert [worker_cores([0, 1], 3, i) for i in range(3)] == [[0], [1], [0]]
    assert worker_cores([], 2, 1) == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_pins_every_thread_and_torch_threads():
    core = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import os, threading, time, torch\n"
        "from actors.moe.workers import pin_process\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
        f"print(pin_process([{core}]), torch.get_num_threads(), "
        "os.sched_getaffinity(t.native_id))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == [f"[{core}]", "1", f"{{{core}}}"]


def test_engine_options_accept_a_heterogeneous_plan():
    cores = sorted(os.sched_getaffinity(0))
    cfg = EngineConfig(
        **MOE,
        attention_cores=cores[:1],
        expert_cores=cores[-1:],
        attention_resources={"attention_hw": 1},
        expert_resources={"expert_hw": 0.5},
    )
    assert cfg.attention_resources == {"attention_hw": 1}


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(attention_cores=[0]), "needs attention_workers"),
        (dict(expert_resources={"x": 1}), "needs attention_workers"),
        (dict(**MOE, attention_cores=[]), "attention_cores must be"),
        (dict(**MOE, expert_cores=[0, 0]), "expert_cores must be"),
        (dict(**MOE, expert_cores=[10_000]), "expert_cores must be"),
        (dict(**MOE, attention_resources={"x": 0}), "attention_resources must map"),
    ],
)
def test_engine_options_refuse_bad_moe_cores_and_resources(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
