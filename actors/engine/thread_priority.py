"""An engine thread as the OS sees it: normal priority (nice 0) and a name.

Ray starts its worker processes at nice ``worker_niceness`` (15 by default) and a thread
inherits its creator's nice value, so without this a replica's engine thread gives its core
to any nice-0 process on the node. Every engine thread (the replica loop of colocated,
prefill and decode replicas; the MoE attention and expert workers' rounds) calls
``run_at_normal_priority()`` first; threads it starts later (torch's intra-op pool) inherit
nice 0. The Serve app's own processes (ingress, router, replica) run all their threads at
nice 0 (``run_process_at_normal_priority``), as RAY_worker_niceness=0 would make them.

Linux only (elsewhere a no-op). Lowering a nice value needs CAP_SYS_NICE or RLIMIT_NICE of
20 (``ulimit -e``); where neither holds the thread keeps its priority and one line per
process says how to fix it (``FIX``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from actors.engine.defaults import ENGINE_NICE

log = logging.getLogger(__name__)

FIX = (
    "this Meridian process runs at nice {nice} (Ray's worker_niceness) and may not raise "
    "its threads' priority: start Ray with RAY_worker_niceness=0, or give its processes "
    "CAP_SYS_NICE or an RLIMIT_NICE of 20 (ulimit -e 20)"
)
_warned = threading.Event()
_done = threading.local()


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def run_at_normal_priority() -> int | None:
    """Set the calling thread to nice ``ENGINE_NICE`` (0) unless it already runs there or
    better; returns the nice value it runs at now (None where unsupported). A refusal is
    logged once per process (``FIX``), never raised."""
    if not supported():
        return None
    tid = threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    if nice <= ENGINE_NICE:
        return nice
    try:
        os.setpriority(os.PRIO_PROCESS, tid, ENGINE_NICE)
    except PermissionError:
        _refused(nice)
        return nice
    return ENGINE_NICE


def run_process_at_normal_priority() -> None:
    """Every thread of this process (and the threads they start later) at nice 0: for the
    Serve app's own processes (ingress, router, replica), whose request handling would
    otherwise run at Ray's worker niceness beside the nice-0 engine and clients, as if Ray
    had been started with RAY_worker_niceness=0. A refusal is logged once (``FIX``)."""
    if not supported():
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        tids = [threading.get_native_id()]
    for tid in tids:
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            if nice > ENGINE_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, ENGINE_NICE)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except PermissionError:
            _refused(nice)
            return


def _refused(nice: int) -> None:
    if not _warned.is_set():
        _warned.set()
        log.warning(FIX.format(nice=nice))


def once_on_this_thread() -> None:
    """``run_at_normal_priority()`` the first time a thread calls this; later calls cost a
    thread-local lookup (for methods a thread that we do not start runs, e.g. a compiled
    graph's execution loop)."""
    if not getattr(_done, "set", False):
        _done.set = True
        run_at_normal_priority()


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 characters) in ``/proc``, ``top -H``
    and ``ps -L``, so an engine thread can be found from outside its process."""
    if not supported():
        return
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:  # no /proc: the name is only cosmetic
        pass
