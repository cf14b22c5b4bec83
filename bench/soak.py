"""Reliability soak: kill every kind of actor of a live Serve app under steady load, scale
a pool down and update the weights under it.

A real Serve app (``serve_app.build_app``) on a local Ray cluster, in two phases (one app
with both groups is too heavy for a 2-core machine):

- ``colocated``: one group of ``tp=2`` replicas (so worker actors exist); kills workers,
  replicas, the router deployment and the ingress;
- ``pd``: one disaggregated group (a prefill and a decode replica, a KV store shard); kills
  prefill replicas, decode replicas and store shards (and the router), and scales a pool
  down (``scale-down``: a prefill or decode replica asked to drain, ``LoopedReplica.drain``:
  its Conductor drains it under the load and retires it once idle, after a replacement
  joined, so the pool is whole again).

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
every kind got ``--faults`` faults. Full strength: every expected actor alive (and no
other), ``/health`` 200 counting every active replica, the router's view exactly the live
replicas, and a probe request returns its exact tokens.

The colocated group runs ``--standby`` warm spare replicas (default 1,
``standby_replicas``): a replica kill is back once the router's view holds the group's
active count of live replicas again (a spare took the dead one's place) and a probe
succeeds; ``spare back`` is when Serve's replacement joined as the new spare. A worker kill
the same way: the replica restarting its worker group leaves the router's view meanwhile
and a spare serves in its place; ``spare back`` is when it rejoined as the spare. With
``--standby 0`` both are back only when the replacement (or the restarted group) serves.

Per request: ``ok`` (its exact tokens), ``retriable`` (429/503 with an error body, or an
error event in its stream, what it streamed before being a prefix of the right tokens),
``dropped`` (a 5xx of the Serve proxy or a broken connection: the client sees it failed),
``lost`` (anything else: a hang past the timeout, another status, a stream ending without
``[DONE]`` or an error), ``wrong`` (a token differs). A client sends a retriable or dropped
request again, backing off, until it ends otherwise: ``gave up`` counts those still
retriable or dropped after ``RETRY_FOR_S``. After the load stops, every replica's pools
must be back to 0 blocks in use (``check_blocks``).

    python bench/soak.py [--faults 3] [--clients 4] [--phases colocated,pd] [--standby 1]

Last lines: ``soak recovery-max-s: <s>`` (the slowest fault to full strength again) and
``lost/wrong/leaked: <a>/<b>/<c>`` (target 0/0/0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from actors.fault_targets import POOL_KINDS, drain, handle, is_alive, kill, live_actors  # noqa: E402
from bench.app_probe import free_port, healthy, wait_healthy  # noqa: E402

MODEL = "meridian-tiny"
APP = "meridian"
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 90.0
RETRY_FOR_S = 300.0  # a client retries a request for this long (longer than a recovery)
RECOVERY_TIMEOUT_S = 240.0
USER_KEY, ADMIN_KEY = "sk-soak-user-0001", "sk-soak-admin-001"  # the clients', the updater's
SCALE_DOWN, WEIGHTS = "scale-down", "weights"  # fault kinds that kill no actor


@dataclass
class Phase:
    name: str
    group: dict[str, Any]
    kinds: list[str]  # the kinds killed in this phase
    expect: dict[str, int]  # kind -> live actors at full strength (spares included)
    standby: int = 0  # warm spare replicas of the group (``standby_replicas``)
    ingress: int = 1  # ingress replicas (``ingress_replicas``)

    @property
    def replicas(self) -> int:
        """Active replicas: what /health and the router's view count."""
        return self.expect["replica"] - self.standby

    def app_args(self) -> dict[str, Any]:
        """The Serve app's config; API keys (a user's for the clients, an admin's for the
        updates) only when the phase updates weights (admin routes need a key), so callers
        of an app without them need none."""
        args: dict[str, Any] = {
            "model_name": MODEL,
            "groups": [self.group],
            "report_interval_s": 0.2,
        }
        if self.ingress > 1:
            args["ingress_replicas"] = self.ingress
        if WEIGHTS in self.kinds:
            args["api_keys"] = [
                {"key": USER_KEY, "tenant": "soak"},
                {"key": ADMIN_KEY, "tenant": "soak-admin", "role": "admin"},
            ]
        return args


