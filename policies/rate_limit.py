"""Per-key rate limits: requests and tokens per minute, as token buckets.

Each limited key has up to two buckets. A bucket holds at most one minute's allowance
(``capacity``, so a key may spend a whole minute's worth at once after idling) and refills
continuously at ``capacity / 60`` per second. A request takes one unit from the request
bucket and its *reservation* from the token bucket, both or neither; when it ends,
``settle`` corrects the token bucket to what it actually used (unused tokens come back,
and a request that used more than it reserved leaves the bucket in debt).

The ingress reserves ``usage.total_tokens`` at its largest: every prompt's tokens plus
``n x max_tokens`` completion tokens per prompt, and settles with the response's
``usage.total_tokens`` (zero when the request failed before any output).

Pure logic: no clock reads (``now`` is an argument, seconds on any monotonic clock), no
locks (the ingress calls it from one event loop), stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

PERIOD_S = 60.0  # limits are "per minute"


class TokenBucket:
    """``capacity`` units, refilled at ``capacity / period`` per second; starts full."""

    def __init__(self, capacity: float, period: float = PERIOD_S) -> None:
        if capacity <= 0 or period <= 0:
            raise ValueError("a bucket needs a positive capacity and period")
        self.capacity = float(capacity)
        self.rate = self.capacity / period
        self.level = self.capacity
        self.updated: float | None = None

    def _refill(self, now: float) -> None:
        if self.updated is not None and now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        if self.updated is None or now > self.updated:
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken: 0 when it can be now, ``math.inf`` when it
        never can (more than the capacity)."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` (may leave the bucket in debt: callers check ``wait_for`` first)."""
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True)
class KeyRateLimits:
    """A key's limits; ``None``: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class RateLimited:
    """Why a request was refused: the limit's name and value, and how long until it would
    fit (``math.inf``: never, the request alone is over the limit)."""

    limit: str  # "requests_per_minute" or "tokens_per_minute"
    value: int
    retry_after: float

    @property
    def never_fits(self) -> bool:
        return math.isinf(self.retry_after)


class RateLimiter:
    """The buckets of every limited key. Keys without limits are always admitted."""

    def __init__(self, limits: Mapping[str, KeyRateLimits]) -> None:
        self.limits = dict(limits)
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        for key, lim in self.limits.items():
            if lim.requests_per_minute is not None:
                self._requests[key] = TokenBucket(lim.requests_per_minute)
            if lim.tokens_per_minute is not None:
                self._tokens[key] = TokenBucket(lim.tokens_per_minute)

    def check(self, key: str, tokens: int, now: float) -> RateLimited | None:
        """Would one request reserving ``tokens`` be admitted now? Takes nothing. Of two
        refusing limits, names the one with the longer wait."""
        worst: RateLimited | None = None
        for name, buckets, amount in (
            ("requests_per_minute", self._requests, 1),
            ("tokens_per_minute", self._tokens, tokens),
        ):
            bucket = buckets.get(key)
            if bucket is None:
                continue
            wait = bucket.wait_for(amount, now)
            if wait > 0 and (worst is None or wait > worst.retry_after):
                worst = RateLimited(name, int(bucket.capacity), wait)
        return worst

    def admit(self, key: str, tokens: int, now: float) -> RateLimited | None:
        """Take one request and ``tokens`` from ``key``'s buckets, or nothing and say why."""
        refused = self.check(key, tokens, now)
        if refused is not None:
            return refused
        if key in self._requests:
            self._requests[key].take(1, now)
        if key in self._tokens:
            self._tokens[key].take(tokens, now)
        return None

    def settle(self, key: str, reserved: int, used: int, now: float) -> None:
        """A request admitted with ``reserved`` tokens ended having used ``used``."""
        bucket = self._tokens.get(key)
        if bucket is None or used == reserved:
            return
        if used < reserved:
            bucket.give_back(reserved - used, now)
        else:
            bucket.take(used - reserved, now)
