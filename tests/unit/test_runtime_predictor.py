"""The replica's runtime predictor: the roofline prior, the online fit through the
Conductor's ``CostFitter``, remaining prefill time and chunk sizing."""

from __future__ import annotations

import random

import pytest

from placement.cost_model import RooflineCostModel
from placement.gpus import get_gpu
from placement.model_specs import get_model
from placement.runtime_predictor import RuntimePredictor
from policies.pd_costs import LinearPrefillTime

TRUTH = LinearPrefillTime(
    base=2e-3, per_new_token=5e-5, per_cached_token=2e-7, per_attention_pair=1e-9
)


def random_batch(rng: random.Random) -> list[tuple[int, int]]:
    batch = [(1, rng.randrange(16, 4096)) for _ in range(rng.randrange(0, 12))]
    for _ in range(rng.randrange(0, 3)):
        batch.append((rng.randrange(2, 1024), rng.randrange(0, 8192)))
    return batch or [(rng.randrange(2, 512), 0)]


def fitted_predictor(samples: int = 64, seed: int = 0) -> RuntimePredictor:
    rng = random.Random(seed)
    p = RuntimePredictor(min_samples=16, refit_every=16)
    for _ in range(samples):
        batch = random_batch(rng)
        p.observe(batch, TRUTH.step_time(batch))
    return p


def test_the_prior_answers_until_enough_steps_are_measured():
    roofline = RooflineCostModel(get_model("llama3-8b"), get_gpu("A100"), tp=8)
    p = RuntimePredictor(prior=roofline, min_samples=4, refit_every=4)
    batch = [(512, 1024), (1, 300), (1, 700)]
    assert p.batch_time(batch) == roofline.batch_time(batch)
    assert not p.fitted
    refits = [p.observe([(n, 0)], TRUTH.step_time([(n, 0)])) for n in (8, 64, 256, 1024)]
    assert refits == [False, False, False, True]
    assert p.fitted and p.fitter.num_fits["prefill"] == 1
    assert p.batch_time(batch) != roofline.batch_time(batch)


def test_online_fit_predicts_mixed_batches_it_never_saw():
    p = fitted_predictor()
    rng = random.Random(99)
    for _ in range(50):
        batch = random_batch(rng)
        assert p.batch_time(batch) == pytest.approx(TRUTH.step_time(batch), rel=1e-3)
    assert p.batch_time([]) == 0.0


def test_remaining_prefill_time_is_its_chunks_each_reading_the_context_before_it():
    p = fitted_predictor()
    p.chunk_size = 256
    want = sum(p.batch_time([(256, 100 + k * 256)]) for k in range(3)) + p.batch_time(
        [(32, 100 + 768)]
    )
    assert p.remaining_prefill_time(800, 100) == pytest.approx(want)
    # the same tokens deeper in the context cost more; none left costs nothing
    assert p.remaining_prefill_time(800, 5000) > p.remaining_prefill_time(800, 100)
    assert p.remaining_prefill_time(0, 100) == 0.0


def test_efficient_chunk_amortizes_the_fixed_cost():
    p = fitted_predictor()
    for context in (0, 4096, 65536):
        n = p.efficient_chunk(context, tolerance=0.25)
        per = [p.batch_time([(m, context)]) / m for m in (1 << k for k in range(14))]
        assert p.batch_time([(n, context)]) / n <= min(per) * 1.25 + 1e-15
        assert p.batch_time([(n - 1, context)]) / (n - 1) > min(per) * 1.25
    # a fixed cost that is larger needs a larger chunk to amortize it
    heavy = RuntimePredictor()
    heavy.prefill_time = LinearPrefillTime(base=2e-2, per_new_token=5e-5)
    light = RuntimePredictor()
    light.prefill_time = LinearPrefillTime(base=2e-4, per_new_token=5e-5)
    assert heavy.efficient_chunk(0) > light.efficient_chunk(0)


def test_largest_chunk_keeps_the_batch_under_the_target():
    p = fitted_predictor()
    decodes = [(1, 2000)] * 8
    for target in (0.01, 0.03, 0.1):
        n = p.largest_chunk(decodes, 10_000, target, limit=100_000)
        assert n > 0
        assert p.batch_time([*decodes, (n, 10_000)]) <= target
        assert p.batch_time([*decodes, (n + 1, 10_000)]) > target
    assert p.largest_chunk(decodes, 0, 1e-6, limit=1000) == 0
    assert p.largest_chunk([], 0, 10.0, limit=77) == 77


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        RuntimePredictor(chunk_size=0)
    with pytest.raises(ValueError, match="limit"):
        RuntimePredictor().efficient_chunk(0, limit=0)


def test_a_long_prompt_is_priced_in_few_runs_exactly_for_a_linear_model():
    p = fitted_predictor()
    exact = sum(p.batch_time([(256, 7 + k * 256)]) for k in range(390)) + p.batch_time(
        [(160, 7 + 390 * 256)]
    )
    assert p.remaining_prefill_time(390 * 256 + 160, 7, chunk=256) == pytest.approx(exact, rel=1e-3)