def colocated_phase(
    kinds: list[str] | None = None, replicas: int = 2, standby: int = 0, ingress: int = 1
) -> Phase:
    group: dict[str, Any] = {
        "name": "main",
        "num_replicas": replicas,
        "engine": {"dtype": "float64", "num_blocks": 256, "block_size": 16, "tp": 2},
    }
    if standby:
        group["standby_replicas"] = standby
    live = replicas + standby
    expect = {"ingress": ingress, "router": 1, "replica": live, "worker": 2 * live}
    kinds = kinds or ["worker", "replica", "router", "ingress", WEIGHTS]
    return Phase("colocated", group, kinds, expect, standby, ingress)


def pd_phase(kinds: list[str] | None = None) -> Phase:
    group = {
        "name": "pd",
        "num_prefill": 1,
        "num_decode": 1,
        "engine": {"dtype": "float64", "num_blocks": 256, "block_size": 16},
        "store": {"dram_bytes": 8 << 20},
        "conductor": {"fit_costs": False},
    }
    expect = {"ingress": 1, "router": 1, "replica": 1, "prefill": 1, "decode": 1, "store": 1}
    kinds = kinds or ["prefill", "decode", "store", "router", SCALE_DOWN, WEIGHTS]
    return Phase("pd", group, kinds, expect)


