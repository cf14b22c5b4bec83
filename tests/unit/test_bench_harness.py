"""The bench harness (``bench.sse``, ``bench.interleave``, ``bench.app_probe``): one SSE
parser that tells a complete stream from an error and from a cut one, one interleaving
order, one wait; and the one percentile definition every bench reports
(``sim.metrics.percentile``: numpy's default linear interpolation, q in 0-100); the
client re-run in a session of its own (``bench.client_session``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import numpy as np
import pytest

from bench.app_probe import free_port, wait_for
from bench.interleave import interleaved, median_ratio, medians, schedule, turns
from bench.serve_defaults import make_serve_env
from bench.sse import StreamCut, StreamError, sse_chunks, sse_json
from sim.metrics import percentile

LINES = ["", ": keep-alive", 'data: {"choices": [{"text": "a"}]}', "", "data:[DONE]", "data: x"]


def test_sse_json_reads_chunks_up_to_done():
    assert list(sse_json(LINES)) == [{"choices": [{"text": "a"}]}]


def test_sse_json_raises_on_an_error_chunk_and_on_a_cut_stream():
    with pytest.raises(StreamError) as e:
        list(sse_json(['data: {"error": {"message": "overloaded", "code": 429}}']))
    assert e.value.message == "overloaded"
    with pytest.raises(StreamCut):
        list(sse_json(LINES[:3]))


def test_sse_chunks_is_the_same_parser_async():
    async def lines(xs: list[str]) -> AsyncIterator[str]:
        for x in xs:
            yield x

    async def read(xs: list[str]) -> list[dict]:
        return [c async for c in sse_chunks(lines(xs))]

    assert asyncio.run(read(LINES)) == [{"choices": [{"text": "a"}]}]
    with pytest.raises(StreamCut):
        asyncio.run(read(LINES[:3]))


def test_turns_rotate_and_results_keep_repeat_order():
    assert [turns("AB", r) for r in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert turns("ABC", 4) == ["B", "C", "A"]
    assert turns("AB", 1, rotate=False) == ["A", "B"]
    order: list[tuple[str, int]] = []
    out = interleaved("AB", 2, lambda s, r: order.append((s, r)) or f"{s}{r}")
    assert order == [("A", 0), ("B", 0), ("B", 1), ("A", 1)]
    assert out == {"A": ["A0", "A1"], "B": ["B0", "B1"]}


def test_warmup_rounds_run_first_and_are_not_counted():
    assert list(schedule("AB", 2, rotate=False, warmup=1)) == [
        (-1, "A"),
        (-1, "B"),
        (0, "A"),
        (0, "B"),
        (1, "A"),
        (1, "B"),
    ]
    out = interleaved("AB", 1, lambda s, r: f"{s}{r}", rotate=False, warmup=2)
    assert out == {"A": ["A0"], "B": ["B0"]}


def test_medians_and_paired_ratio():
    assert medians([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 1.0}, {"x": 2.0, "y": 2.0}]) == {
        "x": 2.0,
        "y": 2.0,
    }
    assert median_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0
    assert medians([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 1.0}], ["y"]) == {"y": 3.0}
    # a peer that served nothing: its zero counts as inf, a pair of zeros is left out
    assert median_ratio([2.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]) == 2.0
    assert median_ratio([1.0, 1.0, 3.0], [0.0, 0.0, 1.0]) == float("inf")
    assert math.isnan(median_ratio([0.0], [0.0]))


def test_percentile_is_numpys_default():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_wait_for_answers_times_out_and_stops_when_gone():
    answers = iter([None, False, "model"])
    assert wait_for(lambda: next(answers), "the app", 5, every_s=0) == "model"
    with pytest.raises(TimeoutError, match="the app"):
        wait_for(lambda: None, "the app", 0, every_s=0)
    with pytest.raises(RuntimeError, match="exited with 1"):
        wait_for(lambda: None, "the app", 5, gone=lambda: "exited with 1", every_s=0)


def test_loop_watch_keeps_the_worst_lateness_the_run_queue_wait_and_the_cpu_time():
    import sys

    from bench.client_wait import LoopWatch, cpu_seconds, runqueue_seconds
    from bench.serve_records import Run

    readings = iter([1.0, 3.5])  # the thread's run-queue seconds at the start and the end
    ran = iter([4.0, 4.75])  # its seconds on a CPU
    calls = [0]

    def clock() -> float:
        """Each wake-up reads it twice: the second wakes 0.5 s after the first's start
        (0.01 s asked), every other one on time."""
        n = calls[0] = calls[0] + 1
        wake, end = divmod(n - 1, 2)
        late = 0.5 if wake == 1 else 0.01
        return 10.0 * wake + (late if end else 0.0)

    async def watched() -> LoopWatch:
        watch = LoopWatch(0.01, clock=clock, runqueue=lambda: next(readings), cpu=lambda: next(ran))
        task = asyncio.ensure_future(watch.run())
        while calls[0] < 8:  # four wake-ups measured
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return watch

    watch = asyncio.run(watched())
    assert watch.max_lag == pytest.approx(0.49) and watch.runqueue_s == pytest.approx(2.5)
    assert watch.cpu_s == pytest.approx(0.75)
    if sys.platform.startswith("linux"):  # the kernel's counts for this thread
        assert isinstance(runqueue_seconds(), float)
        before = cpu_seconds()
        sum(i * i for i in range(200_000))  # some CPU time on this thread
        after = cpu_seconds()
        assert before is not None and after is not None and after > before
    run = Run("x", 1, duration=1.0)
    assert "client_lag" not in run.metrics()  # not measured: no row
    run.client_lag, run.client_runqueue, run.client_cpu = watch.max_lag, 2.5, 0.75
    m = run.metrics()
    assert m["client_lag"] == pytest.approx(490.0) and m["client_runqueue"] == 2.5
    assert m["client_cpu"] == 0.75


def test_a_bench_stopped_during_the_grace_period_still_kills_the_server_session(tmp_path):
    """SIGTERM to a bench raises SystemExit; a server that ignores SIGINT must not outlive
    it (``stop_session`` kills the session on the way out)."""
    import os
    import signal
    import sys
    import threading

    from bench.session import start_session, stop_session

    server = start_session(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "open('ready', 'w').close(); time.sleep(600)",
        ],
        tmp_path / "log",
        cwd=tmp_path,
    )
    try:
        while server.poll() is None and not (tmp_path / "ready").exists():
            threading.Event().wait(0.01)

        def stop_bench(*_: object) -> None:
            raise SystemExit(143)

        previous = signal.signal(signal.SIGUSR1, stop_bench)
        try:
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            with pytest.raises(SystemExit):
                stop_session(server, grace_s=60)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert server.poll() is not None  # killed, not left running
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_make_serve_env_reads_the_variables_of_a_continued_serve_recipe(tmp_path):
    makefile = tmp_path / "Makefile"
    makefile.write_text(
        "serve: $(STAMP)\n"
        "\t$(COMPILE)\n"
        "\tA=1 B='two words' \\\n"
        "\tC=3 \\\n"
        "\t$(VENV)/bin/serve run $(CONFIG)\n"
        "\n"
        "test: $(STAMP)\n"
        "\tD=4 $(VENV)/bin/serve run other.yaml\n"
    )
    assert make_serve_env(makefile) == {"A": "1", "B": "two words", "C": "3"}


RERUN_SCRIPT = """
import os, signal, sys
from bench.client_session import AUTOGROUP, autogroups, rerun_as_client
status = rerun_as_client(5)
if status is not None:
    print("caller", os.getsid(0), flush=True)
    sys.exit(status)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
