"""The bench client in a session of its own, run ahead of the servers it measures: to tell
the client's own wait from the servers' gaps.

On a small node the engines keep every core busy, and the bench's client (reading its
streams, stamping each chunk) waits for a CPU like any other process. Under Linux's
per-session autogroups that wait reached seconds (``bench/client_wait.py``). A bench whose
servers run in sessions of their own (``serve run`` and vLLM's server, started with
``bench/session.py``; a ``--base-url`` server) can run its client again in a new session
and raise that session's priority (``--client-nice``): the client then waits for nothing,
but it takes its CPU from the servers the moment it wants it, which a client on another
machine would not. Neither setting is a remote client; comparing the two says which part
of a tail is the client's. Off by default.

    status = rerun_as_client(nice)   # in the command the user ran: its exit status
    if status is not None:
        sys.exit(status)
    # here: the re-run, in its own session at ``nice``

Raising a priority (a negative nice) needs CAP_SYS_NICE (root has it); without it the
re-run says so and runs at its old priority.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

RERUN = "MERIDIAN_BENCH_CLIENT_SESSION"  # set in the re-run's environment: run, do not rerun
AUTOGROUP = Path("/proc/self/autogroup")
AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def rerun_as_client(nice: int) -> int | None:
    """In the command the user ran: run it again (``sys.orig_argv``, same directory and
    environment) in a new session whose priority is ``nice``, forward SIGINT and SIGTERM
    to it, and return its exit status. In that re-run: set its session's priority (one line
    says how) and return None, as with ``nice`` 0 (nothing done): the caller goes on."""
    if nice == 0:
        return None
    if os.environ.get(RERUN):
        print(raise_session_priority(int(os.environ[RERUN])), flush=True)
        return None
    started: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []  # signals that came before the re-run existed

    def forward(signum: int, _frame: object) -> None:
        if started:
            started[0].send_signal(signum)
        else:
            pending.append(signum)

    # set before the re-run starts: a signal must never end this command and leave the
    # re-run (in a session of its own, out of the terminal's reach) running
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    child = subprocess.Popen(
        sys.orig_argv, env=os.environ | {RERUN: str(nice)}, start_new_session=True
    )
    started.append(child)
    for signum in pending:
        child.send_signal(signum)
    return child.wait()  # a forwarded signal does not end the wait: the child ends it


def autogroups() -> bool:
    """Whether the kernel schedules sessions as groups (Linux's autogroups, on)."""
    try:
        return AUTOGROUP_SWITCH.read_text().strip() == "1" and AUTOGROUP.exists()
    except OSError:
        return False


def raise_session_priority(nice: int) -> str:
    """Set this process's session to ``nice``: its autogroup where the kernel groups by
    session, else the process itself (and the threads it starts later). A line saying what
    it did, or why it could not."""
    grouped = autogroups()
    try:
        if grouped:
            AUTOGROUP.write_text(str(nice))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        return f"client: its own session, priority unchanged ({e}: needs CAP_SYS_NICE)"
    what = "autogroup nice" if grouped else "nice"
    return f"client: its own session, {what} {nice}"
