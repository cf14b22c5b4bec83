"""Memory of the soak's app (``bench/soak.py``), read at the start and the end of a soak to
show that nothing leaks or grows without bound: every process of this driver's Ray cluster
(the driver's descendants: GCS, raylet, Serve, replicas and their workers, pool replicas,
store shards) with its resident and proportional set sizes, and the node's shared memory
(``/dev/shm``): the KV segments of live processes of the cluster, segments whose creator is
gone, and the folder's use by everyone on the node. Linux only."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from bench.proc_table import descendants, processes
from store.shared_segment import DEFAULT_SHM_DIR, PREFIX

MIB = 1 << 20


@dataclass(frozen=True)
class ProcMemory:
    pid: int
    part: str  # what the process is: its Ray title (``ray::Worker`` -> worker) or binary
    rss: int  # bytes resident
    pss: int  # bytes resident, each shared page split among the processes that map it


@dataclass(frozen=True)
class MemorySnapshot:
    procs: dict[int, ProcMemory]
    shm_ours: int  # bytes of KV segments whose creator is a live process of the cluster
    shm_orphaned: int  # bytes of KV segments whose creator is gone
    shm_used: int  # bytes in use in the shared-memory folder, everyone's


def part_of(cmdline: str, pid: int) -> str:
    """``ray::ServeReplica:meridian:Replica-main`` -> ``Replica-main``, ``ray::Worker`` ->
    ``Worker``; else the binary's name (raylet, gcs_server, python for the driver)."""
    if pid == os.getpid():
        return "soak driver"
    if cmdline.startswith("ray::"):
        title = cmdline[5:].split()[0] if cmdline[5:].strip() else "idle"
        if title.startswith("ServeReplica:"):
            title = title.rsplit(":", 1)[-1]
        return title.split(".", 1)[0]
    first = cmdline.split()[0] if cmdline else "?"
    return Path(first).name


def _rollup(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) bytes of a live process; None when gone or unreadable."""
    fields: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "Rss" not in fields or "Pss" not in fields:
        return None
    return fields["Rss"], fields["Pss"]


def snapshot(shm_dir: str = DEFAULT_SHM_DIR) -> MemorySnapshot:
    parents, cmdlines = processes()
    ours = descendants(os.getpid(), parents)
    procs: dict[int, ProcMemory] = {}
    for pid in sorted(ours):
        sizes = _rollup(pid)
        if sizes is not None:
            procs[pid] = ProcMemory(pid, part_of(cmdlines.get(pid, ""), pid), *sizes)
    shm_ours = shm_orphaned = 0
    for path in Path(shm_dir).glob(PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            used = path.stat().st_blocks * 512
            creator = int(path.name[len(PREFIX) :].split("-", 1)[0])
            if creator in ours:
                shm_ours += used
            elif creator not in parents:
                shm_orphaned += used
    st = os.statvfs(shm_dir)
    return MemorySnapshot(procs, shm_ours, shm_orphaned, (st.f_blocks - st.f_bfree) * st.f_frsize)


def memory_table(start: MemorySnapshot, end: MemorySnapshot) -> str:
    """Per part (processes of one kind summed) at the start and the end: processes, RSS and
    PSS in MiB; then each process alive at both ends whose PSS grew most; then
    ``/dev/shm``."""

    def by_part(snap: MemorySnapshot) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = {}
        for p in snap.procs.values():
            n, rss, pss = out.get(p.part, (0, 0, 0))
            out[p.part] = (n + 1, rss + p.rss, pss + p.pss)
        return out

    a, b = by_part(start), by_part(end)
    rows = [("part", "procs start/end", "RSS MiB start/end", "PSS MiB start/end")]
    for part in sorted(set(a) | set(b)):
        n0, r0, p0 = a.get(part, (0, 0, 0))
        n1, r1, p1 = b.get(part, (0, 0, 0))
        rows.append(
            (part, f"{n0}/{n1}", f"{r0 / MIB:.0f}/{r1 / MIB:.0f}", f"{p0 / MIB:.0f}/{p1 / MIB:.0f}")
        )
    total0 = sum(p.pss for p in start.procs.values())
    total1 = sum(p.pss for p in end.procs.values())
    rows.append(
        (
            "all",
            f"{len(start.procs)}/{len(end.procs)}",
            "",
            f"{total0 / MIB:.0f}/{total1 / MIB:.0f}",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    kept = sorted(
        (end.procs[pid].pss - p.pss, pid) for pid, p in start.procs.items() if pid in end.procs
    )
    for grew, pid in reversed(kept[-3:]):
        p0, p1 = start.procs[pid], end.procs[pid]
        lines.append(
            f"grew most: {p1.part} pid {pid}: PSS {p0.pss / MIB:.0f} -> {p1.pss / MIB:.0f} MiB "
            f"({grew / MIB:+.0f})"
        )
    for name, s0, s1 in (
        ("KV segments of live processes", start.shm_ours, end.shm_ours),
        ("KV segments of dead processes", start.shm_orphaned, end.shm_orphaned),
        ("in use by everyone on the node", start.shm_used, end.shm_used),
    ):
        lines.append(f"/dev/shm {name}: {s0 / MIB:.1f} -> {s1 / MIB:.1f} MiB")
    return "\n".join(lines)
