"""``serve run`` of a plain config (one group, no ``cpu_cores``, no ``pin_cores``) on a Ray
cluster started with no environment variables: Ray starts its workers at its default
niceness, yet every replica's engine thread, and every thread of the app's own processes
(replicas, ingress, router), runs at nice 0; and on this
one-node cluster the group's two replicas' engine threads run on disjoint cores, the ones
``disjoint_cores`` gives (actors/engine/defaults.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from bad_requests import MODEL
from serve_common import serve_running

from actors.engine.replica_loop import disjoint_cores

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only"),
]


@pytest.fixture(scope="module")
def served(local_ray_cluster, tmp_path_factory):
    group = {"name": "main"}  # 2 replicas
    with serve_plain(local_ray_cluster, tmp_path_factory, group, replicas=2) as served:
        yield served


@contextlib.contextmanager
def serve_plain(local_ray_cluster, tmp_path_factory, group: dict, replicas: int):
    """``serve run`` of a config holding only the model and ``group`` (a small KV pool), on
    a cluster started without Ray's tuning variables; yields (cluster, url)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RAY_worker_niceness", "RAY_SERVE_ENABLE_DIRECT_INGRESS", "OMP_NUM_THREADS"):
            mp.delenv(name, raising=False)
        cluster = local_ray_cluster(dashboard=False)
    app_args = {"model_name": MODEL, "groups": [group | {"engine": {"kv_cache_memory": 1 << 25}}]}
    tmp = tmp_path_factory.mktemp("serve")
    with serve_running(cluster, app_args, tmp, replicas=replicas) as url:
        yield cluster, url


def cluster_processes(address: str) -> dict[int, str]:
    """pid -> process title of every process of the cluster at ``address`` (its processes
    carry ``RAY_ADDRESS``)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RAY_ADDRESS={address}".encode() in env:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found[int(pid)] = title.decode(errors="replace")
        except OSError:  # a process that ended meanwhile
            continue
    return found


def threads(pid: int) -> dict[int, str]:
    """tid -> name of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return out


def processes_after_a_completion(served: tuple) -> dict[int, str]:
    """Serve one completion, then ``cluster_processes`` of the app's cluster; checks that Ray
    itself still starts its workers at its default niceness (no variable was set)."""
    import httpx

    cluster, url = served
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
    procs = cluster_processes(cluster.address)
    (controller,) = [pid for pid, title in procs.items() if "ServeController" in title]
    assert os.getpriority(os.PRIO_PROCESS, controller) > 0
    return procs


def test_engine_threads_run_at_nice_0_on_disjoint_cores(served):
    procs = processes_after_a_completion(served)
    engines = [
        (pid, tid)
        for pid in procs
        for tid, name in threads(pid).items()
        if name == "meridian-engine"
    ]
    assert len(engines) == 2, engines  # one per replica
    for _, tid in engines:
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
    # the app's own processes (replicas, ingress, router) run every thread at nice 0
    ours = {pid for pid, _ in engines}
    ours |= {pid for pid, title in procs.items() if "Ingress" in title or "Router" in title}
    assert len(ours) == 4, {pid: procs[pid] for pid in ours}
    for pid in ours:
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads(pid)} == {0}, procs[pid]
    masks = sorted(sorted(os.sched_getaffinity(tid)) for _, tid in engines)
    runs = disjoint_cores(2)
    assert masks == (runs or [sorted(os.sched_getaffinity(0))] * 2)
