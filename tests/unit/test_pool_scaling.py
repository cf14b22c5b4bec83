"""Each pool of a disaggregated cluster scales on its own signal, averaged over its delay
(``policies.pool_scaling``); the Serve config's pool sections are checked where they are
written."""

from __future__ import annotations

import pytest

from actors.serving.config import ConfigError, ServeConfig
from policies.pool_scaling import DECODE_POOL, PREFILL_POOL, PoolScaler, PoolScaling

FAST = PoolScaling(min_replicas=1, max_replicas=4, target=100.0, upscale_delay_s=2.0,
                   downscale_delay_s=10.0)  # fmt: skip


def test_prefill_grows_on_the_mean_queue_over_its_delay_once_watched_that_long():
    s = PoolScaler(PREFILL_POOL, FAST)
    assert s.decide([150.0, 150.0], 2, now=0.0) == 2  # needs 3, but watched for 0 s
    assert s.last is not None and s.last.need == pytest.approx(3.0)
    assert s.last.signal == "queued_prefill_tokens"
    assert s.decide([150.0, 150.0], 2, now=1.0) == 2
    assert s.decide([250.0, 250.0], 2, now=2.5) == 4  # mean over 2 s: (300 + 500) / 2


def test_a_burst_is_averaged_with_the_quiet_looks_around_it():
    s = PoolScaler(PREFILL_POOL, FAST)
    for t in range(5):
        assert s.decide([0.0], 1, now=float(t)) == 1
    assert s.decide([120.0], 1, now=5.0) == 1  # mean over 2 s: (0 + 0 + 120) / 3 = 40
    assert s.decide([0.0], 1, now=5.5) == 1


def test_shrinks_with_hysteresis_on_both_windows_and_never_below_its_minimum():
    s = PoolScaler(PREFILL_POOL, FAST)
    assert s.decide([40.0, 40.0, 0.0], 3, now=0.0) == 3  # need 0.8 -> 2 at threshold 0.5
    assert s.decide([40.0, 40.0], 3, now=10.0) == 2
    assert s.decide([40.0, 40.0], 2, now=12.0) == 2
    assert s.decide([0.0, 0.0], 2, now=15.0) == 2  # the 10 s mean (53 tokens) still needs 2
    assert s.decide([0.0, 0.0], 2, now=21.0) == 1  # both windows quiet: min_replicas
    assert s.decide([0.0], 1, now=60.0) == 1


def test_a_step_that_just_began_is_not_averaged_away_by_the_quiet_before_it():
    s = PoolScaler(PREFILL_POOL, FAST)
    for t in range(10):
        s.decide([0.0, 0.0], 2, now=float(t))
    assert s.decide([180.0, 0.0], 2, now=10.0) == 2  # 10 s mean says 1; the last 2 s say 2


def test_decode_scales_on_kv_use_and_ignores_queued_prefill_work():
    s = PoolScaler(DECODE_POOL, PoolScaling(max_replicas=3, target=0.5, upscale_delay_s=0))
    assert s.decide([0.9], 1, now=0.0) == 2  # 0.9 / 0.5 -> 2 replicas
    assert s.last is not None and s.last.signal == "kv_usage"
    with pytest.raises(ValueError, match="KV use"):
        PoolScaler(DECODE_POOL, PoolScaling(target=2048.0))


def test_bounds_and_names_are_checked():
    with pytest.raises(ValueError, match="min_replicas"):
        PoolScaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="pool must be"):
        PoolScaler("both", FAST)


def pd_group(**sides) -> dict:
    return {"name": "pd", "num_prefill": 1, "num_decode": 1, "engine": {}, **sides}


def test_config_pool_autoscaling_needs_one_cluster_and_a_start_within_bounds():
    ok = ServeConfig.from_args({"groups": [pd_group(prefill={"autoscaling": {"max_replicas": 3}})]})
    (group,) = ok.groups
    assert group.prefill is not None and group.prefill.autoscaling is not None
    assert group.prefill.autoscaling.scaling(PREFILL_POOL).target == 2048.0
    with pytest.raises(ConfigError, match="num_replicas: 1"):
        ServeConfig.from_args({"groups": [pd_group(num_replicas=2, decode={"autoscaling": {}})]})
    with pytest.raises(ConfigError, match=r"num_prefill=1 .* \[2, 4\]"):
        ServeConfig.from_args({"groups": [pd_group(prefill={"autoscaling": {"min_replicas": 2}})]})
    with pytest.raises(ConfigError, match="KV use"):
        ServeConfig.from_args({"groups": [pd_group(decode={"autoscaling": {"target": 100}})]})
    with pytest.raises(ConfigError, match="tagret"):
        ServeConfig.from_args({"groups": [pd_group(decode={"autoscaling": {"tagret": 0.5}})]})
