"""Where the decode replica's time goes while a long prompt prefills, through HTTP
(``bench/pd_isolation.py --http --profile``, on the P/D app's runs).

Two readings, both from outside the server:

- per part of the system (decode / prefill replica's engine thread and other threads, the
  P/D Serve replica that runs the Conductor, ingress, router, Serve proxy and controller,
  raylet + GCS, the client, other work on the machine): CPU-seconds per second (field 1 of
  ``/proc/<pid>/task/<tid>/schedstat``, ns on a core) and runqueue wait per second (field
  2, ns runnable but waiting for a core), "before" (the short requests decoding alone) and
  "during" (the long prompt's prefill), and each engine thread's cores (field 39 of its
  ``stat``, the CPU it last ran on, sampled every ``SAMPLE_S``). A separate process reads
  them, so the client's own timing is not held up by the reading.
- per gap of a short request's stream above ``GAP_X`` x the P/D p50 before (or the engine's
  p50 step interval before, if larger: tokens that reach the client in one chunk make the
  client's p50 0), during the prefill: how much of its excess over that p50 was the decode
  engine's own step being late (``DecodeReplica.step_times``: each step's start and end on
  the replica's clock, CLOCK_MONOTONIC as the client's) and how much the token's way to the
  client (replica -> Conductor -> ingress -> client). The engine's share of a gap is the
  longest interval between consecutive step ends that ends inside the gap, less the engine's
  own p50 interval before; the rest is delivery.

The Serve processes are those under the ``serve run`` process (its pid from ``serve_run``),
told apart by the title Ray gives each (``ray::ServeReplica:<app>:<deployment>``,
``ray::DecodeReplica``, ...); engine threads by the name their loop gives them.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from bench.proc_table import descendants, processes, serve_process, stat_fields
from sim.metrics import percentile

TICK = os.sysconf("SC_CLK_TCK")  # /proc/stat's units per second
MACHINE = "machine"  # every core's CPU time, for the other-work row
SAMPLE_S = 0.005  # the engine threads' sampling period
GAP_X = 2.0  # a gap above this many times the p50 before is split

DECODE_ENGINE, PREFILL_ENGINE, CONDUCTOR_LOOP = "decode engine", "prefill engine", "P/D loop"
ROWS = (
    DECODE_ENGINE,
    "decode other threads",
    PREFILL_ENGINE,
    "prefill other threads",
    CONDUCTOR_LOOP,
    "P/D Serve replica other",
    "ingress",
    "router",
    "Serve proxy",
    "Serve controller",
    "raylet + GCS",
    "Ray other",
    "client",
    "profiler",
    "other work",
)
OTHER = ROWS[-1]
ENGINE_ROWS = (DECODE_ENGINE, PREFILL_ENGINE, CONDUCTOR_LOOP)

Key = tuple[int, int]  # (pid, tid)


def _role(cmdline: str, comm: str, pid: int, ours: set[int], client: int) -> str:
    if pid == client:
        return "client"
    if pid == os.getpid():
        return "profiler"
    if pid not in ours:
        return "other work"
    if "DecodeReplica" in cmdline:
        return DECODE_ENGINE if comm.startswith("decode-") else "decode other threads"
    if "PrefillReplica" in cmdline:
        return PREFILL_ENGINE if comm.startswith("prefill-") else "prefill other threads"
    part = serve_process(cmdline)
    if part == "replica":
        return CONDUCTOR_LOOP if comm == "meridian-engine" else "P/D Serve replica other"
    return part


def threads(root: int, client: int) -> dict[Key, str]:
    """Every thread of the app, the client and the profiler, and its row (other work is
    the machine's CPU time less theirs: reading every thread of a busy machine takes too
    long)."""
    parents, cmdlines = processes()
    ours = descendants(root, parents)
    out = {}
    for pid, cmdline in cmdlines.items():
        if pid not in ours and pid not in (client, os.getpid()):
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    out[(pid, int(tid))] = _role(cmdline, comm, pid, ours, client)
    return out


def read_thread(key: Key) -> tuple[int, int, int] | None:
    """(run ns, runqueue-wait ns, last CPU) of a thread, None once it is gone."""
    pid, tid = key
    try:
        run, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
        cpu = stat_fields(Path(f"/proc/{pid}/task/{tid}/stat").read_text())[36]
    except (OSError, ValueError, IndexError):
        return None
    return int(run), int(wait), int(cpu)


def snapshot(roles: dict[Key, str]) -> dict[str, tuple[int, int]]:
    """Each row's (run ns, wait ns) so far, summed over its threads."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, role in roles.items():
        got = read_thread(key)
        if got is not None:
            out[role][0] += got[0]
            out[role][1] += got[1]
    out[MACHINE] = [machine_cpu_ns(), 0]
    return {k: (v[0], v[1]) for k, v in out.items()}


