"""The planner's Serve config for a dense model runs as written: ``python -m sim plan
--model tiny-dense --dense-modes pd --trace FILE --out plan.yaml`` writes a P/D group (the
prefill : decode ratio and each side's layout from the cost model; the simulated replay's
verdict as a comment), ``serve run plan.yaml`` starts it on a private local Ray cluster, and
greedy completions through the real ``openai`` client equal the in-process engine's."""

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
    # Mooncake format: two short prompts a second
    rows = [
        {"timestamp": 500 * i, "input_length": 30 + i, "output_length": 16, "hash_ids": [i]}
        for i in range(40)
    ]
    argv = ["plan", "--model", "tiny-dense", "--gpus", "CPU", "--dense-modes", "pd"]
    argv += ["--ttft-slo", "2", "--tpot-slo", "0.2"]
    return planned_config(cluster, tmp, rows, argv)


@pytest.fixture(scope="module")
def server(cluster, plan_file):
    port = yaml.safe_load(plan_file.read_text())["http_options"]["port"]
    with serve_file_running(cluster, plan_file, port, 1) as url:
        yield Server(url, cluster)


def test_plan_is_a_pd_group_of_the_built_in_model(plan_file):
    text = plan_file.read_text()
    assert "# simulated replay of 40 requests" in text
    (app,) = yaml.safe_load(text)["applications"]
    args = app["args"]
    assert args["model"] is None and args["model_name"] == "meridian-tiny"
    (group,) = args["groups"]
    assert group["num_prefill"] >= 1 and group["num_decode"] >= 1
    assert group["conductor"] == {"ttft_slo": 2.0, "tbt_slo": 0.2}


def test_greedy_completions_equal_in_process_engine(server):
    assert_greedy_completions(server, "meridian-tiny", LLM(), (6, 23), 10)
