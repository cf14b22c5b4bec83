"""The Conductor's runtime estimates: fitted by least squares to measured steps, and kept
fitted from a sliding window of measurements."""

from __future__ import annotations

import pytest

from policies.conductor import Conductor
from policies.pd_costs import (
    CostFitter,
    LinearDecodeTBT,
    LinearPrefillTime,
    fit_decode_tbt,
    fit_prefill_time,
    fit_transfer_time,
    least_squares,
    prefill_features,
    transfer_time_fn,
)


def test_least_squares_solves_an_exact_system():
    rows = [(1.0, 0.0), (1.0, 1.0), (1.0, 2.0)]
    assert least_squares(rows, [1.0, 3.0, 5.0]) == pytest.approx([1.0, 2.0], abs=1e-6)


def test_prefill_fit_recovers_the_model_and_cached_tokens_are_cheaper():
    truth = LinearPrefillTime(0.002, 1e-4, 1e-6, 1e-8)
    shapes = [(n, c) for n in (16, 64, 256, 1024) for c in (0, 128, 512)]
    samples = [([(n, c)], truth(n, c)) for n, c in shapes]
    fitted = fit_prefill_time(samples)
    for n, c in shapes:
        assert fitted(n, c) == pytest.approx(truth(n, c), rel=1e-4)
    # reusing a prefix beats computing it
    assert fitted(100, 400) < fitted(500, 0)


def test_a_chunked_prompt_costs_one_step_per_chunk_each_reading_the_context_before_it():
    model = LinearPrefillTime(1.0, 0.1, 0.01, 0.001, chunk_size=8)
    # 20 new tokens after 4 cached: chunks (8 after 4), (8 after 12), (4 after 20)
    assert prefill_features([(8, 4), (8, 12), (4, 20)]) == (3, 20, 36, 8 * 12 + 8 * 20 + 4 * 24)
    want = 3 * 1.0 + 20 * 0.1 + 36 * 0.01 + (8 * 12 + 8 * 20 + 4 * 24) * 0.001
    assert model(20, 4) == pytest.approx(want)
    assert LinearPrefillTime(1.0, chunk_size=0)(20, 4) == 1.0  # one pass


def test_steps_running_several_requests_fit_the_per_request_model():
    truth = LinearPrefillTime(0.003, 2e-4, 1e-6, 1e-7)

    def step_time(chunks):
        steps, n, c, pairs = prefill_features(chunks)
        return (
            truth.base
            + truth.per_new_token * n
            + truth.per_cached_token * c
            + (truth.per_attention_pair * pairs)
        )

    steps = [[(8, 0)], [(8, 8), (4, 0)], [(16, 32)], [(2, 64), (8, 0), (8, 16)], [(32, 0)]]
    steps += [[(n, c)] for n in (4, 24, 64) for c in (0, 40, 200)]
    fitted = fit_prefill_time([(s, step_time(s)) for s in steps])
    assert fitted(48, 100) == pytest.approx(truth(48, 100), rel=1e-4)


def test_decode_fit_trims_host_stalls():
    # 40 steps on the truth, 2 of them (the largest batches) stalled by 0.5 s: least squares
    # bends its slope towards the stalls; the trimmed fit keeps the truth
    truth = LinearDecodeTBT(0.02, 0.002, 0.0)
    samples = [(b, 10 * b, truth(b, 10 * b)) for b in range(1, 21)] * 2
    samples[19] = (20, 200, truth(20, 200) + 0.5)
    samples[18] = (19, 190, truth(19, 190) + 0.5)
    plain, trimmed = fit_decode_tbt(samples), fit_decode_tbt(samples, trim=0.1)
    assert plain(4, 40) < 0.9 * truth(4, 40) or plain(20, 200) > 1.1 * truth(20, 200)
    assert trimmed(4, 40) == pytest.approx(truth(4, 40), rel=1e-6)
    assert trimmed(20, 200) == pytest.approx(truth(20, 200), rel=1e-6)


def test_decode_fit_and_transfer_time():
    truth = LinearDecodeTBT(0.005, 1e-4, 2e-6)
    samples = [(b, k, truth(b, k)) for b in (1, 4, 16) for k in (10, 100, 1000)]
    fitted = fit_decode_tbt(samples)
    assert fitted(8, 500) == pytest.approx(truth(8, 500), rel=1e-4)
    assert fit_decode_tbt(samples, trim=0.1)(8, 500) == pytest.approx(truth(8, 500), rel=1e-4)
    assert transfer_time_fn(1024, 1024.0)(3) == 3.0
    with pytest.raises(ValueError):
        transfer_time_fn(0, 1.0)
    # 4 blocks in 1 s and 12 in 2 s: 16 blocks of 1 KiB in 3 s
    measured = fit_transfer_time([(4, 1.0), (12, 2.0)], 1024)
    assert measured(16) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        fit_transfer_time([], 1024)


