"""Engine threads run at nice 0 whatever the process's niceness (Ray starts its workers at
15): the replica loop's thread is raised and named; where raising is not permitted the
thread keeps its priority and one logged line says how to fix it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.engine import thread_priority
from actors.engine.replica_loop import ReplicaLoop

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not thread_priority.supported(), reason="Linux only")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread_at(nice: int, fn):
    """``fn()`` on a fresh thread that runs at ``nice`` (threads it starts inherit it)."""
    box: dict = {}

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        box["out"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    return box["out"]


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root here")
def test_a_thread_started_at_nice_15_runs_at_0():
    def check():
        before = _nice()
        return before, thread_priority.run_at_normal_priority(), _nice()

    assert _in_thread_at(15, check) == (15, 0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root here")
def test_a_thread_at_normal_or_better_priority_is_left_as_it_is():
    assert _in_thread_at(0, thread_priority.run_at_normal_priority) == 0
    assert _in_thread_at(-2, thread_priority.run_at_normal_priority) == -2


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root here")
def test_the_replica_loop_thread_runs_at_0_under_a_niced_creator_and_carries_its_name():
    def start_loop():
        return ReplicaLoop(lambda: False, "meridian-engine", idle_wait_s=0.01)

    loop = _in_thread_at(15, start_loop)  # the loop thread inherits nice 15
    try:
        tid = loop.call(threading.get_native_id).result(timeout=10)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        assert comm == "meridian-engine"
        # a thread the engine thread starts (torch's pool) inherits nice 0
        assert loop.call(_spawned_nice).result(timeout=10) == 0
    finally:
        loop.stop()


def _spawned_nice() -> int:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("nice", _nice()))
    t.start()
    t.join()
    return box["nice"]


def test_once_on_this_thread_raises_each_thread_once():
    calls: list[int] = []
    real = thread_priority.run_at_normal_priority

    def counting() -> int | None:
        calls.append(threading.get_native_id())
        return real()

    thread_priority.run_at_normal_priority = counting  # type: ignore[assignment]
    try:

        def twice() -> None:
            thread_priority.once_on_this_thread()
            thread_priority.once_on_this_thread()

        for _ in range(2):
            t = threading.Thread(target=twice)
            t.start()
            t.join()
    finally:
        thread_priority.run_at_normal_priority = real  # type: ignore[assignment]
    assert len(calls) == 2  # once per thread, not once per call


UNPRIVILEGED = """
import logging, os, resource, sys, threading
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
from actors.engine import thread_priority
niced = os.nice(10)
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
os.setuid(65534)  # nobody: no CAP_SYS_NICE, RLIMIT_NICE 0
print(niced, thread_priority.run_at_normal_priority(), thread_priority.run_at_normal_priority())
print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the test drops root's privileges")
def test_where_raising_is_not_permitted_one_line_says_how_to_fix_it():
    out = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    niced, *after = map(int, out.stdout.split())
    assert niced >= 10 and after == [niced] * 3  # left as it was, nothing raised
    lines = [line for line in out.stderr.splitlines() if "nice" in line]
    assert lines == [thread_priority.FIX.format(nice=niced)]  # once per process
    assert "RAY_worker_niceness=0" in lines[0] and "CAP_SYS_NICE" in lines[0]


WHOLE_PROCESS = """
import os, threading
from actors.engine import thread_priority
os.nice(15)
done = threading.Event()
early = threading.Thread(target=done.wait)  # started at the process's nice
early.start()
thread_priority.run_process_at_normal_priority()
nice = lambda: print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
late = threading.Thread(target=nice)
late.start(); late.join()
print(os.getpriority(os.PRIO_PROCESS, early.native_id), os.getpriority(os.PRIO_PROCESS, 0))
done.set()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root here")
def test_a_whole_process_runs_at_0_threads_started_later_included():
    out = subprocess.run(
        [sys.executable, "-c", WHOLE_PROCESS],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0", "0"]  # the late thread, the early one, main
