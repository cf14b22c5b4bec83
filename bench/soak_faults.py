"""The soak's faults (``bench/soak.py``): what full strength is and waiting for it, and
causing one fault of a kind (a kill, a pool scaled down, a weight update) under the load."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from actors.fault_targets import (
    POOL_KINDS,
    ActorInfo,
    drain,
    handle,
    is_alive,
    kill,
    live_actors,
)
from bench.app_probe import healthy
from bench.soak_app import ADMIN_KEY, APP, SCALE_DOWN, WEIGHTS, Phase, serve_replica_ids
from bench.soak_load import client, one_request

RECOVERY_TIMEOUT_S = 240.0


def strength(url: str, phase: Phase, serving: bool = False) -> str:
    """What is missing from full strength ('' when nothing): actors, /health, the router's
    view (exactly the live replicas: the active ones, and the spares).

    ``serving``: the app serves at full strength, though not whole (``whole_again``): the
    router's view holds ``phase.replicas`` live replicas, and there are at least the active
    replicas (and their workers) and at least the expected actors of every other kind; a
    spare still starting is not missing, a pool replica leaving beside its replacement is
    not extra."""
    from ray import serve

    counts = Counter(a.kind for a in live_actors())
    missing = []
    for kind, n in phase.expect.items():
        need = n
        if serving and kind in ("replica", "worker"):
            need = n * phase.replicas // phase.expect["replica"]  # the active replicas' share
        if counts[kind] < need or (not serving and counts[kind] != need):
            missing.append(f"{kind} {counts[kind]}/{need}")
    if not healthy(url, phase.replicas):
        missing.append("/health")
    try:
        router = serve.get_deployment_handle("Router", app_name=APP)
        seen = set(router.snapshot.remote().result(timeout_s=10))
        spares = set(router.standby.remote().result(timeout_s=10))
        live = set(serve_replica_ids(phase.group["name"]))
        if len(seen) != phase.replicas or not seen <= live:
            missing.append(f"router view {len(seen)} replicas")
        elif not serving and (seen | spares != live or len(spares) != phase.standby):
            missing.append(f"router spares {len(spares)}/{phase.standby}")
    except Exception as e:
        missing.append(f"router: {type(e).__name__}")
    return ", ".join(missing)


def missing(
    url: str, phase: Phase, probe: tuple[list[int], list[int]], serving: bool = False
) -> str:
    """What keeps the app from full strength ('' when nothing): ``strength``, then a probe
    request that must return its exact tokens."""
    gap = strength(url, phase, serving)
    if gap:
        return gap
    with client(url, 30) as http:
        outcome, why = one_request(http, probe[0], probe[1], stream=False)
    return "" if outcome == "ok" else f"probe {outcome}: {why}"


def wait_full_strength(
    url: str, phase: Phase, probe: Any, timeout: float, serving: bool = False
) -> tuple[float | None, str]:
    """(seconds until full strength, or None when not within ``timeout``; what was last
    missing) (``serving``: the spares aside)."""
    start, gap = time.monotonic(), ""
    while time.monotonic() - start < timeout:
        gap = missing(url, phase, probe, serving)
        if not gap:
            return time.monotonic() - start, ""
        time.sleep(0.25)
    return None, gap


@dataclass
class KindResult:
    faults: int = 0
    recovery_s: list[float] = field(default_factory=list)  # to full (serving) strength
    whole_s: list[float] = field(default_factory=list)  # to whole again (``whole_again``)
    not_recovered: int = 0
    not_found: int = 0  # kills that found no live actor of the kind
    in_flight: int = 0  # the load's requests in flight at this kind's faults, summed


def fault_plan(kinds: list[str], n: int, rng: random.Random) -> list[str]:
    """``n`` faults in rounds: each round every kind once, in a random order (``n`` a
    multiple of the kinds: each kind ``n / len(kinds)`` times)."""
    plan: list[str] = []
    while len(plan) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        plan += round_
    return plan[:n]


def whole_again(kind: str, phase: Phase) -> bool:
    """Whether a fault of ``kind`` is back at serving strength before the app is whole:
    a killed replica or worker when the group has a spare (the spare serves in its place;
    whole once Serve's replacement or the restarted group is the new spare), and a pool
    scaled down (the leaving replica serves until its replacement does; whole once it
    retired)."""
    return (kind in ("replica", "worker") and phase.standby > 0) or kind == SCALE_DOWN


def inject(
    url: str,
    phase: Phase,
    plan: list[str],
    rng: random.Random,
    probe: Any,
    pause: tuple[float, float],
    log: Callable[[str], None],
    busy: Callable[[], bool] = lambda: True,
    in_flight: Callable[[], int] = lambda: 0,
    every: float = 0.0,
) -> tuple[dict[str, KindResult], list[tuple[str, float, float]]]:
    """Cause the faults of ``plan`` in order, each once the app is at full strength, after
    a random ``pause`` (or, with ``every`` > 0, at its slot: fault i starts ``i * every``
    seconds after the first, or as soon as the one before recovered), as soon as
    ``busy()`` (a request in flight). Returns per kind its results, and the windows (kind,
    fault, full strength again)."""
    results = {k: KindResult() for k in phase.kinds}
    windows: list[tuple[str, float, float]] = []
    first = time.monotonic()
    for i, kind in enumerate(plan):
        took, gap = wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S)
        if took is None:
            log(f"  not at full strength before a {kind} fault: {gap}")
        if every > 0:
            time.sleep(max(0.0, first + i * every - time.monotonic()))
        elif pause[1] > 0:
            time.sleep(rng.uniform(*pause))
        if not busy():
            log(f"  no request in flight before a {kind} fault")
        start, held = time.monotonic(), in_flight()
        try:
            what, victim = cause(url, kind, rng, start + RECOVERY_TIMEOUT_S)
        except FaultFailed as e:
            results[kind].faults += 1
            results[kind].not_recovered += 1
            windows.append((kind, start, time.monotonic()))
            log(f"  {kind}: {e}")
            continue
        if not what:
            results[kind].not_found += 1
            log(f"  no live actor for a {kind} fault")
            continue
        results[kind].faults += 1
        results[kind].in_flight += held
        serving = whole_again(kind, phase)
        took, gap = wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S, serving)
        windows.append((kind, start, time.monotonic()))
        back = _record(results[kind], results[kind].recovery_s, took, start, gap, log, what, "back")
        if not back or not serving:
            continue
        took, gap = None, "still alive"
        if victim is None or wait_dead(victim, start + RECOVERY_TIMEOUT_S):
            took, gap = wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S)
        _record(results[kind], results[kind].whole_s, took, start, gap, log, what, "whole again")
    return results, windows


def _record(
    result: KindResult,
    samples: list[float],
    took: float | None,
    start: float,
    gap: str,
    log: Callable[[str], None],
    what: str,
    state: str,
) -> bool:
    """Record (and log) the seconds since ``start`` in ``samples`` when the app reached
    ``state`` (``took`` not None), else count the fault not recovered; says which."""
    if took is None:
        result.not_recovered += 1
        log(f"  {what}: NOT {state} within {RECOVERY_TIMEOUT_S:.0f}s: {gap}")
        return False
    samples.append(time.monotonic() - start)
    log(f"  {what}: {state} after {samples[-1]:.1f}s")
    return True


class FaultFailed(Exception):
    """A fault's own effect never came (an update refused or never loaded)."""


def wait_dead(victim: ActorInfo, deadline: float) -> bool:
    """Until Ray sees ``victim`` dead; False at ``deadline``."""
    while is_alive(victim):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def cause(url: str, kind: str, rng: random.Random, deadline: float) -> tuple[str, ActorInfo | None]:
    """Cause one fault of ``kind`` and wait for its own effect: a killed actor seen dead by
    Ray (full strength then means its replacement), an update loaded by every replica.
    Returns what it did ('' when no live actor of the kind) and, for a pool scaled down,
    the drained replica (it leaves once its replacement serves)."""
    if kind == WEIGHTS:
        version = update_weights(url, deadline)
        wait_pool_version(version, deadline)
        return f"updated the weights to version {version}", None
    victims = live_actors(POOL_KINDS if kind == SCALE_DOWN else [kind])
    if not victims:
        return "", None
    victim = rng.choice(victims)
    who = victim.name.rsplit("#", 2)[-1] if victim.name else f"pid {victim.pid}"
    if kind == SCALE_DOWN:
        drain(victim)
        return f"drained {victim.kind} {who}", victim
    kill(victim)
    wait_dead(victim, time.monotonic() + 30)  # full strength then means its replacement
    return f"killed {kind} {who}", None


def update_weights(url: str, deadline: float) -> int:
    """``POST /admin/update_weights`` with the app's own model folder (the built-in tiny
    model): the new weight version, once every replica loaded it."""
    from models import tiny_model_dir

    timeout = max(1.0, deadline - time.monotonic())
    body = {"path": str(tiny_model_dir("dense"))}
    try:
        with client(url, timeout, ADMIN_KEY) as http:
            r = http.post("/admin/update_weights", json=body)
    except httpx.HTTPError as e:
        raise FaultFailed(f"the update failed: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise FaultFailed(f"the update answered {r.status_code}: {r.text[:200]!r}")
    return int(r.json()["weight_version"])


def wait_pool_version(version: int, deadline: float) -> None:
    """Until every live prefill and decode replica runs weight version ``version``."""
    import ray

    while True:
        behind: dict[str, int] = {}
        for a in live_actors(POOL_KINDS):
            try:
                got = int(ray.get(handle(a).weight_version.remote(), timeout=30))
            except Exception:  # gone since it was listed (its replacement is checked next)
                continue
            if got != version:
                behind[a.name] = got
        if not behind:
            return
        if time.monotonic() > deadline:
            raise FaultFailed(f"pool replicas not on weight version {version}: {behind}")
        time.sleep(0.25)
