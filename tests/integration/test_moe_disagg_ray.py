"""A disaggregated MoE replica on Ray (actors/moe/ray_executor.py): attention and expert
workers as actors exchanging M2N/N2M messages over compiled-graph channels give the
single-process tokens; with m = 3 micro-batches attention and expert workers compute at the
same time (ping-pong); an expert or attention worker killed mid-generation is replaced and
the requests finish with the same tokens."""

from __future__ import annotations

import random

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from actors import LLM, SamplingParams  # noqa: E402
from actors.engine.replica_controller import ReplicaController  # noqa: E402
from actors.moe.ray_executor import RayMoEExecutor  # noqa: E402
from models import write_tiny_model  # noqa: E402

NEW_TOKENS = 6
LAYOUT = dict(attention_workers=2, expert_workers=3, micro_batches=3)


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A MoE model no other test uses: 6 experts, top 2, its own seed, and router rows of
    experts 5 and 2 scaled up (hot experts: uneven routing)."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("moe6"), kind="moe", seed=23, num_local_experts=6
    )
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            tensor[5] *= 4.0
            tensor[2] *= 3.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(8)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 13, 7, 21, 10, 5)]


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    llm = LLM(model_dir, dtype=torch.float64, block_size=4, chunk_size=8)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)]


def test_llm_with_attention_and_expert_workers_gives_the_single_process_tokens(
    cluster, model_dir, prompts, reference
):
    llm = LLM(model_dir, dtype=torch.float64, block_size=4, chunk_size=8, **LAYOUT)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayMoEExecutor)
        assert len(executor.attention) == 2 and len(executor.experts) == 3
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == reference
        assert llm.engine.kv.num_used_blocks == 0
        counts = executor.token_counts()
        assert min(counts[5], counts[2]) > max(counts[0], counts[1], counts[3], counts[4])
    finally:
        llm.engine.shutdown()


def test_attention_and_expert_workers_overlap_with_three_micro_batches(cluster, model_dir):
    """Stage times of the decode steps: an expert round of micro-batch j runs while an
    attention round of another micro-batch runs (the ping-pong pipeline)."""
    controller = ReplicaController.build(model_dir, dtype=torch.float64, block_size=4, **LAYOUT)
    try:
        builder = controller.request_builder()
        rng = random.Random(3)
        for _ in range(12):
            prompt = [rng.randrange(3, 500) for _ in range(6)]
            controller.add_request(builder.build(prompt, SamplingParams(max_tokens=8)))
        while controller.has_unfinished():
            controller.step()
        executor = controller.executor
        assert isinstance(executor, RayMoEExecutor)
        steps = list(executor.timeline)[-5:]  # decode steps
    finally:
        controller.shutdown()
    overlapping = 0
    for _, times in steps:
        attention = [t for t in times if t[0] == "attention"]
        experts = [t for t in times if t[0] == "expert"]
        assert {t[1] for t in experts} == {0, 1, 2}  # every expert worker, every round
        assert len(experts) == 3 * 4 * 3  # workers x layers x micro-batches
        overlapping += sum(
            1
            for e in experts
            if any(a[3] != e[3] and a[4] < e[5] and e[4] < a[5] for a in attention)
        )
    assert overlapping >= 5, f"only {overlapping} expert rounds overlapped an attention round"


@pytest.mark.parametrize("victim", ["expert", "attention"])
def test_worker_killed_mid_generation_is_replaced(cluster, model_dir, prompts, reference, victim):
    controller = ReplicaController.build(
        model_dir, dtype=torch.float64, block_size=4, chunk_size=8, **LAYOUT
    )
    try:
        builder = controller.request_builder()
        ids = [
            controller.add_request(r) for r in builder.build_each(prompts, [PARAMS] * len(prompts))
        ]
        for _ in range(4):
            controller.step()
        executor = controller.executor
        assert isinstance(executor, RayMoEExecutor)
        killed = executor.experts[1] if victim == "expert" else executor.attention[0]
        ray.kill(killed, no_restart=True)
        while controller.has_unfinished():
            controller.step()
        assert controller.num_recoveries >= 1
        assert [controller.release(rid).token_ids for rid in ids] == reference
        assert controller.kv.num_used_blocks == 0
    finally:
        controller.shutdown()


def test_expert_placement_replanned_on_ray(cluster, model_dir, prompts, reference):
    """With re-planning on, the observed rows move experts between new expert actors
    between steps (on this model's rows the starting placement's busiest worker carries
    1.25x what a fresh plan's does, over the 1.2 threshold), and the tokens stay the
    single-process ones."""
    llm = LLM(
        model_dir,
        dtype=torch.float64,
        block_size=4,
        chunk_size=8,
        rebalance_experts_s=0.0,
        **LAYOUT,
    )
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayMoEExecutor)
        first = executor.spec.placement
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == reference
        assert executor.num_replans >= 1 and executor.spec.placement != first
        assert executor.balancer is not None
        assert executor.spec.placement == executor.balancer.placement
        assert executor.balancer.imbalance() <= 1.2
        again = llm.generate(prompt_token_ids=prompts[:2], sampling_params=PARAMS)
        assert [o.token_ids for o in again] == reference[:2]
    finally:
        llm.engine.shutdown()
