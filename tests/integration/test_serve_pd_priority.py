"""``serve run`` of a plain config with one 1+1 prefill/decode group (no ``pin_cores``, no
priorities) on a Ray cluster started with no environment variables: Ray starts its workers
at its default niceness, yet every thread of the prefill and decode replica processes (the
engine threads, the Conductor's long poll, Ray's reply threads) runs at nice 0
(``ENGINE_NICE``, actors/engine/defaults.py), and the two engines run on the cores
``split_cores`` gives them."""

from __future__ import annotations

import os

import pytest
from test_serve_defaults import processes_after_a_completion, serve_plain, threads

from actors.engine.replica_loop import split_cores

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only"),
]


@pytest.fixture(scope="module")
def served(local_ray_cluster, tmp_path_factory):
    group = {"name": "pd", "num_prefill": 1, "num_decode": 1}
    with serve_plain(local_ray_cluster, tmp_path_factory, group, replicas=1) as served:
        yield served


def test_pd_replica_processes_run_every_thread_at_nice_0_engines_on_split_cores(served):
    procs = processes_after_a_completion(served)
    (prefill,) = [pid for pid, title in procs.items() if "PrefillReplica" in title]
    (decode,) = [pid for pid, title in procs.items() if "DecodeReplica" in title]
    engines = {}
    for pid in (prefill, decode):
        for tid, name in threads(pid).items():
            assert os.getpriority(os.PRIO_PROCESS, tid) == 0, (procs[pid], name)
            if name in ("prefill-p0", "decode-d0"):
                engines[name] = tid
    assert set(engines) == {"prefill-p0", "decode-d0"}
    cores = split_cores(1, 1)
    for name, rid in (("prefill-p0", "p0"), ("decode-d0", "d0")):
        expected = set(cores[rid]) if cores else os.sched_getaffinity(0)
        assert os.sched_getaffinity(engines[name]) == expected, name
