"""The roofline cost model and the fitted predictor."""

from __future__ import annotations

import pytest

from placement.cost_model import RooflineCostModel, decode_time, prefill_time
from placement.fitted import FittedCostModel, PaddedFittedCostModel, padded_features
from placement.gpus import GPUS, get_gpu
from placement.model_specs import MODELS, get_model


def cost(model="llama3-70b", gpu="A800", tp=8):
    return RooflineCostModel(get_model(model), get_gpu(gpu), tp=tp)


def test_catalogs_cover_the_issue():
    for g in ("A100", "A800", "H100", "H800", "H200", "L20", "L40S", "H20"):
        assert g in GPUS
    for m in ("llama3-8b", "llama3-70b", "mixtral-8x22b", "dbrx", "tiny"):
        assert m in MODELS
    # Parameter counts derived from shapes match the published sizes.
    assert get_model("llama3-70b").total_params == pytest.approx(70.6e9, rel=0.01)
    assert get_model("llama3-8b").total_params == pytest.approx(8.03e9, rel=0.01)
    assert get_model("mixtral-8x22b").total_params == pytest.approx(141e9, rel=0.01)
    assert get_model("mixtral-8x22b").active_params == pytest.approx(39e9, rel=0.02)
    assert get_model("dbrx").total_params == pytest.approx(132e9, rel=0.01)


def test_kv_bytes_per_token_matches_mooncake_table_1():
    # l * 2 * d / gqa * s = 80 * 2 * 8192 / 8 * 2 bytes
    assert get_model("llama3-70b").kv_bytes_per_token == 80 * 2 * 8192 // 8 * 2


def test_prefill_is_compute_bound_and_attention_grows_quadratically():
    c = cost()
    t1, t2 = prefill_time(c, 8192), prefill_time(c, 16384)
    assert 2 * t1 < t2  # more than linear
    # Large-prefill time is the FLOP count over the effective compute.
    flops = c.linear_flops(8192, 1) + c.attention_flops([(8192, 0)])
    expected = c.overhead_s + flops / (8 * 312e12 * c.mfu) + c.allreduce_time(8192)
    assert t1 == pytest.approx(expected, rel=0.01)
    # A cached prefix saves compute: 8k new tokens over 8k cached cost less than 16k new.
    assert prefill_time(c, 8192, 8192) < t2


def test_decode_is_memory_bound_and_grows_with_context():
    c = cost()
    t = decode_time(c, 1, 1)
    weights = c.model.weight_bytes / (8 * 2039e9 * c.mbu)
    assert t == pytest.approx(c.overhead_s + weights + c.allreduce_time(1), rel=0.02)
    assert decode_time(c, 64, 64 * 8000) > decode_time(c, 64, 64 * 1000) > t


def test_tensor_parallelism_speeds_up_and_moe_reads_fewer_weights():
    assert prefill_time(cost(tp=8), 4096) < prefill_time(cost(tp=4), 4096)
    moe = RooflineCostModel(get_model("mixtral-8x22b"), get_gpu("H100"), tp=8)
    assert moe.weight_read_bytes(1) < moe.weight_read_bytes(1000) <= moe.model.weight_bytes
    assert cost().transfer_time(1000, 1e9) == pytest.approx(1000 * 327680 / 1e9)


def test_kv_capacity_and_does_not_fit():
    assert cost().kv_capacity_tokens() > 1_000_000
    with pytest.raises(ValueError):
        RooflineCostModel(get_model("llama3-70b"), get_gpu("L20"), tp=1).kv_capacity_tokens()


def test_fitted_model_recovers_a_roofline_like_law():
    truth = FittedCostModel([0.002, 1e-5, 2e-9, 1e-7, 1e-4])
    batches = [[(n, c)] for n in (1, 16, 128, 512, 2048) for c in (0, 100, 1000, 4000)]
    batches += [[(1, c)] * b for b in (2, 8, 32) for c in (10, 500, 3000)]
    fit = FittedCostModel.fit(batches, [truth.batch_time(b) for b in batches])
    for b in batches:
        assert fit.batch_time(b) == pytest.approx(truth.batch_time(b), rel=1e-6)
    assert all(w >= 0 for w in fit.weights)


def test_padded_features_price_a_decode_by_the_chunk_it_rides_with():
    # A 256-token chunk over 100 cached tokens with a decode at context 999: the batch is
    # padded to B=2 rows of max_q=256 queries over L=ceil(1000/16)*16=1008 keys.
    f = padded_features([(256, 100), (1, 999)], 16)
    assert f == [1.0, 257.0, 2 * 256 * 1008, 2 * 1008, 2.0]
    # Alone, the same decode is one query row over its own 1008 keys.
    assert padded_features([(1, 999)], 16) == [1.0, 1.0, 1008.0, 1008.0, 1.0]


def test_padded_fit_recovers_its_law_and_ignores_outliers():
    truth = PaddedFittedCostModel(16, [1e-3, 2e-5, 3e-8, 2e-7, 1e-4])
    batches = [[(n, c)] for n in (1, 7, 64, 256) for c in (0, 200, 900)]
    batches += [[(1, 100 + 37 * j) for j in range(b)] for b in (2, 5, 9, 30)]
    batches += [[(200, 50)] + [(1, 300 + 11 * j) for j in range(b)] for b in (1, 4, 12)]
    times = [truth.batch_time(b) for b in batches]
    times[3] *= 5  # a step slowed by something else (a GC pause, a co-tenant)
    fit = PaddedFittedCostModel.fit(16, batches, times, trim=0.1)
    for b in batches:
        assert fit.batch_time(b) == pytest.approx(truth.batch_time(b), rel=1e-6)
    assert fit.batch_time([]) == 0.0