nice = AUTOGROUP.read_text().split()[-1] if autogroups() else os.getpriority(os.PRIO_PROCESS, 0)
print("rerun", os.getsid(0), nice, flush=True)
if sys.argv[1:] == ["wait"]:
    signal.pause()
sys.exit(7)
"""


def _rerun(*argv: str):
    import os
    import subprocess
    import sys

    from bench.client_session import RERUN

    env = {k: v for k, v in os.environ.items() if k != RERUN}
    cmd = [sys.executable, "-c", RERUN_SCRIPT, *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def test_the_bench_client_reruns_in_a_session_of_its_own_at_the_asked_priority():
    """A raised nice (5) needs no privilege: the re-run is in a new session whose priority
    is 5, and the command the user ran exits with the re-run's status."""
    proc = _rerun()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7
    said, rerun, caller = out.splitlines()
    assert said.startswith("client: its own session,") and said.endswith(" nice 5")
    _, rerun_sid, nice = rerun.split()
    _, caller_sid = caller.split()
    assert rerun_sid != caller_sid and nice == "5"


def test_a_signal_to_the_bench_reaches_its_rerun():
    import signal

    proc = _rerun("wait")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("client:")
    assert proc.stdout.readline().startswith("rerun")  # its SIGTERM handler is set
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143


def test_nice_0_reruns_nothing():
    from bench.client_session import rerun_as_client

    assert rerun_as_client(0) is None


def test_ports_handed_out_never_overlap_and_were_free():
    """Two apps started side by side (a proxy port and a 51-port direct range each) never
    get one another's ports."""
    import socket

    ranges = []
    for span in (1, 51, 1, 51, 3):
        first = free_port(span)
        ranges.append(range(first, first + span))
    for i, a in enumerate(ranges):
        for b in ranges[i + 1 :]:
            assert a.stop <= b.start or b.stop <= a.start, (a, b)
    for p in ranges[1]:  # free when handed out: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


