"""The Conductor's runtime estimates: fitted by least squares to measured samples."""

from __future__ import annotations

import pytest

from policies.pd_costs import (
    LinearDecodeTBT,
    LinearPrefillTime,
    fit_decode_tbt,
    fit_prefill_time,
    least_squares,
    transfer_time_fn,
)


def test_least_squares_solves_an_exact_system():
    rows = [(1.0, 0.0), (1.0, 1.0), (1.0, 2.0)]
    assert least_squares(rows, [1.0, 3.0, 5.0]) == pytest.approx([1.0, 2.0], abs=1e-6)


def test_prefill_fit_recovers_the_model_and_cached_tokens_are_cheaper():
    truth = LinearPrefillTime(0.002, 1e-4, 1e-6, 1e-8)
    samples = [(n, c, truth(n, c)) for n in (16, 64, 256, 1024) for c in (0, 128, 512)]
    fitted = fit_prefill_time(samples)
    for n, c, t in samples:
        assert fitted(n, c) == pytest.approx(t, rel=1e-4)
    # reusing a prefix beats computing it
    assert fitted(100, 400) < fitted(500, 0)


def test_decode_fit_and_transfer_time():
    truth = LinearDecodeTBT(0.005, 1e-4, 2e-6)
    samples = [(b, k, truth(b, k)) for b in (1, 4, 16) for k in (10, 100, 1000)]
    fitted = fit_decode_tbt(samples)
    assert fitted(8, 500) == pytest.approx(truth(8, 500), rel=1e-4)
    assert transfer_time_fn(1024, 1024.0)(3) == 3.0
    with pytest.raises(ValueError):
        transfer_time_fn(0, 1.0)
