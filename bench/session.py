"""A server a bench starts as a command of its own (``serve run``, vLLM's API server): in
its own session, so stopping it stops everything it started. ``start_session`` runs the
command with its output in a log; ``stop_session`` sends SIGINT (Ctrl-C: the server shuts
down cleanly), then SIGKILL to whatever of the session is left; ``stop_leftovers`` kills
every process whose command line names a folder (Ray's processes name their session
folder, whatever session they run in).

``paused(sessions)``: while a bench measures one server, every process of the other
servers' sessions is stopped (SIGSTOP) and continued (SIGCONT) after, whatever happened. On
a two-core machine a Meridian app at rest takes about 0.14 of a core (Ray's and Serve's
timers), which an interleaved run of another server would otherwise lose to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit


def start_session(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_session(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    try:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    finally:  # also when the bench is stopped (SIGTERM) during the grace period
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_leftovers(folder: Path) -> None:
    mark = str(folder).encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)


def exited(proc: subprocess.Popen[bytes]) -> str | None:
    """Why the server is gone (``app_probe.wait_for``'s ``gone``), or None while it runs."""
    return None if proc.poll() is None else f"exited with {proc.returncode}"


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ...; None
    once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def session_members(session: int) -> set[int]:
    """The pids of every process in session ``session`` (its leader's pid)."""
    members = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (fields := _stat(pid)) is not None and int(fields[3]) == session:
            members.add(int(pid))
    return members


def process_state(pid: int) -> str | None:
    """``/proc``'s one-letter state of ``pid`` (``T``: stopped), None once it is gone."""
    fields = _stat(pid)
    return None if fields is None else fields[0]


@contextlib.contextmanager
def paused(sessions: Iterable[int], timeout_s: float = 10.0) -> Iterator[set[int]]:
    """Every process of ``sessions`` (never this bench's own) stopped, from when each one
    is seen stopped until the block ends; then all continued, also when the block raises.
    Processes that a member starts while this stops the others are stopped too (the scan
    repeats until it finds none new). Yields the stopped pids."""
    stopped: set[int] = set()
    try:
        for session in set(sessions) - {os.getsid(0)}:  # never this bench's own session
            while new := session_members(session) - stopped:
                for pid in new:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                stopped |= new
        deadline = time.monotonic() + timeout_s
        waiting = set(stopped)
        while waiting := {p for p in waiting if process_state(p) not in (None, "T", "Z", "X")}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {sorted(waiting)} did not stop")
            time.sleep(0.001)  # no event tells another process's stop; a 1 ms poll
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def others_paused(
    sessions: Mapping[str, int], side: str
) -> contextlib.AbstractContextManager[set[int]]:
    """``paused`` for the sessions of the sides other than ``side`` (``sessions``: side
    name -> the session of its server on this machine; a side without one, such as a
    remote peer, is never paused). Two sides of one server share a session, which is then
    not paused for either."""
    own = sessions.get(side)
    return paused({s for s in sessions.values() if s != own})


def with_peer(sessions: Mapping[str, int], peer: str, url: str | None) -> dict[str, int]:
    """``sessions`` and, when ``url`` is served from this machine, ``peer``'s session."""
    found = server_session(url) if url else None
    return {**sessions, peer: found} if found is not None else dict(sessions)


def server_session(url: str) -> int | None:
    """The session of the process on this machine that listens on ``url``'s port (a peer
    server, started by hand or by this bench), None for another host, when no process here
    listens there, or when it runs in this bench's own session (never paused)."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or parts.port is None:
        return None
    port = parts.port
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # local address "HEXIP:HEXPORT", state 0A = LISTEN, inode
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        session = os.getsid(int(pid))
                        return None if session == os.getsid(0) else session
    return None