# -- prompts and their reference tokens ---------------------------------------------------------
def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def reference_tokens(token_lists: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the in-process engine on the same (built-in tiny) weights."""
    from actors import LLM, SamplingParams

    llm = LLM(dtype="float64")
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=token_lists, sampling_params=p)]


# -- the app --------------------------------------------------------------------------------------
@contextlib.contextmanager
def running_app(phase: Phase, num_cpus: int = 4) -> Iterator[str]:
    """Ray in this process, the Serve app of ``phase`` on a free port; yields its URL once
    ``/health`` counts every replica. Stops Serve and Ray afterwards."""
    import ray
    from ray import serve

    env = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}
    os.environ.update(env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        "local",  # a new cluster, never one that `ray start` recorded on this machine
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    try:
        from serve_app import build_app

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(phase.app_args()), name=APP, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, phase.replicas)
        yield url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        with contextlib.suppress(Exception):
            from store.shared_segment import remove_stale_segments

            remove_stale_segments()


# -- actors ---------------------------------------------------------------------------------------
def serve_replica_ids(group: str) -> list[str]:
    """Unique ids of the group's live Serve replicas (their actor names end with them)."""
    tag = f"#Replica-{group}#"
    return [a.name.rsplit("#", 1)[1] for a in live_actors() if tag in a.name]


def blocks_in_use(group: str, wait_s: float = 60.0) -> dict[str, dict[str, int]]:
    """Blocks in use per pool of each live replica of ``group`` (read on its engine thread),
    polled until all are 0 or ``wait_s`` passes (aborts land asynchronously)."""
    from ray import serve

    from actors.serving.messages import ReplicaCall

    handle = serve.get_deployment_handle(f"Replica-{group}", app_name=APP)
    deadline = time.monotonic() + wait_s
    while True:
        seen: dict[str, dict[str, int]] = {}
        for rid in serve_replica_ids(group):
            got_id, blocks = handle.blocks_report.remote(ReplicaCall(ranking=(rid,))).result(
                timeout_s=60
            )
            seen[got_id] = blocks
        if all(v == 0 for b in seen.values() for v in b.values()):
            return seen
        if time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


# -- load -------------------------------------------------------------------------------------
def client(url: str, timeout: float, key: str = USER_KEY) -> httpx.Client:
    """An HTTP client of the app sending ``key`` (ignored by an app without API keys)."""
    return httpx.Client(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"})


@dataclass
class Tally:
    ok: int = 0
    retriable: int = 0
    dropped: int = 0
    lost: int = 0
    wrong: int = 0
    gave_up: int = 0  # requests whose every try within RETRY_FOR_S was retriable or dropped
    why: Counter[str] = field(default_factory=Counter)


def one_request(
    http: httpx.Client, prompt: list[int], want: list[int], stream: bool
) -> tuple[str, str]:
    """(outcome, why): outcome in ok / retriable / lost / wrong."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    try:
        if not stream:
            r = http.post("/v1/completions", json=body)
            return classify_whole(r, want)
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return classify_whole(r, want)
            got: list[int] = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return ("ok", "") if got == want else ("wrong", f"{got} != {want}")
                chunk = json.loads(data)
                if "error" in chunk:
                    if got != want[: len(got)]:
                        return "wrong", f"streamed {got} before the error; want {want}"
                    message = chunk["error"].get("message", "")[:80]
                    return "retriable", f"stream error: {message}"
                for c in chunk.get("choices", []):
                    got += c.get("token_ids") or []
            if got != want[: len(got)]:
                return "wrong", f"streamed {got}; want {want}"
            return "lost", "stream ended without [DONE] or an error"
    except httpx.TimeoutException:
        return "lost", "timed out"
    except httpx.HTTPError as e:  # the connection broke: the client sees the failure
        return "dropped", f"connection broke: {type(e).__name__}"


def classify_whole(r: httpx.Response, want: list[int]) -> tuple[str, str]:
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code == 200 and isinstance(body, dict):
        got = body["choices"][0].get("token_ids")
        return ("ok", "") if got == want else ("wrong", f"{got} != {want}")
    error = body.get("error") if isinstance(body, dict) else None
    if r.status_code in (429, 503) and isinstance(error, dict) and error.get("message"):
        return "retriable", f"{r.status_code}: {error['message'][:80]}"
    if r.status_code >= 500:  # an error, but not ours: the Serve proxy's
        return "dropped", f"{r.status_code}: {r.text[:80]!r}"
    return "lost", f"{r.status_code}: {r.text[:80]!r}"


@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    outcome: str  # ok / retriable / dropped / lost / wrong
    why: str
    final: bool = True  # the request's last try (no retry follows it)


class Load:
    """``clients`` closed-loop clients, each recording every request's ``Outcome``. A
    client sends a request again (backing off) after a retriable or dropped try, until it
    ends otherwise or ``RETRY_FOR_S`` passed since its first try; it finishes the request
    it is on when the load stops."""

    def __init__(
        self, url: str, cases: list[tuple[list[int], list[int]]], clients: int, seed: int
    ) -> None:
        self.url = url
        self.cases = cases
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a request started or ended
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.threads = [
            threading.Thread(target=self._client, args=(seed + i,), daemon=True)
            for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(RETRY_FOR_S + REQUEST_TIMEOUT_S)

    def wait_ended(self, n: int, timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """Until ``n`` more requests ended (whatever their outcome); False on timeout."""
        with self.changed:
            target = len(self.outcomes) + n
            return self.changed.wait_for(lambda: len(self.outcomes) >= target, timeout)

    def count_in_flight(self) -> int:
        with self.lock:
            return self.in_flight

    def wait_busy(self, timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """Until a request is in flight; False on timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: self.in_flight > 0, timeout)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with client(self.url, REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                prompt, want = rng.choice(self.cases)
                stream = rng.random() < 0.5
                first, backoff = time.monotonic(), 0.2
                while True:
                    outcome = self._try(http, prompt, want, stream, first + RETRY_FOR_S)
                    if outcome.final:
                        break
                    time.sleep(backoff)  # as a client backing off before a retry
                    backoff = min(2 * backoff, 2.0)

    def _try(
        self, http: httpx.Client, prompt: list[int], want: list[int], stream: bool, until: float
    ) -> Outcome:
        with self.changed:
            self.in_flight += 1
            self.changed.notify_all()
        start = time.monotonic()
        try:
            outcome, why = one_request(http, prompt, want, stream)
        except Exception as e:  # a malformed answer: counted, never a dead client
            outcome, why = "lost", f"{type(e).__name__}: {str(e)[:80]}"
        end = time.monotonic()
        final = outcome not in ("retriable", "dropped") or end >= until
        result = Outcome(start, end, outcome, why, final)
        with self.changed:
            self.in_flight -= 1
            self.outcomes.append(result)
            self.changed.notify_all()
        return result


def tally(outcomes: list[Outcome], windows: list[tuple[str, float, float]]) -> dict[str, Tally]:
    """Per fault kind: the requests that overlapped one of its windows (kill .. full
    strength again), each under the last fault before it ended; the rest under ``none``."""
    out: dict[str, Tally] = {}
    for o in outcomes:
        hit = [(a, k) for k, a, b in windows if o.start <= b and o.end >= a]
        kind = max(hit)[1] if hit else "none"
        t = out.setdefault(kind, Tally())
        setattr(t, o.outcome, getattr(t, o.outcome) + 1)
        if o.outcome != "ok":
            t.why[f"{o.outcome}: {o.why}"] += 1
        if o.final and o.outcome in ("retriable", "dropped"):
            t.gave_up += 1
    return out


# -- faults ---------------------------------------------------------------------------------------
def strength(url: str, phase: Phase, serving: bool = False) -> str:
    """What is missing from full strength ('' when nothing): actors, /health, the router's
    view (exactly the live replicas: the active ones, and the spares).

    ``serving``: the group serves at full strength, its spares aside: the router's view
    holds ``phase.replicas`` live replicas, and there are at least that many replicas (and
    their workers); a spare still starting is not missing."""
    from ray import serve

    counts = Counter(a.kind for a in live_actors())
    missing = []
    for kind, n in phase.expect.items():
        if serving and kind in ("replica", "worker"):
            need = n * phase.replicas // phase.expect["replica"]  # the active replicas' share
            if counts[kind] < need:
                missing.append(f"{kind} {counts[kind]}/{need}")
        elif counts[kind] != n:
            missing.append(f"{kind} {counts[kind]}/{n}")
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


def full_strength(
    url: str, phase: Phase, probe: tuple[list[int], list[int]], serving: bool = False
) -> bool:
    if strength(url, phase, serving):
        return False
    with client(url, 30) as http:
        outcome, _ = one_request(http, probe[0], probe[1], stream=False)
    return outcome == "ok"


def wait_full_strength(
    url: str, phase: Phase, probe: Any, timeout: float, serving: bool = False
) -> float | None:
    """Seconds until full strength (``serving``: the spares aside; None: not within
    ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if full_strength(url, phase, probe, serving):
            return time.monotonic() - start
        time.sleep(0.25)
    return None


@dataclass
class KindResult:
    faults: int = 0
    recovery_s: list[float] = field(default_factory=list)  # to full (serving) strength
    spare_s: list[float] = field(default_factory=list)  # to the spares too (a replica kill)
    not_recovered: int = 0
    not_found: int = 0  # kills that found no live actor of the kind
    in_flight: int = 0  # the load's requests in flight at this kind's faults, summed


def inject(
    url: str,
    phase: Phase,
    faults: int,
    rng: random.Random,
    probe: Any,
    pause: tuple[float, float],
    log: Callable[[str], None],
    busy: Callable[[], bool] = lambda: True,
    in_flight: Callable[[], int] = lambda: 0,
) -> tuple[dict[str, KindResult], list[tuple[str, float, float]]]:
    """Cause ``faults`` faults of each kind of ``phase``, in a random order, each at a
    random moment (``pause`` seconds) once the app is at full strength, as soon as
    ``busy()`` (a request in flight). Returns per kind its results, and the windows (kind,
    fault, full strength again)."""
    plan = [k for k in phase.kinds for _ in range(faults)]
    rng.shuffle(plan)
    results = {k: KindResult() for k in phase.kinds}
    windows: list[tuple[str, float, float]] = []
    for kind in plan:
        if wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S) is None:
            log(f"  not at full strength before a {kind} fault: {strength(url, phase)}")
        if pause[1] > 0:
            time.sleep(rng.uniform(*pause))
        if not busy():
            log(f"  no request in flight before a {kind} fault")
        start, held = time.monotonic(), in_flight()
        try:
            what = cause(url, kind, rng, start + RECOVERY_TIMEOUT_S)
        except FaultFailed as e:
            results[kind].faults += 1
            results[kind].not_recovered += 1
            windows.append((kind, start, time.monotonic()))
            log(f"  {kind}: {e}")
            continue
        if what is None:
            results[kind].not_found += 1
            log(f"  no live actor for a {kind} fault")
            continue
        results[kind].faults += 1
        results[kind].in_flight += held
        # a spare takes the place of a dead replica, or of one restarting its workers
        spared = kind in ("replica", "worker") and phase.standby > 0
        took = wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S, serving=spared)
        windows.append((kind, start, time.monotonic()))
        if took is None:
            results[kind].not_recovered += 1
            log(f"  {what}: NOT back in {RECOVERY_TIMEOUT_S:.0f}s: {strength(url, phase)}")
            continue
        took = time.monotonic() - start
        results[kind].recovery_s.append(took)
        log(f"  {what}: full strength after {took:.1f}s")
        if spared and wait_full_strength(url, phase, probe, RECOVERY_TIMEOUT_S) is not None:
            results[kind].spare_s.append(time.monotonic() - start)
            log(f"  {what}: its spare back after {results[kind].spare_s[-1]:.1f}s")
    return results, windows


class FaultFailed(Exception):
    """A fault's own effect never came (an update refused, a drained replica never left)."""


def cause(url: str, kind: str, rng: random.Random, deadline: float) -> str | None:
    """Cause one fault of ``kind`` and wait for its own effect: a killed actor seen dead by
    Ray (full strength then means its replacement), a drained replica retired, an update
    loaded by every replica. Returns what it did (None: no live actor of the kind)."""
    if kind == WEIGHTS:
        version = update_weights(url, deadline)
        wait_pool_version(version, deadline)
        return f"updated the weights to version {version}"
    victims = live_actors(POOL_KINDS if kind == SCALE_DOWN else [kind])
    if not victims:
        return None
    victim = rng.choice(victims)
    who = victim.name.rsplit("#", 2)[-1] if victim.name else f"pid {victim.pid}"
    if kind == SCALE_DOWN:
        drain(victim)
        while is_alive(victim):  # drained under the load, retired once idle
            if time.monotonic() > deadline:
                raise FaultFailed(f"drained {victim.kind} {who} was not retired")
            time.sleep(0.1)
        return f"drained {victim.kind} {who}"
    kill(victim)
    start = time.monotonic()
    while is_alive(victim) and time.monotonic() - start < 30:
        time.sleep(0.1)  # until Ray saw it die: full strength means its replacement
    return f"killed {kind} {who}"


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


@dataclass
class PhaseReport:
    phase: str
    kinds: dict[str, KindResult]
    tally: dict[str, Tally]
    blocks: dict[str, dict[str, int]]

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
) -> PhaseReport:
    with running_app(phase) as url:
        log(f"phase {phase.name}: app up at {url}")
        return soak(url, phase, cases, faults, clients, seed, pause, log)


def soak(
    url: str,
    phase: Phase,
    cases: list[tuple[list[int], list[int]]],
    faults: int,
    clients: int,
    seed: int = 0,
    pause: tuple[float, float] = (1.0, 4.0),
    log: Callable[[str], None] = print,
) -> PhaseReport:
    """Load the running app at ``url``, inject the faults, stop the load, read the blocks."""
    rng = random.Random(seed)
    with Load(url, cases, clients, seed) as load:
        if not load.wait_ended(clients):
            log("  no request ended before the first fault")
        kinds, windows = inject(
            url, phase, faults, rng, cases[0], pause, log, load.wait_busy, load.count_in_flight
        )
        if not load.wait_ended(clients):  # the load went on after the last recovery
            log("  no request ended after the last fault")
    blocks = blocks_in_use(phase.group["name"])
    return PhaseReport(phase.name, kinds, tally(load.outcomes, windows), blocks)


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
            "spare back (s)",
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
            if k is not None and k.spare_s:
                spare = f"{statistics.median(k.spare_s):.1f}/{max(k.spare_s):.1f}"
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
    reports = []
    for name in args.phases.split(","):
        reports.append(run_phase(phases[name], cases, args.faults, args.clients, args.seed))
    print(table(reports))
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
