"""How many replicas a replica group needs, from what its replicas hold (LLM-aware scaling).

Ray Serve's default policy scales on ongoing requests per replica. For an LLM that is a
poor signal: ten requests with 4k-token prompts are far more work than ten short chats,
and a replica whose KV cache is full cannot take more however few requests it runs. Here a
group's need, in replicas, is the largest of

- queued prefill tokens (prompt tokens not yet computed, waiting and running requests)
  over all replicas / ``queued_prefill_tokens`` (the target per replica);
- KV usage summed over the replicas / ``kv_usage`` (the target fraction of a replica's
  pool in use);
- optionally running + waiting requests / ``requests`` (the target per replica).

Hysteresis: the group grows as soon as the need is over its size (``ceil(need)``), and
shrinks only to a size at which the same load would be at most ``downscale_threshold`` of
the targets (``ceil(need / downscale_threshold)``), so a load just under a boundary does
not flap between two sizes. Delays (scale only after the wish has held for a while) are
the caller's: Serve applies ``upscale_delay_s`` / ``downscale_delay_s`` around a custom
policy.

Serve hook (why replica-reported metrics, and not the router deployment's view): Serve 2.60
runs a custom autoscaling policy in its controller, every control-loop tick, with an
``AutoscalingContext`` whose ``aggregated_metrics`` hold, per metric and per running
replica, the mean over ``look_back_period_s`` of what the replica's
``record_autoscaling_stats()`` returned (pushed every ``metrics_interval_s``). The router
deployment holds the same counters, but the controller can only reach it through a
handle call per tick from inside its own control loop (blocking it, or racing it), and a
router restart would blind the autoscaler; the replica-reported path is Serve's own,
covers exactly the replicas Serve counts as running, and smooths over a window. So each
replica reports ``ReplicaLoad.of(stats).as_metrics()``, and ``LLMAutoscalingPolicy`` (a
class-callable ``policy_function``, built once with ``policy_kwargs``) turns the context
back into ``ReplicaLoad`` records and calls ``desired_replicas``.

Pure: stdlib only, no clock. ``LLMAutoscalingPolicy`` reads the context's attributes and
imports nothing of Ray, and nothing here imports the rest of the repository at run time,
so Serve's by-value pickle of this module is all its controller needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.replica_stats import ReplicaStats

METRIC_PREFIX = "meridian_"  # the names of a replica's metrics in Serve's context


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What scaling reads of one replica (a snapshot, or means over a window)."""

    queued_prefill_tokens: float = 0.0
    kv_usage: float = 0.0  # blocks in use / total, 0..1
    num_running: float = 0.0
    num_waiting: float = 0.0

    @classmethod
    def of(cls, stats: ReplicaStats) -> ReplicaLoad:
        return cls(
            float(stats.queued_prefill_tokens),
            float(stats.kv_usage),
            float(stats.num_running),
            float(stats.num_waiting),
        )

    def as_metrics(self) -> dict[str, float]:
        """The replica's ``record_autoscaling_stats()`` answer."""
        return {METRIC_PREFIX + k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> ReplicaLoad:
        """Back from ``as_metrics`` (a missing metric reads 0)."""
        return cls(**{f.name: float(metrics.get(METRIC_PREFIX + f.name, 0.0)) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ScalingTargets:
    """Per-replica targets. ``requests=None``: request counts are not a signal."""

    queued_prefill_tokens: float = 2048.0
    kv_usage: float = 0.8
    requests: float | None = None
    downscale_threshold: float = 0.7  # shrink only to where the load is <= this x target

    def __post_init__(self) -> None:
        if self.queued_prefill_tokens <= 0:
            raise ValueError("queued_prefill_tokens must be positive")
        if not 0 < self.kv_usage <= 1:
            raise ValueError("kv_usage must be in (0, 1]")
        if self.requests is not None and self.requests <= 0:
            raise ValueError("requests must be positive or None")
        if not 0 < self.downscale_threshold <= 1:
            raise ValueError("downscale_threshold must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    replicas: int  # the desired size, within the bounds
    need: float  # the load in replicas at the targets (the largest signal)
    signal: str  # which signal set ``need``: queued_prefill_tokens | kv_usage | requests


def replica_need(loads: Sequence[ReplicaLoad], targets: ScalingTargets) -> tuple[float, str]:
    """(replicas the load needs at the targets, the signal that decided it). A replica
    that has not reported yet is simply absent: it holds nothing."""
    needs = {
        "queued_prefill_tokens": sum(x.queued_prefill_tokens for x in loads)
        / targets.queued_prefill_tokens,
        "kv_usage": sum(x.kv_usage for x in loads) / targets.kv_usage,
    }
    if targets.requests is not None:
        needs["requests"] = sum(x.num_running + x.num_waiting for x in loads) / targets.requests
    signal = max(needs, key=lambda k: needs[k])
    return max(0.0, needs[signal]), signal


def desired_replicas(
    loads: Sequence[ReplicaLoad],
    current: int,
    min_replicas: int,
    max_replicas: int,
    targets: ScalingTargets,
) -> ScalingDecision:
    """The group's desired size, given each replica's load and its size now (``current``:
    the size it is heading for, so replicas still starting are counted)."""
    if not 0 <= min_replicas <= max_replicas:
        raise ValueError(f"need 0 <= min_replicas ({min_replicas}) <= max ({max_replicas})")
    need, signal = replica_need(loads, targets)
    eps = 1e-9  # float noise must not add a replica at an exact boundary
    if need > current + eps:
        wanted = math.ceil(need - eps)
    else:
        shrunk = math.ceil(need / targets.downscale_threshold - eps)
        wanted = min(current, shrunk)
    return ScalingDecision(min(max(wanted, min_replicas), max_replicas), need, signal)


class LLMAutoscalingPolicy:
    """Serve's custom autoscaling policy for a replica group (``policy_function`` of the
    deployment's ``autoscaling_config``, ``policy_kwargs``: ``ScalingTargets`` fields).

    Called by Serve's controller every tick with an ``AutoscalingContext``; returns (desired
    replicas, policy state). Serve then applies the delays and ``min_replicas`` /
    ``max_replicas``; the capacity-adjusted bounds are applied here too."""

    def __init__(self, **targets: Any) -> None:
        self.targets = ScalingTargets(**targets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = self.decide(ctx)
        state = {"meridian_need": decision.need, "meridian_signal": decision.signal}
        return decision.replicas, state

    def decide(self, ctx: Any) -> ScalingDecision:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        per_replica: dict[Any, dict[str, float]] = {}
        for name, values in metrics.items():
            if name.startswith(METRIC_PREFIX):
                for replica, value in values.items():
                    per_replica.setdefault(replica, {})[name] = value
        loads = [ReplicaLoad.from_metrics(m) for m in per_replica.values()]
        return desired_replicas(
            loads,
            ctx.target_num_replicas,  # replicas still starting count (no second scale-up)
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            self.targets,
        )
