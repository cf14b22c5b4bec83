"""A replica's own loop: commands run on the loop thread between steps, in order; the
long poll returns what was emitted or noted, waiting only while nothing was emitted, and
only to the outbox's owner; a failing step stops the loop and is reported; ``on_exit`` runs on the
loop thread once it ends; ``cpu_cores`` pins the loop thread and no other."""

from __future__ import annotations

import os
import threading
import time

import pytest

from actors.engine.replica_loop import ReplicaLoop, Superseded, split_cores


def reader_waiting(loop: ReplicaLoop) -> tuple[threading.Thread, list[object]]:
    """A thread in ``loop.take(30.0)`` (started, past its start); what it takes lands in
    the list."""
    got: list[object] = []
    reading = threading.Event()

    def reader() -> None:
        reading.set()
        got.extend(loop.take(30.0))

    waiter = threading.Thread(target=reader)
    waiter.start()
    assert reading.wait(5)
    return waiter, got


def test_commands_run_in_order_on_the_loop_thread_between_steps():
    seen: list[str] = []
    work = [3]
    box: dict[str, ReplicaLoop] = {}

    def step() -> bool:
        if work[0] == 0 or "loop" not in box:
            return False
        work[0] -= 1
        seen.append("step")
        box["loop"].emit(work[0])
        return True

    loop = box["loop"] = ReplicaLoop(step, "test-loop", idle_wait_s=0.01)
    try:
        threads: list[str] = []
        loop.post(lambda: seen.append("a"))
        fut = loop.call(lambda: threads.append(threading.current_thread().name) or "b")
        assert fut.result(timeout=5) == "b" and threads == ["test-loop"]
        events: list[int] = []
        deadline = time.monotonic() + 5
        while len(events) < 3 and time.monotonic() < deadline:
            events += loop.take(1.0)
        assert events == [2, 1, 0]
        assert seen.index("a") < len(seen) and seen.count("step") == 3
        assert loop.take(0.05) == []  # nothing new: waits, then returns empty
        # a reader waiting on an empty outbox is woken by the next event
        waiter, got = reader_waiting(loop)
        loop.emit("late")
        waiter.join(timeout=10)
        assert not waiter.is_alive() and got == ["late"]
    finally:
        loop.stop()
    assert not loop.is_alive()


def test_only_the_owner_takes_events_and_a_claim_supersedes_a_waiting_reader():
    loop = ReplicaLoop(lambda: False, "owned", idle_wait_s=0.01)
    try:
        loop.claim("a")
        loop.emit(1)
        assert loop.take(0, "a") == [1]
        waiting = threading.Event()
        got: list[object] = []

        def old_reader() -> None:
            waiting.set()
            try:
                got.append(loop.take(30.0, "a"))  # a's long poll, waiting for events
            except Superseded as e:
                got.append(e)

        reader = threading.Thread(target=old_reader)
        reader.start()
        waiting.wait()
        loop.claim("b")  # another Conductor attached: a's poll ends, taking nothing
        reader.join(timeout=10)
        assert len(got) == 1 and isinstance(got[0], Superseded)
        loop.emit(2, 3)
        with pytest.raises(Superseded):
            loop.take(0, "a")
        with pytest.raises(Superseded):
            loop.take(0)  # nor a reader without an owner
        assert loop.take(0, "b") == [2, 3]  # left to the owner, in order
        loop.emit(4)
        loop.claim("c")  # what the last owner left unread is dropped
        assert loop.take(0, "c") == []
    finally:
        loop.stop()


def test_notes_go_with_the_next_event_or_when_the_wait_ends():
    loop = ReplicaLoop(lambda: False, "notes", idle_wait_s=0.01)
    try:
        loop.note("step 1")
        assert loop.take(0.01) == ["step 1"]  # the wait ran out: the notes alone
        loop.note("step 2")
        loop.emit("end")
        loop.note("step 3")
        assert loop.take(30.0) == ["step 2", "end", "step 3"]  # in order, one report
        # a reader waiting for events keeps waiting through notes, returns at the event
        waiter, got = reader_waiting(loop)
        loop.note("step 4")
        loop.note("step 5")
        loop.emit("done")
        waiter.join(timeout=10)
        assert not waiter.is_alive() and got == ["step 4", "step 5", "done"]
        loop.claim("b")  # a claim drops notes left unread too
        loop.note("old")
        loop.claim("c")
        assert loop.take(0, "c") == []
    finally:
        loop.stop()


def test_a_failing_step_stops_the_loop_and_fails_later_calls():
    def step() -> bool:
        raise ValueError("boom")

    loop = ReplicaLoop(step, "failing", idle_wait_s=0.01)
    deadline = time.monotonic() + 5
    while loop.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(loop.error, ValueError)
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(lambda: 1).result(timeout=1)


def test_split_cores_keeps_prefill_and_decode_apart():
    cores = split_cores(2, 1)
    if not cores:
        pytest.skip("one core: nothing to split")
    assert cores["p0"] == cores["p1"]
    assert not set(cores["p0"]) & set(cores["d0"])


def test_on_exit_runs_on_the_loop_thread_between_what_was_posted():
    seen: list[str] = []
    box: dict[str, ReplicaLoop] = {}

    def on_exit() -> None:
        assert box["loop"].stopping
        seen.append(f"exit on {threading.current_thread().name}")
        box["loop"].post(lambda: seen.append("after"))

    loop = box["loop"] = ReplicaLoop(lambda: False, "exiting", idle_wait_s=5.0, on_exit=on_exit)
    loop.post(lambda: seen.append("before"))
    loop.stop()
    assert seen == ["before", "exit on exiting", "after"] and not loop.is_alive()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_cpu_cores_pin_the_loop_thread_only():
    before = os.sched_getaffinity(0)
    core = max(before)
    loop = ReplicaLoop(lambda: False, "pinned", idle_wait_s=0.01, cpu_cores=[core])
    try:
        assert loop.call(lambda: os.sched_getaffinity(0)).result(timeout=5) == {core}
        assert os.sched_getaffinity(0) == before
    finally:
        loop.stop()