EXPOSITION = """# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3584.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.79e+09
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 11344.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 7.0
"""


def test_prefix_hits_sum_every_prefix_cache_hit_counter_and_none_without_one():
    from bench.serve_chat import prefix_hits_total

    # the external (connector) counter ends in the same name and is counted: its tokens
    # were not computed either
    assert prefix_hits_total(EXPOSITION) == 3584.0 + 16.0 + 7.0
    assert prefix_hits_total("# HELP x\nrequests_total 3\n") is None


def test_cached_prompt_tokens_prefers_usage_then_the_counter_else_unknown():
    from bench.serve_chat import cached_prompt_tokens
    from bench.serve_records import Sample

    def sample(cached: int | None) -> Sample:
        return Sample(0.1, 0.2, [], 4, prompt_tokens=100, cached_tokens=cached)

    assert cached_prompt_tokens([sample(32), sample(0)], None, None) == 32
    assert cached_prompt_tokens([sample(32), sample(None)], 10.0, 74.0) == 64
    assert math.isnan(cached_prompt_tokens([sample(None)], None, 74.0))
    assert math.isnan(cached_prompt_tokens([], None, None))


def test_an_invocation_draws_a_fresh_seed_unless_given_and_prints_it(capsys):
    from bench.interleave import invocation_seed

    assert invocation_seed(7, "prompts") == 7
    drawn = {invocation_seed(None, "prompts") for _ in range(4)}
    assert len(drawn) > 1 and all(0 <= s < 2**31 for s in drawn)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "prompts: drawn with seed 7 (--seed 7 draws them again)"
    assert len(printed) == 5


def _until(check, what: str, timeout_s: float = 10.0) -> None:
    """Polls ``check`` (another process's state has no event to wait on)."""
    import threading
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.005)


def test_paused_stops_a_whole_session_and_continues_it_even_when_the_block_raises(tmp_path):
    """A server session of two processes (the leader and a child it started): inside
    ``paused`` both are stopped, after it both run again, also after an exception; the
    bench's own process is never among them."""
    import os
    import signal
    import sys

    from bench.session import (
        others_paused,
        paused,
        process_state,
        session_members,
        start_session,
    )

    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open('ready', 'w').write(str(child.pid)); time.sleep(600)"
    )
    server = start_session([sys.executable, "-c", script], tmp_path / "log", cwd=tmp_path)
    try:
        _until(lambda: (tmp_path / "ready").exists() and (tmp_path / "ready").read_text(), "ready")
        child = int((tmp_path / "ready").read_text())
        assert session_members(server.pid) == {server.pid, child}
        for _ in range(2):
            with pytest.raises(RuntimeError, match="inside"), paused([server.pid]) as stopped:
                assert stopped == {server.pid, child}
                assert process_state(server.pid) == process_state(child) == "T"
                assert os.getpid() not in stopped
                raise RuntimeError("inside")
            _until(
                lambda: process_state(server.pid) != "T" and process_state(child) != "T",
                "continued",
            )
        # two sides of one server (with and without a hog) never pause it; a peer's run does
        with others_paused({"meridian": server.pid, "with-hog": server.pid}, "with-hog") as s:
            assert s == set() and process_state(server.pid) != "T"
        with others_paused({"meridian": server.pid}, "peer") as s:
            assert s == {server.pid, child} and process_state(child) == "T"
        with paused([os.getsid(0)]) as s:  # the bench's own session: never
            assert s == set()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_server_session_finds_the_session_of_a_local_listener_and_never_the_bench_own(tmp_path):
    import os
    import signal
    import socket
    import sys

    from bench.session import server_session, start_session, with_peer

    port = free_port()
    script = (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); "
        "open('ready', 'w').close(); time.sleep(600)"
    )
    server = start_session([sys.executable, "-c", script], tmp_path / "log", cwd=tmp_path)
    try:
        _until(lambda: (tmp_path / "ready").exists(), "listening")
        assert server_session(f"http://127.0.0.1:{port}/v1") == server.pid
        assert server_session(f"http://localhost:{port}") == server.pid
        assert server_session(f"http://10.1.2.3:{port}") is None  # another host
        url = f"http://127.0.0.1:{port}"
        assert with_peer({"meridian": 1}, "vllm", url) == {"meridian": 1, "vllm": server.pid}
        assert with_peer({"meridian": 1}, "vllm", None) == {"meridian": 1}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert server_session(f"http://127.0.0.1:{port}") is None  # nobody listens now
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen()
    try:  # a listener in the bench's own session is never to be paused
        assert server_session(f"http://127.0.0.1:{own.getsockname()[1]}") is None
    finally:
        own.close()
