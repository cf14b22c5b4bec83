"""``serve run`` of a plain config (one group, no ``cpu_cores``, no ``pin_cores``) on a Ray
cluster started with no environment variables: Ray runs the replica processes at its
default worker niceness, yet every replica's engine thread runs at nice 0, and on this
one-node cluster the group's two replicas' engine threads run on disjoint cores, the ones
``disjoint_cores`` gives (actors/engine/defaults.py)."""

from __future__ import annotations

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
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RAY_worker_niceness", "RAY_SERVE_ENABLE_DIRECT_INGRESS", "OMP_NUM_THREADS"):
            mp.delenv(name, raising=False)
        cluster = local_ray_cluster(dashboard=False)
    app_args = {
        "model_name": MODEL,
        "groups": [{"name": "main", "engine": {"kv_cache_memory": 1 << 25}}],  # 2 replicas
    }
    with serve_running(cluster, app_args, tmp_path_factory.mktemp("serve"), replicas=2) as url:
        yield cluster, url


def engine_threads(address: str) -> list[tuple[int, int]]:
    """(pid, tid) of each thread named ``meridian-engine`` in a process of the cluster at
    ``address`` (its processes carry ``RAY_ADDRESS``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RAY_ADDRESS={address}".encode() not in env:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == "meridian-engine":
                    found.append((int(pid), int(tid)))
        except OSError:  # a process that ended meanwhile
            continue
    return found


def test_engine_threads_run_at_nice_0_on_disjoint_cores(served):
    cluster, url = served
    import httpx

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
    threads = engine_threads(cluster.address)
    assert len(threads) == 2, threads  # one per replica
    for pid, tid in threads:
        assert os.getpriority(os.PRIO_PROCESS, pid) > 0  # the process: Ray's worker niceness
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0  # its engine thread: normal
    masks = sorted(sorted(os.sched_getaffinity(tid)) for _, tid in threads)
    runs = disjoint_cores(2)
    assert masks == (runs or [sorted(os.sched_getaffinity(0))] * 2)
