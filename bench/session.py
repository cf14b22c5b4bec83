"""A server a bench starts as a command of its own (``serve run``, vLLM's API server): in
its own session, so stopping it stops everything it started. ``start_session`` runs the
command with its output in a log; ``stop_session`` sends SIGINT (Ctrl-C: the server shuts
down cleanly), then SIGKILL to whatever of the session is left; ``stop_leftovers`` kills
every process whose command line names a folder (Ray's processes name their session
folder, whatever session they run in)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


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
