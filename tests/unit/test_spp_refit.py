"""Medha under sequence-pipeline parallelism: the runtime predictor refits from pipelined
steps and the adaptive chunk follows the context as it does without SPP.

A pipelined executor in process: it runs each step on the one in-process worker in
submission order (so tokens are the engine's own) but keeps two steps in flight, as an
``spp=2`` replica does, and reports each step's stages as a known step model would time
them (half of the step's time per stage). No Ray: the real two-stage case is in
``tests/integration/test_layouts.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from actors.engine.controller_builder import build_parts
from actors.engine.executor import Executor
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.engine.step_plan import StepPlan, StepResult
from policies.pd_costs import LinearPrefillTime

# What the stages' time is made of, per step (the whole model's pass over the batch).
TRUE = LinearPrefillTime(base=4e-3, per_new_token=2e-5, per_attention_pair=4e-8)
TARGET = 0.02  # seconds: the decodes' TBT target the packer sizes chunks under
OPTIONS = dict(dtype=torch.float64, num_blocks=160, block_size=16)


class TwoStagePipeline:
    """Two steps in flight; each result's ``timings`` are two stages of half the model's
    time for the step's batch, at arbitrary wall-clock offsets (only durations count)."""

    depth = 2

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.chunks: list[list[tuple[int, int]]] = []  # (new tokens, start) per step

    def submit(self, plan: StepPlan) -> StepResult:
        batch = [(e.num_tokens, e.start) for e in plan.entries]
        self.chunks.append(batch)
        result = self.inner.result(self.inner.submit(plan))
        half = TRUE.step_time(batch) / 2
        result.timings = [(0, 100.0, 100.0 + half), (1, 500.0, 500.0 + half)]
        return result

    def result(self, handle: StepResult) -> StepResult:
        return handle

    def restart(self) -> None:
        self.inner.restart()

    def hook_info(self) -> list[Any]:
        return self.inner.hook_info()

    def on_idle(self) -> None:
        pass

    def shutdown(self) -> None:
        self.inner.shutdown()


def run(controller: ReplicaController, prompts: list[list[int]], max_tokens: int) -> list:
    builder = controller.request_builder()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [controller.add_request(builder.build(p, params)) for p in prompts]
    while controller.has_unfinished():
        controller.step()
    return [controller.release(rid).token_ids for rid in ids]


def test_pipelined_steps_refit_the_predictor_and_chunks_shrink_as_context_grows():
    parts = build_parts(None, target_batch_time=TARGET, **OPTIONS)
    pipeline = TwoStagePipeline(parts.executor)
    controller = ReplicaController(dataclasses.replace(parts, executor=pipeline))
    # their chunks fit the predictor: 16 steps at the cold-start guess of ~190 tokens a
    # chunk, of several shapes (the prompts' lengths differ, and so do their last chunks)
    warm = [[(k + 11 * i) % 250 + 3 for i in range(300 + 23 * k)] for k in range(8)]
    long = [[(7 * i) % 200 + 3 for i in range(1200)]]  # no prefix shared with ``warm``
    reference = ReplicaController.build(None, **OPTIONS)  # one stage, fixed chunks
    try:
        for prompt in warm:
            run(controller, [prompt], 1)
        predictor = controller.predictor
        assert predictor is not None and predictor.fitted  # never, before SPP refits
        seen = len(pipeline.chunks)
        tokens = run(controller, long, 4)
        assert tokens == run(reference, long, 4)
    finally:
        controller.shutdown()
        reference.shutdown()
    fit = predictor.prefill_time
    assert fit is not None
    # the measured time is the stages' sum: the step model itself, recovered
    assert fit.per_attention_pair == pytest.approx(TRUE.per_attention_pair, rel=1e-6)
    assert fit.base + fit.per_request == pytest.approx(TRUE.base, rel=1e-6)
    prompt_steps = [b for b in pipeline.chunks[seen:] if b[0][0] > 1]  # the prefill
    chunks = [n for ((n, _),) in prompt_steps]
    starts = [at for ((_, at),) in prompt_steps]
    assert starts == [sum(chunks[:k]) for k in range(len(chunks))]  # one chunk after another
    assert sum(chunks) == 1200
    full = chunks[:-1]  # the last is what was left of the prompt
    assert len(full) >= 3
    assert all(a >= b for a, b in zip(full, full[1:], strict=False)), chunks
    assert full[-1] < full[0], chunks
    for n, at in zip(full, starts, strict=False):  # each the largest under the target
        assert TRUE.step_time([(n, at)]) <= TARGET * (1 + 1e-6), (n, at)
        assert TRUE.step_time([(n + 1, at)]) > TARGET * (1 - 1e-6), (n, at)
