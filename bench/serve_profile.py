"""Where the machine's cores go during a run, for ``bench/serve.py --cpu-profile``: every
thread's CPU time (``utime + stime`` of ``/proc/<pid>/task/<tid>/stat``) and the time it
waited runnable for a core (the second field of its ``schedstat``), read before and after
each run, the deltas summed by the part of the system the thread belongs to.

Parts of Meridian's server are the processes under the ``serve run`` process (``root``),
told apart by the title Ray gives each worker (``ray::ServeReplica:<app>:<deployment>``,
``ray::ProxyActor``, ...); a replica's engine thread is the one its loop names
``meridian-engine`` (``thread_priority.name_this_thread``). A vLLM peer's processes are
its API server and its ``VLLM::`` engine processes. The bench process is the client.
Everything else on the machine (other work) is one row, so a reading on a busy machine
says how busy it was.

Two snapshots a run, a few milliseconds each; nothing is sampled while the run goes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.proc_table import descendants, processes, serve_process, stat_fields

TICK = os.sysconf("SC_CLK_TCK")  # utime / stime units per second
ENGINE_THREAD = "meridian-engine"

ENGINE = "engine threads"
SERVING = (  # Meridian's parts outside its engine threads, in print order
    "replicas' other threads",
    "ingress",
    "router",
    "Serve proxy",
    "Serve controller",
    "raylet + GCS",
    "Ray other",
)
VLLM_ENGINE = "vLLM engine"
VLLM_SERVER = "vLLM API server"
CLIENT = "client (bench)"
OTHER = "other work"
ROWS = (ENGINE, *SERVING, VLLM_ENGINE, VLLM_SERVER, CLIENT, OTHER)


@dataclass(frozen=True)
class TaskTimes:
    part: str
    cpu: float  # seconds on a core (utime + stime)
    waited: float  # seconds runnable but waiting for a core (schedstat run_delay)


def _process_part(cmdline: str, pid: int, ours: set[int], client: int) -> str:
    if pid == client:
        return CLIENT
    if pid in ours:
        return serve_process(cmdline)
    if cmdline.startswith("VLLM::"):
        return VLLM_ENGINE
    if "vllm" in cmdline:
        return VLLM_SERVER
    return OTHER


def snapshot(root: int | None, client: int) -> dict[tuple[int, int], TaskTimes]:
    """Every thread on the machine: (pid, tid) -> its part and times so far."""
    parents, cmdlines = processes()
    ours = descendants(root, parents) if root is not None else set()
    out: dict[tuple[int, int], TaskTimes] = {}
    for pid, cmdline in cmdlines.items():
        part = _process_part(cmdline, pid, ours, client)
        with contextlib.suppress(OSError):
            for tid_s in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    task = Path(f"/proc/{pid}/task/{tid_s}")
                    f = stat_fields((task / "stat").read_text())
                    cpu = (int(f[11]) + int(f[12])) / TICK  # utime, stime
                    waited = int((task / "schedstat").read_text().split()[1]) / 1e9
                    if part == "replica":
                        engine = (task / "comm").read_text().strip() == ENGINE_THREAD
                        part_t = ENGINE if engine else "replicas' other threads"
                    else:
                        part_t = part
                    out[(pid, int(tid_s))] = TaskTimes(part_t, cpu, waited)
    return out


@dataclass
class Reading:
    """One run: its parts' CPU seconds and engine threads' wait, over ``seconds``."""

    side: str
    seconds: float
    tokens: int
    cpu: dict[str, float] = field(default_factory=dict)
    engine_waited: float = 0.0
    engine_threads: int = 0

    def cores(self, part: str) -> float:
        return self.cpu.get(part, 0.0) / self.seconds


def reading(
    side: str,
    before: dict[tuple[int, int], TaskTimes],
    after: dict[tuple[int, int], TaskTimes],
    seconds: float,
    tokens: int,
) -> Reading:
    r = Reading(side, seconds, tokens)
    for key, t in after.items():
        b = before.get(key)
        cpu = t.cpu - (b.cpu if b and b.part == t.part else 0.0)
        r.cpu[t.part] = r.cpu.get(t.part, 0.0) + max(0.0, cpu)
        if t.part == ENGINE:
            r.engine_threads += 1
            r.engine_waited += max(0.0, t.waited - (b.waited if b else 0.0))
    return r


class CpuProfile:
    """Readings per (side, concurrency); ``watch`` wraps one run."""

    def __init__(self, root: int | None) -> None:
        self.root = root
        self.readings: dict[tuple[str, int], list[Reading]] = defaultdict(list)

    @contextlib.contextmanager
    def watch(self, side: str, concurrency: int, out: list[tuple[float, int]]) -> Iterator[None]:
        """Around one run; ``out`` receives (its seconds, its output tokens) when it ends."""
        before = snapshot(self.root, os.getpid())
        yield
        after = snapshot(self.root, os.getpid())
        seconds, tokens = out[0]
        self.readings[(side, concurrency)].append(reading(side, before, after, seconds, tokens))

    def per_token(self, side: str, concurrency: int, parts: tuple[str, ...]) -> float:
        """``parts``' CPU ms per output token in ``side``'s runs at ``concurrency``, the
        median over the repeats (NaN when no such run was read)."""
        rs = self.readings.get((side, concurrency), [])
        if not rs:
            return float("nan")
        return statistics.median(
            1e3 * sum(r.cpu.get(p, 0.0) for p in parts) / max(r.tokens, 1) for r in rs
        )

    def outside_engines_ratio(self, ours: str, peer: str, concurrency: int) -> float:
        """Meridian's CPU ms per output token outside its engine threads (ingress, proxy,
        router, replicas' other threads, Ray and Serve's own processes) in ``ours``' runs,
        over the peer's API server's in ``peer``'s runs."""
        server = self.per_token(peer, concurrency, (VLLM_SERVER,))
        return self.per_token(ours, concurrency, SERVING) / server if server else float("nan")

    def print(self, concurrency: int, engine_itl: dict[str, float]) -> None:
        """The table at ``concurrency``: each part's cores (CPU-s per s) and CPU ms per
        output token, medians over the repeats, a column pair per side; then the engine
        threads' wait for a core, and decodes per step by Little's law (output tokens/s per
        replica x the engine's mean inter-token gap, ``engine_itl`` by side)."""
        runs = {s: rs for (s, c), rs in self.readings.items() if c == concurrency}
        if not runs:
            return
        counts = ", ".join(f"{s} {len(rs)}" for s, rs in runs.items())
        print(
            f"CPU profile at {concurrency} streams (cores: CPU-s per s of run; medians of "
            f"{counts} runs):"
        )
        print(f"{'part':<28}" + "".join(f"{s + ' cores':>18}{'ms/token':>10}" for s in runs))

        def row(name: str, parts: tuple[str, ...]) -> None:
            line = f"{name:<28}"
            for rs in runs.values():
                cores = statistics.median(sum(r.cores(p) for p in parts) for r in rs)
                per_token = self.per_token(rs[0].side, concurrency, parts)
                line += f"{cores:>18.3f}{per_token:>10.2f}"
            print(line)

        for part in ROWS:
            if any(r.cpu.get(part, 0.0) > 0 for rs in runs.values() for r in rs):
                row(part, (part,))
        row("= Meridian outside engines", SERVING)
        row("= Meridian server, all", (ENGINE, *SERVING))
        row("= vLLM server, all", (VLLM_ENGINE, VLLM_SERVER))
        for side, rs in runs.items():
            replicas = rs[0].engine_threads
            itl = engine_itl.get(side, float("nan"))
            if not replicas or itl != itl:  # no engine of ours served this side (NaN)
                continue
            waited = statistics.median(r.engine_waited / r.seconds for r in rs)
            tok_s = statistics.median(r.tokens / r.seconds for r in rs)
            print(
                f"{side}: {replicas} engine threads waited for a core {waited:.3f} s per s "
                f"together; {tok_s:.0f} output tokens/s; engine ITL {itl * 1e3:.1f} ms, so "
                f"~{tok_s / replicas * itl:.1f} decodes per step per replica"
            )
