"""Medha's packer sizes chunks to the steps' measured tail: ``RuntimePredictor.overrun``
(recent steps' measured / predicted time) and ``TailStepTime`` (the fit scaled by it)."""

from __future__ import annotations

import pytest

from actors.engine.controller_builder import build_parts
from placement.runtime_predictor import OVERRUN_WINDOW, RuntimePredictor, TailStepTime
from policies.batch_packer import BatchPacker, PrefillCandidate
from policies.pd_costs import LinearPrefillTime

TRUTH = LinearPrefillTime(base=4e-3, per_new_token=2e-5, per_attention_pair=4e-8)
DECODES = [(1, 300), (1, 900)]
SHAPES = [
    *([(n, c)] for n in (16, 64, 256, 512) for c in (0, 1024, 4096)),
    *([(n, c), *DECODES[:k]] for n in (32, 128) for c in (512, 2048) for k in (1, 2)),
    [(1, 100)],
    DECODES,
]


def fitted() -> RuntimePredictor:
    """Fitted once to exact steps; ``observe`` never refits it (so every ratio it records
    is against that one fit)."""
    p = RuntimePredictor(window=16, min_samples=16, refit_every=10**9)
    p.fit_steps(SHAPES, [TRUTH.step_time(b) for b in SHAPES])
    return p


def test_overrun_is_a_quantile_of_measured_over_predicted_for_steps_with_a_chunk():
    p = RuntimePredictor()
    p.observe([(128, 0)], 1.0)
    assert p.overrun(0.9) == 1.0 and not p.overruns  # no fit yet: nothing to compare with
    p = fitted()
    multipliers = [1.0] * 16 + [1.2, 1.5, 2.0, 3.0]
    for k, m in enumerate(multipliers):
        batch = [*DECODES, (32 + 16 * k, 64 * k)]
        p.observe(batch, m * TRUTH.step_time(batch))
        p.observe(DECODES, 10 * TRUTH.step_time(DECODES))  # decode-only: not counted
    assert len(p.overruns) == len(multipliers)
    assert p.overrun(0.9) == pytest.approx(2.0)  # the 18th of 20 sorted
    assert p.overrun(0.5) == pytest.approx(1.0)
    assert p.overrun(1.0) == pytest.approx(3.0)
    assert p.overrun(0.9, min_steps=21) == 1.0  # too few measured
    for _ in range(OVERRUN_WINDOW):  # only the last OVERRUN_WINDOW steps count
        p.observe([(64, 0)], 1.1 * TRUTH.step_time([(64, 0)]))
    assert p.overrun(1.0) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        p.overrun(1.5)


def test_tail_chunks_are_the_largest_whose_scaled_time_fits_the_target():
    p = fitted()
    tail = TailStepTime(p, quantile=0.9)
    assert tail.factor() == 1.0  # nothing measured yet: the fit itself
    for k in range(20):  # one step in ten runs at 1.6x the fit, the others at 1.25x
        batch = [(64, 128 * k)]
        p.observe(batch, (1.6 if k % 10 == 9 else 1.25) * TRUTH.step_time(batch))
    assert tail.factor() == pytest.approx(1.6)
    target, context = 0.02, 2048
    n = tail.largest_chunk(DECODES, context, target, 4096)
    assert 1.6 * TRUTH.step_time([*DECODES, (n, context)]) <= target * (1 + 1e-6)
    assert 1.6 * TRUTH.step_time([*DECODES, (n + 1, context)]) > target * (1 - 1e-6)
    assert tail.batch_time(DECODES) == pytest.approx(1.6 * p.batch_time(DECODES))
    assert tail.efficient_chunk(context) == p.efficient_chunk(context)
    # the packer built on it: a smaller chunk than the mean fit's, under the target at 1.6x
    big = [PrefillCandidate(uncomputed=4000, context=context)]
    (mean_chunk,) = BatchPacker(p, target).pack(DECODES, big, 8192)
    (tail_chunk,) = BatchPacker(tail, target).pack(DECODES, big, 8192)
    assert tail_chunk == n < mean_chunk
    assert 1.6 * TRUTH.step_time([*DECODES, (mean_chunk, context)]) > target


def test_the_engines_packer_sizes_with_the_tail_of_its_own_predictor():
    parts = build_parts(None, target_batch_time=0.05, num_blocks=64, block_size=16)
    try:
        packer = parts.scheduler.packer
        assert isinstance(packer, BatchPacker)
        assert isinstance(packer.predictor, TailStepTime)
        assert packer.predictor.predictor is parts.predictor
    finally:
        parts.executor.shutdown()
