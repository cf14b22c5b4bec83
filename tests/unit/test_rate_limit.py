"""Per-key rate limits (token buckets on an injected clock) and the constant-time key check."""

from __future__ import annotations

import math

import pytest

from actors.serving.config import ApiKeyConfig, ServeConfig
from policies.api_keys import KeyRing
from policies.rate_limit import KeyRateLimits, RateLimiter, TokenBucket


def test_bucket_starts_full_and_refills_continuously():
    b = TokenBucket(60)  # 60 per minute: one per second
    assert b.wait_for(60, now=0.0) == 0
    b.take(60, now=0.0)
    assert b.wait_for(1, now=0.0) == pytest.approx(1.0)
    assert b.wait_for(1, now=0.5) == pytest.approx(0.5)
    assert b.wait_for(1, now=1.0) == 0
    assert b.wait_for(10, now=1.0) == pytest.approx(9.0)
    assert b.wait_for(60, now=1000.0) == 0  # never more than one minute's worth
    assert b.level == 60
    assert b.wait_for(61, now=1000.0) == math.inf  # more than the capacity never fits


def test_bucket_clock_going_backwards_is_harmless():
    b = TokenBucket(60)
    b.take(60, now=10.0)
    assert b.wait_for(1, now=5.0) == pytest.approx(1.0)  # no refill, no negative time


def test_requests_per_minute_refuses_with_retry_after_naming_the_limit():
    lim = RateLimiter({"k": KeyRateLimits(requests_per_minute=2)})
    assert lim.admit("k", 1000, now=0.0) is None
    assert lim.admit("k", 1000, now=1.0) is None
    refused = lim.admit("k", 1, now=2.0)
    assert refused is not None and refused.limit == "requests_per_minute"
    assert refused.value == 2
    assert refused.retry_after == pytest.approx(28.0)  # one request back every 30 s
    assert lim.admit("k", 1, now=30.0) is None
    assert lim.admit("other", 10**9, now=0.0) is None  # keys without limits: always admitted


def test_tokens_per_minute_reserve_and_settle():
    lim = RateLimiter({"k": KeyRateLimits(tokens_per_minute=600)})  # 10 tokens/s
    assert lim.admit("k", 500, now=0.0) is None
    refused = lim.admit("k", 200, now=0.0)
    assert refused is not None and refused.limit == "tokens_per_minute"
    assert refused.retry_after == pytest.approx(10.0)
    lim.settle("k", reserved=500, used=120, now=0.0)  # stopped early: 380 come back
    assert lim.admit("k", 200, now=0.0) is None
    assert lim.check("k", 280, now=0.0) is None and lim.check("k", 281, now=0.0) is not None


def test_settle_over_the_reservation_leaves_debt_that_refuses_new_requests():
    lim = RateLimiter({"k": KeyRateLimits(tokens_per_minute=60)})
    assert lim.admit("k", 60, now=0.0) is None
    lim.settle("k", reserved=60, used=90, now=0.0)  # 30 tokens of debt
    refused = lim.check("k", 0, now=0.0)  # the ingress's check before reading a body
    assert refused is not None and refused.retry_after == pytest.approx(30.0)
    assert lim.check("k", 0, now=30.0) is None


def test_a_request_over_the_whole_limit_never_fits():
    lim = RateLimiter({"k": KeyRateLimits(tokens_per_minute=100)})
    refused = lim.admit("k", 101, now=0.0)
    assert refused is not None and refused.never_fits


def test_admit_takes_both_limits_or_neither_and_names_the_longer_wait():
    lim = RateLimiter({"k": KeyRateLimits(requests_per_minute=60, tokens_per_minute=60)})
    assert lim.admit("k", 60, now=0.0) is None  # all the tokens, one of 60 requests
    refused = lim.admit("k", 30, now=0.0)
    assert refused is not None and refused.limit == "tokens_per_minute"
    assert refused.retry_after == pytest.approx(30.0)
    # the refused request took no request from the request bucket: 59 are left
    for i in range(59):
        assert lim.admit("k", 0, now=0.0) is None, i
    refused = lim.admit("k", 0, now=0.0)
    assert refused is not None and refused.limit == "requests_per_minute"


def test_key_ring_matches_every_configured_key_and_nothing_else():
    ring = KeyRing({"sk-alpha-0001": "a", "sk-beta-00002": "b"})
    assert len(ring) == 2
    assert ring.match("sk-alpha-0001") == "a"
    assert ring.match("sk-beta-00002") == "b"
    for wrong in ("", "sk-alpha-000", "sk-alpha-00011", "SK-ALPHA-0001", "\udcff", "x" * 10_000):
        assert ring.match(wrong) is None
    assert KeyRing({}).match("anything") is None


def test_key_ring_compares_with_every_key_without_early_exit(monkeypatch):
    import policies.api_keys as mod

    calls: list[tuple[bytes, bytes]] = []
    real = mod.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(mod.hmac, "compare_digest", spy)
    ring = KeyRing({f"sk-key-{i:06d}": i for i in range(5)})
    assert ring.match("sk-key-000000") == 0  # the first key matches; the rest are still compared
    assert len(calls) == 5 and all(len(a) == len(b) == 32 for a, b in calls)
    calls.clear()
    assert ring.match("short") is None
    assert len(calls) == 5


def test_config_takes_per_key_limits():
    cfg = ServeConfig.model_validate(
        {
            "api_keys": [
                {"key": "sk-limited-01", "tenant": "t", "requests_per_minute": 60},
                {"key": "sk-open-00002", "tenant": "u"},
            ]
        }
    )
    assert cfg.api_keys[0].rate_limits() == KeyRateLimits(60, None)
    assert cfg.api_keys[1].rate_limits() == KeyRateLimits(None, None)
    with pytest.raises(ValueError):
        ApiKeyConfig(key="sk-limited-01", tenant="t", tokens_per_minute=0)
