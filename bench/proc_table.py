"""The machine's processes as ``/proc`` shows them, for the benches' CPU profiles
(``bench/serve_profile.py``, ``bench/pd_profile.py``). Linux only."""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path


def stat_fields(text: str) -> list[str]:
    """A ``stat`` file's fields after ``comm`` (which may hold spaces and parentheses):
    index 0 is field 3 (state), 1 the parent pid, 11 and 12 utime and stime."""
    return text[text.rindex(")") + 2 :].split()


def processes() -> tuple[dict[int, int], dict[int, str]]:
    """(pid -> parent pid, pid -> command line with spaces between its arguments) of every
    process readable now."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(entry)
            parents[pid] = int(stat_fields(Path(f"/proc/{pid}/stat").read_text())[1])
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            cmdlines[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return parents, cmdlines


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parents.items():
        children[ppid].append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children[pid])
    return out


def serve_process(cmdline: str) -> str:
    """The part of a Serve app that a Ray process of it is, by the title Ray gives it:
    ingress, router, replica (any other deployment), Serve proxy, Serve controller, raylet
    + GCS, or Ray other."""
    if "ServeReplica:" in cmdline:
        deployment = cmdline.split("ServeReplica:", 1)[1].split()[0].lower()
        if "ingress" in deployment:
            return "ingress"
        if "router" in deployment:
            return "router"
        return "replica"
    if "ProxyActor" in cmdline:
        return "Serve proxy"
    if "ServeController" in cmdline:
        return "Serve controller"
    if "raylet" in cmdline or "gcs_server" in cmdline:
        return "raylet + GCS"
    return "Ray other"
