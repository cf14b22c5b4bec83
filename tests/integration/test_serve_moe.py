"""The planner's Serve config for the bundled tiny MoE model runs as written:
``python -m sim plan --model tiny-moe --trace FILE --out plan.yaml`` (the simulated
replay's verdict is a comment in the file), then ``serve run plan.yaml`` on a private local
Ray cluster; the replica's attention and expert workers are Ray actors, and greedy
completions through the real ``openai`` client equal the in-process engine's."""

from __future__ import annotations

import pytest
import yaml
from serve_common import Server, assert_greedy_completions, planned_config, serve_file_running

from actors import LLM

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(local_ray_cluster):
    return local_ray_cluster(dashboard=False)


@pytest.fixture(scope="module")
def plan_file(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    # Mooncake format: a short prompt every 2 s
    rows = [
        {"timestamp": 2000 * i, "input_length": 16 + 3 * i, "output_length": 8, "hash_ids": [i]}
        for i in range(12)
    ]
    argv = ["plan", "--model", "tiny-moe", "--gpus", "CPU", "--gpus-per-node", "1"]
    argv += ["--max-gpus", "5", "--tpot-slo", "0.02"]
    return planned_config(cluster, tmp, rows, argv)


@pytest.fixture(scope="module")
def plan_args(plan_file):
    (app,) = yaml.safe_load(plan_file.read_text())["applications"]
    return app["args"]


@pytest.fixture(scope="module")
def server(cluster, plan_file):
    port = yaml.safe_load(plan_file.read_text())["http_options"]["port"]
    with serve_file_running(cluster, plan_file, port, 1) as url:
        yield Server(url, cluster)


def test_plan_is_the_bundled_moe_model_split_into_workers(plan_file, plan_args):
    header = [ln for ln in plan_file.read_text().splitlines() if ln.startswith("#")]
    assert any("simulated replay of 12 requests" in ln for ln in header)
    assert plan_args["model"].endswith("tiny-moe-v1")  # the bundled model's folder
    (group,) = plan_args["groups"]
    engine = group["engine"]
    # 5 devices: one attention worker and one expert worker per expert of the 4.
    assert (engine["attention_workers"], engine["expert_workers"]) == (1, 4)
    assert engine["micro_batches"] in (3, 4) and group["num_replicas"] == 1


def test_greedy_completions_equal_in_process_engine(server, plan_args):
    reference = LLM(plan_args["model"])
    assert_greedy_completions(server, plan_args["model_name"], reference, (5, 19), 8)
