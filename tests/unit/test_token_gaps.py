"""The gaps between a request's tokens that the inter-token-latency histogram counts, the
same on the colocated path and a P/D decode replica's direct path."""

import pytest

from actors.engine.token_gaps import TokenGapClock
from actors.serving.metrics import ReplicaMetrics


def test_first_tokens_have_no_gap_and_later_ones_share_theirs():
    clock = TokenGapClock()
    assert clock.gaps("a", 2, 10.0) == []  # the first tokens: their latency is the TTFT
    assert clock.gaps("a", 1, 10.5) == [0.5]
    assert clock.gaps("a", 4, 11.5) == [0.25] * 4  # four tokens in one batch share 1 s
    assert clock.gaps("b", 1, 11.5) == []  # each request on its own
    assert clock.gaps("a", 0, 12.0) == []  # no tokens: the last time stays
    assert clock.gaps("a", 1, 12.5) == [1.0]


def test_a_forgotten_request_starts_again_and_a_clock_going_back_gives_zero():
    clock = TokenGapClock()
    clock.gaps("a", 1, 5.0)
    clock.forget("a")
    clock.forget("never-seen")
    assert clock.gaps("a", 1, 6.0) == []
    assert clock.gaps("a", 1, 5.5) == [0.0]


def test_gaps_measured_elsewhere_land_in_the_histogram():
    m = ReplicaMetrics()
    m.on_gaps([0.01, 0.2])
    m.on_tokens("x", 1, 1.0)
    m.on_tokens("x", 1, 1.05)
    samples = {
        (s.name, s.labels.get("le")): s.value for f in m._registry.collect() for s in f.samples
    }
    assert samples[("meridian:inter_token_latency_seconds_count", None)] == 3
    assert samples[("meridian:inter_token_latency_seconds_sum", None)] == pytest.approx(0.26)
