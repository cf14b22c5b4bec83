"""Medha under SPP on Ray: a two-stage replica's runtime predictor refits from its pipelined
steps, its adaptive chunks shrink as the long prompt's context grows, and its greedy tokens
equal the single-process engine's.

The tiny model's own compute hardly depends on the context, so each stage's step hook adds
what attention over a long context costs: a sleep of ``PAIR_SECONDS`` per (new token,
earlier token) pair of the step, half the model's layers per stage. That is a cost the
predictor has to learn from the stages' measured times; the chunks are then its answer.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import ray
import torch

from actors.engine.collectives import Layout  # noqa: E402
from actors.engine.replica_controller import ReplicaController  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from actors.engine.step_plan import StepPlan  # noqa: E402
from actors.engine.worker_hooks import WorkerHooks  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402

# The hook factory travels to the workers by value: they cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PAIR_SECONDS = 1e-7  # per stage
TARGET = 0.05  # seconds: the packer's target step time
OPTIONS = dict(dtype=torch.float64, num_blocks=160, block_size=16)
LONG = [(7 * i) % 200 + 3 for i in range(1500)]
# Prompts of several lengths whose chunks fit the predictor first (8 steps at least).
WARM = [[(k + 11 * i) % 250 + 3 for i in range(500 + 97 * k)] for k in range(6)]


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def attention_cost_hooks(coords: tuple[int, int, int], layout: Layout) -> WorkerHooks:
    """Each stage sleeps for its share of the step's attention pairs; stage 0 reports the
    step's ``(new tokens, start)`` per entry."""

    class AttentionCost:
        def begin_step(self, plan: StepPlan, kv_caches: Any) -> None:
            pairs = sum(e.num_tokens * e.end for e in plan.entries)
            time.sleep(PAIR_SECONDS * pairs)

        def after_layer(self, layer: int, kv_cache: Any) -> None:
            pass

        def end_step(self, plan: StepPlan, kv_caches: Any) -> Any:
            if coords[1] != 0:
                return None
            return [(e.num_tokens, e.start) for e in plan.entries]

    return WorkerHooks(step=AttentionCost())


def run(controller: ReplicaController, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rid = controller.add_request(controller.request_builder().build(prompt, params))
    while controller.has_unfinished():
        controller.step()
    return controller.release(rid).token_ids


def test_spp2_refits_from_pipelined_steps_and_chunks_follow_the_context(cluster):
    reference = ReplicaController.build(tiny_model_dir("dense"), **OPTIONS)
    try:
        want = run(reference, LONG, 4)
    finally:
        reference.shutdown()
    controller = ReplicaController.build(
        tiny_model_dir("dense"),
        worker_hooks=attention_cost_hooks,
        spp=2,
        target_batch_time=TARGET,
        **OPTIONS,
    )
    try:
        for prompt in WARM:
            run(controller, prompt, 1)
        predictor = controller.predictor
        assert predictor is not None and predictor.fitted  # from pipelined steps only
        controller.take_hook_reports()
        got = run(controller, LONG, 4)
        steps = [r for r in controller.take_hook_reports() if r is not None]
    finally:
        controller.shutdown()
    assert got == want
    fit = predictor.prefill_time
    assert fit is not None and fit.per_attention_pair > 0
    # The prompt's chunks, in order: the steps that start inside it (a last chunk may be 1 token).
    chunks = [n for ((n, start),) in steps if start < len(LONG)]
    assert sum(chunks) == len(LONG)
    full = chunks[:-1]  # the last is what was left of the prompt
    # the first chunks follow a fit made from the warm-up's steps, which a loaded machine
    # can make slow: the largest of the first half, not the first, is the early size
    assert len(full) >= 3 and full[-1] < max(full[: len(full) // 2]), chunks
