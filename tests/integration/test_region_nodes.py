"""Regions pinned to nodes on a real multi-node Ray cluster (three raylets on this machine,
each with its own node id; no Serve): a region's replica actor, started with the actor
options the Serve app gives its group (``serve_app._actor_options``) and the engine config
the Serve config gives it (``ServeConfig.group_engine_config``), runs on the node carrying
the region's resource, and so do the worker actors of its tp = 2 replica; the pinned
workers form a working group (the greedy tokens of a single-process replica). A
disaggregated group's cluster (prefill and decode replicas, store shard) runs on its
region's node too, with the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.disagg.cluster import PDCluster
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.serving.config import ServeConfig
from actors.serving.pd_group import pd_cluster_config
from actors.serving.replica import ReplicaActor
from serve_app import _actor_options

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"dtype": "float64", "block_size": 4, "num_blocks": 64, "token_budget": 16}
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def region_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    us = cluster.add_node(num_cpus=1, resources={"region-us": 1})
    eu = cluster.add_node(num_cpus=1, resources={"region-eu": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield {"head": cluster.head_node.node_id, "us": us.node_id, "eu": eu.node_id}
    ray.shutdown()
    cluster.shutdown()


def config() -> ServeConfig:
    return ServeConfig.model_validate(
        {
            "groups": [
                {"name": "a", "engine": ENGINE},
                {"name": "b", "engine": {**ENGINE, "tp": 2}},
            ],
            "regions": {
                "regions": [
                    {"name": "us", "groups": ["a"], "node_resource": "region-us"},
                    {"name": "eu", "groups": ["b"], "node_resource": "region-eu"},
                ]
            },
        }
    )


def test_each_regions_replica_and_its_workers_run_on_the_regions_node(region_nodes):
    assert len(set(region_nodes.values())) == 3
    cfg = config()
    actors = {}
    for group, region in (("a", "us"), ("b", "eu")):
        (g,) = [x for x in cfg.groups if x.name == group]
        remote = ray.remote(ReplicaActor).options(**_actor_options(cfg, g))
        actors[region] = remote.remote(None, cfg.group_engine_config(g))
    for region, actor in actors.items():
        node, workers = ray.get(actor.placement.remote(), timeout=300)
        assert node == region_nodes[region], f"{region}'s replica ran elsewhere"
        assert workers == ([region_nodes["eu"]] * 2 if region == "eu" else [])

    # the pinned tp=2 workers serve: the same greedy tokens as one process
    ref = ReplicaController.build(None, **ENGINE)
    prompt = [5, 9, 17, 33, 2, 71, 8, 13, 21]
    build = ref.request_builder()
    rid = ref.add_request(build.build(prompt, PARAMS))
    while ref.has_unfinished():
        ref.step()
    expected = ref.release(rid).token_ids
    ref.shutdown()
    out = ray.get(actors["eu"].generate.remote(build.build(prompt, PARAMS)), timeout=300)
    assert list(out.token_ids) == list(expected)
    for actor in actors.values():
        ray.get(actor.shutdown.remote(), timeout=60)


def node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def test_a_disaggregated_groups_actors_run_on_the_regions_node(region_nodes):
    cfg = ServeConfig.model_validate(
        {
            "groups": [
                {"name": "a", "engine": ENGINE},
                {
                    "name": "pd",
                    "num_prefill": 1,
                    "num_decode": 1,
                    "engine": ENGINE,
                    "store": {"dram_bytes": 1 << 22},
                },
            ],
            "regions": {
                "regions": [
                    {"name": "us", "groups": ["a"], "node_resource": "region-us"},
                    {"name": "eu", "groups": ["pd"], "node_resource": "region-eu"},
                ]
            },
        }
    )
    assert cfg.regions is not None
    (g,) = [x for x in cfg.groups if x.name == "pd"]
    pd = PDCluster(pd_cluster_config(None, g, "r0", cfg.regions.group_resources("pd")))
    try:
        actors = [*pd.prefills.values(), *pd.decodes.values(), *pd.shards.values()]
        assert len(actors) == 3
        assert {node_of(a) for a in actors} == {region_nodes["eu"]}
        prompt = [5, 9, 17, 33, 2, 71, 8, 13, 21]
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        ref = ReplicaController.build(None, **ENGINE)
        rid = ref.add_request(ref.request_builder().build(prompt, PARAMS))
        while ref.has_unfinished():
            ref.step()
        assert list(out.token_ids) == list(ref.release(rid).token_ids)
        ref.shutdown()
    finally:
        pd.shutdown()
