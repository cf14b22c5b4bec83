"""When a prefill or decode pool of a disaggregated cluster grows or shrinks (Dynamo's
planner's shape: each pool on its own signal).

- The prefill pool scales on queued prefill tokens (prompt tokens placed and not yet
  computed) per replica, the work that sets TTFT;
- the decode pool on KV use per replica (blocks in use or reserved over its pool), what
  bounds how many requests decode can hold and, with it, TBT.

The size a pool's load needs comes from ``policies.autoscaling.desired_replicas`` (the
same hysteresis as a colocated group: grow as soon as the need is over the size, shrink
only to where the load would be at most ``downscale_threshold`` of the target). Here the
delays are applied too: a new size is taken only once every decision over
``upscale_delay_s`` (growing) or ``downscale_delay_s`` (shrinking) wanted a change that
way, and then by the smallest such change, so one burst or one idle moment moves nothing.

Pure: no clock reads (``now`` is an argument), no Ray.
"""

from __future__ import annotations

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


def pool_loads(pool: str, signals: Sequence[float]) -> list[ReplicaLoad]:
    """Each replica's load as ``desired_replicas`` reads it: queued prefill tokens for
    the prefill pool, KV use (0..1) for the decode pool."""
    if pool == PREFILL_POOL:
        return [ReplicaLoad(queued_prefill_tokens=float(s)) for s in signals]
    return [ReplicaLoad(kv_usage=min(1.0, float(s))) for s in signals]


def _targets(pool: str, scaling: PoolScaling) -> ScalingTargets:
    if pool == PREFILL_POOL:
        return ScalingTargets(
            queued_prefill_tokens=scaling.target, downscale_threshold=scaling.downscale_threshold
        )
    if not 0 < scaling.target <= 1:
        raise ValueError(f"a decode pool's target is KV use in (0, 1], got {scaling.target}")
    return ScalingTargets(kv_usage=scaling.target, downscale_threshold=scaling.downscale_threshold)


class PoolScaler:
    """The size one pool should have now; call ``decide`` at every look at the pool."""

    def __init__(self, pool: str, scaling: PoolScaling) -> None:
        if pool not in (PREFILL_POOL, DECODE_POOL):
            raise ValueError(f"pool must be {PREFILL_POOL!r} or {DECODE_POOL!r}, got {pool!r}")
        self.pool, self.scaling = pool, scaling
        self.targets = _targets(pool, scaling)
        self.last: ScalingDecision | None = None  # the latest decision, as /metrics shows it
        self._wishes: list[tuple[float, int]] = []  # (when, size wanted) since the direction set

    def decide(self, signals: Sequence[float], size: int, now: float) -> int:
        """The pool's size to head for, given each live replica's signal and the pool's
        size now (replicas starting count)."""
        s = self.scaling
        decision = desired_replicas(
            pool_loads(self.pool, signals), size, s.min_replicas, s.max_replicas, self.targets
        )
        self.last = decision
        wanted = decision.replicas
        if wanted == size:
            self._wishes.clear()
            return size
        grow = wanted > size
        if self._wishes and (self._wishes[0][1] > size) != grow:
            self._wishes.clear()  # the direction changed: its delay starts again
        self._wishes.append((now, wanted))
        delay = s.upscale_delay_s if grow else s.downscale_delay_s
        if now - self._wishes[0][0] < delay:
            return size
        held = [w for t, w in self._wishes if now - t <= delay] or [wanted]
        self._wishes.clear()
        return min(held) if grow else max(held)
