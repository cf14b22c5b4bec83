"""Reliability soak: kill every kind of actor of a live Serve app under steady load, scale
a pool down and update the weights under it.

A real Serve app (``serve_app.build_app``) on a local Ray cluster, in two phases (one app
with both groups is too heavy for a 2-core machine):

- ``colocated``: one group of ``tp=2`` replicas (so worker actors exist); kills workers,
  replicas, the router deployment and the ingress;
- ``pd``: one disaggregated group (a prefill and a decode replica, a KV store shard); kills
  prefill replicas, decode replicas, store shards, the Conductor's process (``replica``:
  the group's one Serve replica) and the router, and scales a pool down (``scale-down``: a
  prefill or decode replica asked to drain, ``LoopedReplica.drain``: it serves until a
  replacement joined, then its Conductor drains it under the load and retires it once
  idle).

Both phases also update the weights under load (``weights``): ``POST
/admin/update_weights`` with an admin key and the app's own model folder, a new weight
version with the same values, so every request's tokens still equal the reference;
requests in flight finish first (the replicas drain), new ones wait. It is back once the
update answered (every replica loaded it), every pool replica runs the new version and
the app is at full strength.

Closed-loop HTTP clients send greedy requests (token-id prompts, EOS ignored, half of them
streamed) whose tokens were computed in this process on the same weights. A fault injector
waits until the app is at full strength, sleeps a random while, waits for a request in
flight, then kills one live actor of a kind (``actors.fault_targets``: found by class in
the GCS actor table, a named one looked up in its own namespace; SIGKILL of its process,
``ray.kill`` for Serve's deployments), or scales a pool down or updates the weights, until
every kind got ``--faults`` faults (``bench/soak_faults.py``). Full strength: every
expected actor alive (and no other), ``/health`` 200 counting every active replica, the
router's view exactly the live replicas, and a probe request returns its exact tokens.

The colocated group runs ``--standby`` warm spare replicas (default 1,
``standby_replicas``): a replica kill is back once the router's view holds the group's
active count of live replicas again (a spare took the dead one's place) and a probe
succeeds; ``whole`` is when Serve's replacement joined as the new spare. A worker kill
the same way: the replica restarting its worker group leaves the router's view meanwhile
and a spare serves in its place; ``whole`` is when it rejoined as the spare. With
``--standby 0`` both are back only when the replacement (or the restarted group) serves.
A scale-down is back once the app serves at full strength (the leaving replica serves
until its replacement does, so it never drops below), ``whole`` once it retired.

Per request: ``ok`` (its exact tokens), ``retriable`` (429/503 with an error body, or an
error event in its stream, what it streamed before being a prefix of the right tokens),
``dropped`` (a 5xx of the Serve proxy or a broken connection: the client sees it failed),
``lost`` (anything else: a hang past the timeout, another status, a stream ending without
``[DONE]`` or an error), ``wrong`` (a token differs). A client sends a retriable or dropped
request again, backing off, until it ends otherwise: ``gave up`` counts those still
retriable or dropped after ``RETRY_FOR_S``. After the load stops, every replica's pools
must be back to 0 blocks in use (``blocks_in_use``).

``--minutes M``: a long soak instead, ``M`` minutes in all split between the phases,
``--per-minute`` faults a minute (default 2) in rounds of every kind, each at its slot.
Every soak prints each phase's memory once the load ran and at the end
(``bench/soak_memory.py``): every process of the cluster (RSS and PSS, summed per kind, and
the processes that grew most) and ``/dev/shm``.

    python bench/soak.py [--faults 3] [--clients 4] [--phases colocated,pd] [--standby 1]
    python bench/soak.py --minutes 30 [--per-minute 2]

Last lines: ``soak recovery-max-s: <s>`` (the slowest fault to full strength again) and
``lost/wrong/leaked: <a>/<b>/<c>`` (target 0/0/0).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from bench.soak_app import (
    Phase,
    blocks_in_use,
    colocated_phase,
    pd_phase,
    prompts,
    reference_tokens,
    running_app,
)
from bench.soak_faults import RECOVERY_TIMEOUT_S, KindResult, fault_plan, inject
from bench.soak_load import RETRY_FOR_S, Load, Tally, tally
from bench.soak_memory import MemorySnapshot, memory_table
from bench.soak_memory import snapshot as memory_snapshot


@dataclass
class PhaseReport:
    phase: str
    kinds: dict[str, KindResult]
    tally: dict[str, Tally]
    blocks: dict[str, dict[str, int]]
    memory: tuple[MemorySnapshot, MemorySnapshot]  # once the load ran, and at the end

    @property
    def leaked(self) -> int:
        return sum(v for b in self.blocks.values() for v in b.values())


def run_phase(
    phase: Phase,
    cases: list[tuple[list[int], list[int]]],
    faults: int,
    clients: int,
    seed: int = 0,
    pause: tuple[float, float] = (1.0, 4.0),
    log: Callable[[str], None] = print,
    minutes: float = 0.0,
    per_minute: float = 2.0,
) -> PhaseReport:
    with running_app(phase) as url:
        log(f"phase {phase.name}: app up at {url}")
        return soak(url, phase, cases, faults, clients, seed, pause, log, minutes, per_minute)


def soak(
    url: str,
    phase: Phase,
    cases: list[tuple[list[int], list[int]]],
    faults: int,
    clients: int,
    seed: int = 0,
    pause: tuple[float, float] = (1.0, 4.0),
    log: Callable[[str], None] = print,
    minutes: float = 0.0,
    per_minute: float = 2.0,
) -> PhaseReport:
    """Load the running app at ``url``, inject the faults (``faults`` of each kind; with
    ``minutes`` > 0, ``per_minute`` faults a minute for that long, the kinds in rounds),
    stop the load, read the blocks and the memory."""
    rng = random.Random(seed)
    n, every = faults * len(phase.kinds), 0.0
    if minutes > 0:
        n, every = max(1, round(minutes * per_minute)), 60.0 / per_minute
    plan = fault_plan(phase.kinds, n, rng)
    with Load(url, cases, clients, seed) as load:
        if not load.wait_ended(clients):
            log("  no request ended before the first fault")
        first = memory_snapshot()
        kinds, windows = inject(
            url,
            phase,
            plan,
            rng,
            cases[0],
            pause,
            log,
            load.wait_busy,
            load.count_in_flight,
            every,
        )
        if not load.wait_ended(clients):  # the load went on after the last recovery
            log("  no request ended after the last fault")
    blocks = blocks_in_use(phase.group["name"])
    memory = (first, memory_snapshot())
    return PhaseReport(phase.name, kinds, tally(load.outcomes, windows), blocks, memory)


def table(reports: list[PhaseReport]) -> str:
    rows: list[tuple[str, ...]] = [
        (
            "phase",
            "kind",
            "faults",
            "ok",
            "retriable",
            "in flight",
            "dropped",
            "lost",
            "wrong",
            "gave up",
            "back (s)",
            "whole (s)",
        ),
    ]
    for rep in reports:
        for kind in ["none", *rep.kinds]:
            t = rep.tally.get(kind, Tally())
            k = rep.kinds.get(kind)
            back = "-"
            if k is not None and k.recovery_s:
                back = f"{statistics.median(k.recovery_s):.1f}/{max(k.recovery_s):.1f}"
            if k is not None and k.not_recovered:
                back += f" ({k.not_recovered} never)"
            if k is not None and k.not_found:
                back += f" ({k.not_found} not found)"
            spare = "-"
            if k is not None and k.whole_s:
                spare = f"{statistics.median(k.whole_s):.1f}/{max(k.whole_s):.1f}"
            rows.append(
                (
                    rep.phase,
                    kind if kind != "none" else "(no fault)",
                    str(k.faults if k else 0),
                    str(t.ok),
                    str(t.retriable),
                    str(k.in_flight if k else "-"),
                    str(t.dropped),
                    str(t.lost),
                    str(t.wrong),
                    str(t.gave_up),
                    back,
                    spare,
                )
            )
        rows.append((rep.phase, "blocks in use after", str(rep.leaked), *[""] * 9))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=3, help="faults per kind")
    ap.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="a long soak: this many minutes in all (split evenly between the phases), "
        "--per-minute faults a minute, the kinds in rounds (instead of --faults per kind)",
    )
    ap.add_argument("--per-minute", type=float, default=2.0, help="faults a minute (--minutes)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--phases", default="colocated,pd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--standby",
        type=int,
        default=1,
        help="warm spare replicas of the colocated group (0: a killed replica's place waits "
        "for Serve's replacement)",
    )
    ap.add_argument(
        "--ingress-replicas",
        type=int,
        default=1,
        help="ingress replicas of the colocated phase (an ingress kill breaks only what the "
        "killed one held)",
    )
    args = ap.parse_args()
    token_lists = prompts(16, args.seed)
    cases = list(zip(token_lists, reference_tokens(token_lists), strict=True))
    colocated = colocated_phase(standby=args.standby, ingress=args.ingress_replicas)
    phases = {"colocated": colocated, "pd": pd_phase()}
    names = args.phases.split(",")
    minutes = args.minutes / len(names)
    reports = []
    for name in names:
        phase = phases[name]
        reports.append(
            run_phase(
                phase,
                cases,
                args.faults,
                args.clients,
                args.seed,
                minutes=minutes,
                per_minute=args.per_minute,
            )
        )
    print(table(reports))
    for rep in reports:
        print(f"memory of phase {rep.phase}, once loaded and at the end:")
        print(memory_table(*rep.memory))
    for rep in reports:
        for kind, t in rep.tally.items():
            for why, n in sorted(t.why.items()):
                print(f"{rep.phase}/{kind} x{n} {why}")
    lost = sum(t.lost for r in reports for t in r.tally.values())
    wrong = sum(t.wrong for r in reports for t in r.tally.values())
    never = sum(k.not_recovered for r in reports for k in r.kinds.values())
    dropped = sum(t.dropped for r in reports for t in r.tally.values())
    not_found = sum(k.not_found for r in reports for k in r.kinds.values())
    gave_up = sum(t.gave_up for r in reports for t in r.tally.values())
    print(f"dropped (a 5xx of the Serve proxy or a broken connection): {dropped}")
    print(f"faults not recovered from (full strength within {RECOVERY_TIMEOUT_S:.0f}s): {never}")
    print(f"kills that found no live actor of their kind: {not_found}")
    print(f"requests given up (retriable for {RETRY_FOR_S:.0f}s): {gave_up}")
    backs = [s for r in reports for k in r.kinds.values() for s in k.recovery_s]
    print(f"soak recovery-max-s: {max(backs):.1f}" if backs else "soak recovery-max-s: -")
    print(f"lost/wrong/leaked: {lost}/{wrong}/{sum(r.leaked for r in reports)}")


if __name__ == "__main__":
    main()