def machine_cpu_ns() -> int:
    """CPU time of every core so far, idle and iowait left out (``/proc/stat``), ns."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))
    return busy * 1_000_000_000 // TICK


def _sampler(conn: Connection, root: int, client: int) -> None:
    """The profiler process. Messages: "refresh" (find the threads again, forget what was
    read; answers "ok"), a mark's name (a snapshot of every row, with its time), "stop"
    (answers the marks and samples), "exit". Between messages the engine threads'
    (time, run ns, wait ns, CPU) every ``SAMPLE_S``."""
    roles: dict[Key, str] = {}
    engines: dict[Key, str] = {}
    marks: list[tuple[str, float, dict[str, tuple[int, int]]]] = []
    samples: dict[str, list[tuple[float, int, int, int]]] = defaultdict(list)
    while True:
        if conn.poll(SAMPLE_S):
            msg = conn.recv()
            if msg == "exit":
                return
            if msg == "stop":
                conn.send((marks, dict(samples)))
            elif msg == "refresh":
                roles = threads(root, client)
                engines = {k: r for k, r in roles.items() if r in ENGINE_ROWS}
                marks, samples = [], defaultdict(list)
                conn.send("ok")
            else:
                marks.append((msg, time.monotonic(), snapshot(roles)))
            continue
        now = time.monotonic()
        for key, role in engines.items():
            got = read_thread(key)
            if got is not None:
                samples[role].append((now, *got))


@dataclass
class RunProfile:
    """What the profiler saw during one run: marks ``start`` (every short request has its
    first token), ``arrival`` (the long prompt sent), ``first`` (its first token)."""

    marks: dict[str, tuple[float, dict[str, tuple[int, int]]]]
    samples: dict[str, list[tuple[float, int, int, int]]]

    def rates(self, a: str, b: str) -> dict[str, tuple[float, float]]:
        """Per row: (CPU-s/s, wait-s/s) between marks ``a`` and ``b`` (engine threads from
        their samples, the rest from the marks' snapshots)."""
        (ta, sa), (tb, sb) = self.marks[a], self.marks[b]
        span = max(tb - ta, 1e-9)
        out = {}
        for row in ROWS:
            r0, w0 = sa.get(row, (0, 0))
            r1, w1 = sb.get(row, (0, 0))
            out[row] = ((r1 - r0) / 1e9 / span, (w1 - w0) / 1e9 / span)
        for row in ENGINE_ROWS:  # from the samples: each read at its own time
            pts = [x for x in self.samples.get(row, []) if ta <= x[0] <= tb]
            dt = pts[-1][0] - pts[0][0] if pts else 0.0
            if dt > 0:  # two samples at least, at different times (a starved sampler: one)
                out[row] = (
                    (pts[-1][1] - pts[0][1]) / 1e9 / dt,
                    (pts[-1][2] - pts[0][2]) / 1e9 / dt,
                )
        machine = (sb[MACHINE][0] - sa[MACHINE][0]) / 1e9 / span
        ours = sum(cpu for row, (cpu, _) in out.items() if row != OTHER)
        out[OTHER] = (max(0.0, machine - ours), float("nan"))  # its wait is not read
        return out

    def cores(self, row: str, a: str, b: str) -> dict[int, float]:
        """The share of ``row``'s samples between marks ``a`` and ``b`` on each CPU
        (weighted by its run time in each sample interval; idle samples do not count)."""
        ta, tb = self.marks[a][0], self.marks[b][0]
        pts = [s for s in self.samples.get(row, []) if ta <= s[0] <= tb]
        ran: dict[int, float] = defaultdict(float)
        for p, q in zip(pts, pts[1:], strict=False):
            ran[q[3]] += q[1] - p[1]
        total = sum(ran.values())
        return {c: v / total for c, v in sorted(ran.items())} if total else {}


class Profiler:
    """The profiler process for one ``serve run`` (``root``: its pid); one run at a time:
    ``start()``, ``mark(name)`` at ``start``, ``arrival``, ``first``, then ``collect()``."""

    def __init__(self, root: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sampler, args=(child, root, os.getpid()), daemon=True)
        self._proc.start()

    def start(self) -> None:
        self._conn.send("refresh")
        self._conn.recv()

    def mark(self, name: str) -> None:
        self._conn.send(name)

    def collect(self) -> RunProfile:
        self._conn.send("stop")
        marks, samples = self._conn.recv()
        return RunProfile({n: (t, snap) for n, t, snap in marks}, samples)

    def close(self) -> None:
        self._conn.send("exit")
        self._proc.join(timeout=10)


@dataclass
class GapSplit:
    """Excess over the p50 before (s) of the gaps above ``GAP_X`` x it, summed."""

    gaps: int = 0
    excess: float = 0.0
    engine: float = 0.0
    worst: list[tuple[float, float]] = field(default_factory=list)  # (gap, engine share)

    @property
    def delivery(self) -> float:
        return self.excess - self.engine


def split_gaps(
    times: list[list[float]],
    arrival: float,
    first: float,
    steps: list[tuple[float, float]],
    p50_before: float,
) -> tuple[GapSplit, float, float]:
    """The excess of the client's long gaps during the prefill, engine-side against
    delivery; also the engine's own p50 step interval before and p99 during."""
    ends = sorted(e for _, e in steps)
    intervals = [(b, b - a) for a, b in zip(ends, ends[1:], strict=False)]
    before = [d for t, d in intervals if t < arrival and d < 1.0]  # 1 s: an idle pause
    during = [d for t, d in intervals if arrival <= t <= first]
    engine_p50 = percentile(before, 50) if before else 0.0
    engine_p99 = percentile(during, 99) if during else 0.0
    # tokens that reach the client in one chunk make its p50 0: then the engine's pace
    ref = max(p50_before, engine_p50)
    out = GapSplit()
    for ts in times:
        for a, b in zip(ts, ts[1:], strict=False):
            gap = b - a
            if not (arrival <= b <= first) or gap <= GAP_X * ref:
                continue
            inside = [d for t, d in intervals if a < t <= b]
            late = max(0.0, max(inside, default=0.0) - engine_p50)
            excess = gap - ref
            share = min(late, excess)
            out.gaps += 1
            out.excess += excess
            out.engine += share
            out.worst.append((gap, share))
    out.worst.sort(reverse=True)
    return out, engine_p50, engine_p99


def gcs_address(root: int) -> str | None:
    """The GCS address of the Ray cluster that ``serve run`` (``root``) started."""
    parents, cmdlines = processes()
    for pid in descendants(root, parents):
        for arg in cmdlines.get(pid, "").split():
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    return None


STEP_TIMES_SCRIPT = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
out = []
for actor in ray.util.list_named_actors(all_namespaces=True):
    name = actor["name"]  # pd-d<j>-<unique>, or in a pool <pool>/d<j>/<unique>
    rid = name.split("/")[-2] if name.count("/") >= 2 else ""
    if name.startswith("pd-d") or (rid[:1] == "d" and rid[1:].isdigit()):
        handle = ray.get_actor(name, namespace=actor["namespace"])
        out += ray.get(handle.step_times.remote(), timeout=60)
print(json.dumps(out))
"""


def decode_step_times(root: int) -> list[tuple[float, float]]:
    """Every decode replica's kept step times, from a driver attached to the app's Ray
    cluster (its P/D replicas are named ``pd-<id>-<unique>``, or ``<pool>/<id>/<unique>``
    in a shared pool (``pool_actors``); decode ids ``d<j>``); a
    process of its own, started as the cluster's are (token authentication on)."""
    address = gcs_address(root)
    if address is None:
        raise RuntimeError("no raylet under the serve run process names its GCS address")
    out = subprocess.run(
        [sys.executable, "-c", STEP_TIMES_SCRIPT, address],
        env=os.environ | {"RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    if out.returncode != 0:
        raise RuntimeError(f"reading the decode replicas' step times failed: {out.stderr[-2000:]}")
    steps = [(a, b) for a, b in json.loads(out.stdout.strip().splitlines()[-1])]
    if not steps:
        raise RuntimeError("no decode replica of the app's cluster kept a step time")
    return steps


def print_table(profiles: list[RunProfile]) -> None:
    """Per row, medians over runs: CPU-s/s and wait-s/s before and during; engine
    threads' cores during."""
    load = os.getloadavg()[0]
    print(f"\nwhere the P/D app's time goes (median over runs; load now {load:.1f}), per s")
    heads = ("CPU before", "wait before", "CPU during", "wait during")
    print(f"{'':26s} " + " ".join(f"{h:>11s}" for h in heads))
    before = [p.rates("start", "arrival") for p in profiles]
    during = [p.rates("arrival", "first") for p in profiles]
    for row in ROWS:
        figs = [
            statistics.median(r[row][k] for r in rates)
            for rates in (before, during)
            for k in (0, 1)
        ]
        if max(x for x in figs if x == x) < 0.005:  # x == x: not the NaN of other work
            continue
        print(f"{row:26s} " + " ".join(f"{x:11.2f}" for x in figs))
    for row in ENGINE_ROWS:
        for a, b, label in (("start", "arrival", "before"), ("arrival", "first", "during")):
            shares: dict[int, list[float]] = defaultdict(list)
            for p in profiles:
                for cpu, share in p.cores(row, a, b).items():
                    shares[cpu].append(share)
            text = ", ".join(
                f"cpu{c} {statistics.median(v) * 100:.0f}%" for c, v in sorted(shares.items())
            )
            print(f"{row} ran {label}: {text or '-'}")
