"""The planner's Serve config runs: ``python -m placement plan --out`` for a small MoE model,
then ``serve run`` of that file's application args on a private local Ray cluster; the
replica's attention and expert workers are Ray actors, and greedy completions through the
real ``openai`` client equal the in-process engine's."""

from __future__ import annotations

import pytest
import yaml
from serve_common import Server, serve_running

from actors import LLM, SamplingParams
from models import write_tiny_model
from placement.__main__ import main as placement_main

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 2 experts: the plan has 1 attention and 2 expert workers (few actors for 2 cores).
    return write_tiny_model(
        tmp_path_factory.mktemp("moe2"), kind="moe", seed=31, num_local_experts=2
    )


@pytest.fixture(scope="module")
def plan_args(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    argv = ["plan", "--model", str(model_dir), "--gpus", "CPU", "--gpus-per-node", "1"]
    argv += ["--max-gpus", "3", "--tpot-slo", "0.02", "--avg-context", "64", "--out", str(out)]
    assert placement_main(argv) == 0
    (app,) = yaml.safe_load(out.read_text())["applications"]
    return app["args"]


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory, plan_args):
    cluster = local_ray_cluster(dashboard=False)
    with serve_running(cluster, plan_args, tmp_path_factory.mktemp("serve-moe"), 1) as url:
        yield Server(url, cluster)


def test_plan_is_a_moe_group(plan_args):
    (group,) = plan_args["groups"]
    assert (group["attention_workers"], group["expert_workers"]) == (1, 2)
    assert group["micro_batches"] in (3, 4)


def test_greedy_completions_equal_in_process_engine(server, plan_args, model_dir):
    reference = LLM(model_dir)
    client = server.client()
    for n in (5, 19):
        prompt = [(n * 7919 + i * 104729) % 500 + 3 for i in range(n)]
        r = client.completions.create(
            model=plan_args["model_name"],
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = reference.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
