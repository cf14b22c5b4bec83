"""What the disaggregation tests share: one local Ray cluster per module, prompts, and the
colocated reference they are compared against."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
BS = 4
OPTS = dict(dtype=torch.float64, block_size=BS, num_blocks=64, token_budget=16, chunk_size=8)
ENGINE = EngineConfig(**OPTS)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def pd_config(num_prefill: int = 1, num_decode: int = 1, **fields: Any) -> PDClusterConfig:
    """A P/D cluster of the tiny model: ``num_prefill`` prefill and ``num_decode`` decode
    replicas on ``ENGINE``; ``fields`` set (or replace) any other ``PDClusterConfig`` field."""
    fields.setdefault("engine", ENGINE)
    fields.setdefault("prefill", PDSideConfig(num_prefill))
    fields.setdefault("decode", PDSideConfig(num_decode))
    return PDClusterConfig(**fields)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(
        "local",  # a new cluster, never one that `ray start` recorded on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def two_node_cluster(*paths: Path) -> Iterator[Any]:
    """A module's Ray cluster of two raylets on this machine (the head with 2 CPUs, one
    more node with 1), its workers importing the repository and ``paths``; for a
    module-scoped fixture to ``yield from``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    # the workers import the repository from the driver's working directory, as Ray adds it;
    # ``paths`` (a test module's actor, a package outside the environment) they are given
    env = {"PYTHONPATH": os.pathsep.join(map(str, paths))} if paths else None
    ray.init(
        address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env} if env else None
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def colocated(prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[list[int]]:
    ref = ReplicaController.build(None, **OPTS)
    build = ref.request_builder()
    ids = [ref.add_request(build.build(p, params)) for p in prompts]
    while ref.has_unfinished():
        ref.step()
    out = [ref.release(i).token_ids for i in ids]
    ref.shutdown()
    return out
