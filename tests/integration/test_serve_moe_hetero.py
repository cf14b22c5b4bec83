"""A heterogeneous MoE plan deployed from the Serve config: the group's attention worker
and its expert workers get different resources, each kind its own cores
(``attention_cores`` / ``expert_cores``: the worker processes are pinned there) and its own
node resource (``attention_resources`` / ``expert_resources``: on this one-node cluster
the head carries both, as two kinds of node would each carry one). Greedy completions
through the OpenAI API equal the in-process engine's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from serve_common import Server, assert_greedy_completions, serve_running

from actors import LLM
from models import write_tiny_model

pytestmark = pytest.mark.timeout(900)

NODE = {"attention_hw": 1, "expert_hw": 2}  # what the head node offers of each kind
CORES = sorted(os.sched_getaffinity(0))
ATTENTION_CORES, EXPERT_CORES = CORES[:1], CORES[1:] or CORES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe-hetero"), kind="moe", seed=31)


@pytest.fixture(scope="module")
def server(local_ray_cluster, model_dir, tmp_path_factory):
    cluster = local_ray_cluster(env={"RAY_OVERRIDE_RESOURCES": json.dumps(NODE)})
    engine = {
        "attention_workers": 1,
        "expert_workers": 2,
        "micro_batches": 2,
        "attention_cores": ATTENTION_CORES,
        "expert_cores": EXPERT_CORES,
        "attention_resources": {"attention_hw": 1},
        "expert_resources": {"expert_hw": 1},
    }
    app_args = {
        "model": str(model_dir),
        "model_name": "tiny-moe",
        "groups": [{"name": "moe", "num_replicas": 1, "engine": engine}],
    }
    with serve_running(cluster, app_args, tmp_path_factory.mktemp("serve"), 1) as url:
        yield Server(url, cluster)


def _workers(server: Server) -> dict[str, list[int]]:
    """Class name -> pids of this cluster's MoE worker actors: the processes titled
    ``ray::AttentionWorker...`` / ``ray::ExpertWorker...`` in the cluster's session (its
    ``ray start`` leads a session of its own; other clusters may run MoE workers too)."""
    out: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            title = (Path("/proc") / entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            session = os.getsid(int(entry))
        except (OSError, UnicodeDecodeError):  # ended meanwhile, or not ours to read
            continue
        for name in ("AttentionWorker", "ExpertWorker"):
            if title.startswith(f"ray::{name}") and session == server.cluster.proc.pid:
                out.setdefault(name, []).append(int(entry))
    return out


def test_greedy_completions_equal_in_process_engine(server, model_dir):
    assert_greedy_completions(server, "tiny-moe", LLM(str(model_dir)), (6, 17), 8)


def test_each_kind_runs_on_its_own_cores_and_node_resource(server):
    workers = _workers(server)
    assert len(workers["AttentionWorker"]) == 1 and len(workers["ExpertWorker"]) == 2
    for pid in workers["AttentionWorker"]:
        assert sorted(os.sched_getaffinity(pid)) == ATTENTION_CORES
    for pid in workers["ExpertWorker"]:
        # two expert workers share the expert cores: disjoint runs if there are two or more
        assert set(os.sched_getaffinity(pid)) <= set(EXPERT_CORES)
    server.cluster.connect()
    try:
        import ray

        free = ray.available_resources()
    finally:
        ray.shutdown()
    # every unit of each kind's node resource is held by a worker of that kind
    assert free.get("attention_hw", 0) == 0 and free.get("expert_hw", 0) == 0