def conductor() -> Conductor:
    return Conductor(
        prefill_time=LinearPrefillTime(base=9.0),
        decode_tbt=LinearDecodeTBT(base=9.0),
        transfer_time=transfer_time_fn(1, 1.0),
        ttft_slo=10.0,
        tbt_slo=10.0,
    )


def test_cost_fitter_replaces_estimates_once_enough_is_measured():
    truth = LinearPrefillTime(0.01, 1e-3, 1e-5, 0.0, chunk_size=16)
    fitter = CostFitter(block_bytes=1024, chunk_size=16, window=16, min_samples=4, refit_every=4)
    c = conductor()
    before = c.prefill_time
    for n, ctx in [(16, 0), (8, 0)]:
        fitter.add_prefill_step([(n, ctx)], truth(n, ctx))
    assert fitter.refit(c) == [] and c.prefill_time is before  # too few samples
    for n, ctx in [(16, 16), (4, 40), (12, 3), (16, 64)]:
        fitter.add_prefill_step([(n, ctx)], truth(n, ctx))
    assert fitter.refit(c) == ["prefill"]
    assert isinstance(c.prefill_time, LinearPrefillTime) and c.prefill_time.chunk_size == 16
    assert c.prefill_time(40, 8) == pytest.approx(truth(40, 8), rel=1e-3)
    assert fitter.refit(c) == []  # nothing new since
    # decode and transfer are fitted independently; the window keeps the newest samples
    for b in (1, 2, 3, 4, 5):
        fitter.add_decode_step(b, 10 * b, 0.01 + 0.002 * b)
    for _ in range(4):
        fitter.add_transfer(8, 8 * 1024 / 2048.0)
    assert sorted(fitter.refit(c)) == ["decode", "transfer"]
    assert c.decode_tbt(6, 60) == pytest.approx(0.022, rel=1e-3)
    assert c.transfer_time(2) == pytest.approx(1.0)
    for i in range(40):
        fitter.add_prefill_step([(1 + i % 16, 0)], 1.0)
    assert len(fitter.prefill) == 16 and fitter.num_fits["prefill"] == 1
    fitter.add_decode_step(0, 0, 1.0)  # an empty step is no measurement
    assert len(fitter.decode) == 5
    with pytest.raises(ValueError):
        CostFitter(1024, window=2, min_samples=4)


def test_the_fit_prices_requests_and_keeps_small_steps_right_beside_big_ones():
    # Truth: 1 ms a step, 20 us a token, 30 us a request, and an extra 30% on steps of
    # more than 128 tokens that no feature models (a kernel switch, say). Many one-decode
    # steps and decode batches, a few big chunks: the decodes' price holds within 2%.
    def truth(chunks):
        tokens = sum(n for n, _ in chunks)
        t = 1e-3 + 2e-5 * tokens + 3e-5 * len(chunks)
        return t * (1.3 if tokens > 128 else 1.0)

    steps = [[(1, 100 + i)] for i in range(40)]
    steps += [[(1, 50)] * b for b in (2, 4, 8, 16, 32)]
    steps += [[(n, 0)] for n in (192, 256)] * 3
    fitted = fit_prefill_time([(s, truth(s)) for s in steps])
    assert fitted.per_request > 0
    for s in ([(1, 120)], [(1, 50)] * 8, [(1, 50)] * 32):
        assert fitted.step_time(s) == pytest.approx(truth(s), rel=0.02)


def test_trimming_drops_timing_outliers():
    truth = LinearPrefillTime(1e-3, 2e-5, 1e-7, 1e-9, per_request=4e-5)
    steps = [[(n, c)] for n in (1, 8, 64, 256) for c in (0, 128, 512)]
    steps += [[(1, c)] * b for b in (2, 8, 32) for c in (16, 256)]
    samples = [(s, truth.step_time(s)) for s in steps]
    samples[3] = (samples[3][0], 10 * samples[3][1])  # one step stalled (a GC pause)
    clean = fit_prefill_time(samples, trim=0.1)
    for s in steps:
        assert clean.step_time(s) == pytest.approx(truth.step_time(s), rel=1e-3)
    noisy = fit_prefill_time(samples)
    assert max(abs(noisy.step_time(s) / truth.step_time(s) - 1) for s in steps) > 0.005
    with pytest.raises(ValueError):
        fit_prefill_time([([(1, 0)], 0.0)])
