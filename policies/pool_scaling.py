"""When a prefill or decode pool of a disaggregated cluster grows or shrinks (Dynamo's
planner's shape: each pool on its own signal).

- The prefill pool scales on queued prefill tokens (prompt tokens placed and not yet
  computed) per replica, the work that sets TTFT;
- the decode pool on KV use per replica (blocks in use or reserved over its pool), what
  bounds how many requests decode can hold and, with it, TBT.

The size a pool's load needs comes from ``policies.autoscaling.desired_replicas`` (the
same hysteresis as a colocated group: grow as soon as the need is over the size, shrink
only to where the load would be at most ``downscale_threshold`` of the target), fed with
the pool's load averaged over ``upscale_delay_s`` (to grow) or ``downscale_delay_s`` (to
shrink), so one burst or one idle moment moves nothing.

Pure: no clock reads (``now`` is an argument), no Ray.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from policies.autoscaling import ReplicaLoad, ScalingDecision, ScalingTargets, desired_replicas

PREFILL_POOL = "prefill"
DECODE_POOL = "decode"


@dataclass(frozen=True)
class PoolScaling:
    """One pool's bounds, target and delays. ``target``: queued prefill tokens per
    replica (the prefill pool) or KV use per replica, 0..1 (the decode pool)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target: float = 2048.0
    downscale_threshold: float = 0.5
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas "
                f"({self.max_replicas})"
            )
        if self.target <= 0:
            raise ValueError(f"target must be positive, got {self.target}")
        if not 0 < self.downscale_threshold <= 1:
            raise ValueError("downscale_threshold must be in (0, 1]")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")


def pool_load(pool: str, total: float) -> ReplicaLoad:
    """The pool's summed signal as ``desired_replicas`` reads it: queued prefill tokens
    for the prefill pool, KV use (a replica's at most 1) for the decode pool."""
    if pool == PREFILL_POOL:
        return ReplicaLoad(queued_prefill_tokens=total)
    return ReplicaLoad(kv_usage=total)


def pool_total(pool: str, signals: Sequence[float]) -> float:
    """The pool's load: the replicas' signals summed (KV use capped at 1 a replica)."""
    return sum(float(x) if pool == PREFILL_POOL else min(1.0, float(x)) for x in signals)


def _targets(pool: str, scaling: PoolScaling) -> ScalingTargets:
    if pool == PREFILL_POOL:
        return ScalingTargets(
            queued_prefill_tokens=scaling.target, downscale_threshold=scaling.downscale_threshold
        )
    if not 0 < scaling.target <= 1:
        raise ValueError(f"a decode pool's target is KV use in (0, 1], got {scaling.target}")
    return ScalingTargets(kv_usage=scaling.target, downscale_threshold=scaling.downscale_threshold)


class PoolScaler:
    """The size one pool should have now; call ``decide`` at every look at the pool.

    The signal is bursty (a prefill queue fills and empties within steps), so decisions
    read its mean over a window, as Serve's look-back period does for colocated groups:
    the pool grows to what the mean load over the last ``upscale_delay_s`` needs, and
    shrinks to what the means over both windows fit, each only once the pool has been
    watched for that long."""

    def __init__(self, pool: str, scaling: PoolScaling) -> None:
        if pool not in (PREFILL_POOL, DECODE_POOL):
            raise ValueError(f"pool must be {PREFILL_POOL!r} or {DECODE_POOL!r}, got {pool!r}")
        self.pool, self.scaling = pool, scaling
        self.targets = _targets(pool, scaling)
        self.last: ScalingDecision | None = None  # the growing window's, as /metrics shows it
        self._samples: deque[tuple[float, float]] = deque()  # (when, the pool's summed signal)
        self._since: float | None = None  # first look

    def decide(self, signals: Sequence[float], size: int, now: float) -> int:
        """The pool's size to head for, given each live replica's signal and the pool's
        size now (replicas starting count)."""
        s = self.scaling
        if self._since is None:
            self._since = now
        self._samples.append((now, pool_total(self.pool, signals)))
        horizon = max(s.upscale_delay_s, s.downscale_delay_s)
        while self._samples and self._samples[0][0] < now - horizon:
            self._samples.popleft()
        up = self._decision(now, s.upscale_delay_s, size)
        self.last = up
        if up.replicas > size and now - self._since >= s.upscale_delay_s:
            return up.replicas
        # shrink only to a size both windows' loads fit (a step that just began must not
        # be averaged away by the quiet minutes before it)
        down = max(self._decision(now, s.downscale_delay_s, size).replicas, up.replicas)
        if down < size and now - self._since >= s.downscale_delay_s:
            return down
        return size

    def _decision(self, now: float, window: float, size: int) -> ScalingDecision:
        values = [v for t, v in self._samples if t >= now - window] or [self._samples[-1][1]]
        mean = sum(values) / len(values)
        s = self.scaling
        loads = [pool_load(self.pool, mean)]
        return desired_replicas(loads, size, s.min_replicas, s.max_replicas, self.targets)
