"""The soak's app (``bench/soak.py``): its two phases (the Serve config and the actors
expected at full strength), the prompts and their reference tokens, starting the app on a
local Ray cluster, and reading its replicas (ids, blocks in use)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from actors.fault_targets import live_actors
from bench.local_serve import APP, deploy, local_serve

MODEL = "meridian-tiny"
MAX_TOKENS = 12
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
    kinds = kinds or ["prefill", "decode", "store", "replica", "router", SCALE_DOWN, WEIGHTS]
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
    env = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}
    with local_serve(env, num_cpus) as host:
        yield deploy(host, phase.app_args(), phase.replicas, APP)


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
