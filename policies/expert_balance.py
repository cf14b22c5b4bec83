"""Expert load balancing with replicas (MegaScale-Infer Section 6, "Load balance").

Place ``M`` experts on ``N`` expert workers, each with room for ``slots`` experts, so the
busiest worker's cost ``C_j = sum_i x_ij * max(a_i, floor)`` is as small as the greedy gets
it. ``a_i`` is expert i's observed token count over the last period; ``floor`` (the paper's
``K``) is the cost of a cold expert (its weight read happens however few tokens come);
``x_ij`` is the share of expert i's tokens worker j serves. Greedy approximation:

1. replicas: every expert gets one copy; each spare slot goes to the expert with the highest
   cost per copy ``max(a_i, floor) / r_i`` (a hot expert's tokens split over its copies);
2. placement: copies in decreasing cost per copy go to the least-loaded worker that has a
   free slot and does not already hold that expert (longest-processing-time first);
3. traffic: a replicated expert's tokens split evenly over its copies (``x_ij = 1 / r_i``);
   ``ExpertPlacement.worker_for`` spreads them round-robin by the pair's index.

A placement is for every layer at once (a worker holds its experts' weights of all layers;
the counts are summed over layers). ``ExpertBalancer`` keeps a placement and re-plans when
the observed counts drift so far that a fresh plan's busiest worker would be lighter by more
than a threshold. Pure: stdlib only, ``now`` is an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpertPlacement:
    """``workers[j]``: the sorted expert ids worker j holds; every expert is held at least
    once and at most once per worker."""

    num_experts: int
    workers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        held = [e for experts in self.workers for e in experts]
        if any(not 0 <= e < self.num_experts for e in held):
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        for j, experts in enumerate(self.workers):
            if len(set(experts)) != len(experts):
                raise ValueError(f"worker {j} holds an expert twice")
        missing = sorted(set(range(self.num_experts)) - set(held))
        if missing:
            raise ValueError(f"experts {missing} are on no worker")

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def replicas(self, expert: int) -> tuple[int, ...]:
        """The workers holding ``expert``, ascending."""
        return tuple(j for j, experts in enumerate(self.workers) if expert in experts)

    def replica_table(self) -> tuple[tuple[int, ...], ...]:
        """``replica_table()[e]`` = ``replicas(e)``, for every expert."""
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for j, experts in enumerate(self.workers):
            for e in experts:
                table[e].append(j)
        return tuple(tuple(t) for t in table)

    def worker_for(self, expert: int, index: int) -> int:
        """Where the ``index``-th (token, expert) pair of ``expert`` in a round goes:
        round-robin over its copies, so each copy gets an even share."""
        copies = self.replicas(expert)
        return copies[index % len(copies)]

    def loads(self, counts: Sequence[float], floor: float = 0.0) -> list[float]:
        """Each worker's cost ``C_j`` under ``counts`` (tokens per expert)."""
        _check_counts(counts, self.num_experts)
        table = self.replica_table()
        load = [0.0] * self.num_workers
        for e, copies in enumerate(table):
            share = max(float(counts[e]), floor) / len(copies)
            for j in copies:
                load[j] += share
        return load

    def max_load(self, counts: Sequence[float], floor: float = 0.0) -> float:
        return max(self.loads(counts, floor))


def _check_counts(counts: Sequence[float], num_experts: int) -> None:
    if len(counts) != num_experts:
        raise ValueError(f"got {len(counts)} token counts for {num_experts} experts")
    if any(c < 0 for c in counts):
        raise ValueError("token counts must be non-negative")


def plan_placement(
    counts: Sequence[float], num_workers: int, slots: int, floor: float = 0.0
) -> ExpertPlacement:
    """The greedy placement (see the module docstring) of ``len(counts)`` experts on
    ``num_workers`` workers of ``slots`` experts each. Deterministic: ties go to the lower
    expert id and the lower worker index."""
    num_experts = len(counts)
    _check_counts(counts, num_experts)
    if num_workers < 1 or slots < 1:
        raise ValueError("num_workers and slots must be at least 1")
    if num_workers * slots < num_experts:
        raise ValueError(
            f"{num_experts} experts do not fit {num_workers} workers x {slots} slots; "
            f"add workers or give each at least {-(-num_experts // num_workers)} slots"
        )
    cost = [max(float(c), floor) for c in counts]
    # 1. replicas: spare slots to the highest cost per copy (at most one copy per worker)
    copies = [1] * num_experts
    for _ in range(num_workers * slots - num_experts):
        candidates = [e for e in range(num_experts) if copies[e] < num_workers]
        if not candidates:
            break
        hot = max(candidates, key=lambda e: (cost[e] / copies[e], -e))
        if cost[hot] == 0.0:
            break  # nothing to spread
        copies[hot] += 1
    # 2. longest processing time first over the copies
    items = sorted(
        ((cost[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
        key=lambda item: (-item[0], item[1]),
    )
    held: list[list[int]] = [[] for _ in range(num_workers)]
    load = [0.0] * num_workers
    for share, e in items:
        open_workers = [j for j in range(num_workers) if len(held[j]) < slots and e not in held[j]]
        j = min(open_workers, key=lambda j: (load[j], len(held[j]), j))
        held[j].append(e)
        load[j] += share
    return ExpertPlacement(num_experts, tuple(tuple(sorted(h)) for h in held))


@dataclass
class ExpertBalancer:
    """Keeps a placement and re-plans it when the counts drift.

    ``observe(counts, now)`` adds one round's per-expert token counts to a sliding window of
    ``window_s`` seconds. ``maybe_replan(now)`` returns a new placement when the window's
    counts would load the current placement's busiest worker more than ``1 + threshold``
    times a fresh plan's (and at least ``min_interval_s`` passed since the last change), else
    None. The runtime moves expert weights when it gets one."""

    num_workers: int
    slots: int
    num_experts: int
    floor: float = 0.0
    threshold: float = 0.2
    window_s: float = 60.0
    min_interval_s: float = 30.0
    placement: ExpertPlacement | None = None
    _history: list[tuple[float, tuple[float, ...]]] = field(default_factory=list, repr=False)
    _changed_at: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.placement is None:  # nothing observed yet: every expert equally hot
            self.placement = plan_placement(
                [1.0] * self.num_experts, self.num_workers, self.slots, self.floor
            )

    def observe(self, counts: Sequence[float], now: float) -> None:
        _check_counts(counts, self.num_experts)
        self._history.append((now, tuple(float(c) for c in counts)))
        horizon = now - self.window_s
        while self._history and self._history[0][0] < horizon:
            self._history.pop(0)

    def window_counts(self) -> list[float]:
        totals = [0.0] * self.num_experts
        for _, counts in self._history:
            for e, c in enumerate(counts):
                totals[e] += c
        return totals

    def imbalance(self) -> float:
        """Current busiest worker over a fresh plan's busiest, on the window's counts."""
        counts = self.window_counts()
        assert self.placement is not None
        fresh = plan_placement(counts, self.num_workers, self.slots, self.floor)
        best = fresh.max_load(counts, self.floor)
        current = self.placement.max_load(counts, self.floor)
        return current / best if best > 0 else 1.0

    def maybe_replan(self, now: float) -> ExpertPlacement | None:
        if not self._history:
            return None
        if self._changed_at is not None and now - self._changed_at < self.min_interval_s:
            return None
        counts = self.window_counts()
        fresh = plan_placement(counts, self.num_workers, self.slots, self.floor)
        assert self.placement is not None
        best = fresh.max_load(counts, self.floor)
        current = self.placement.max_load(counts, self.floor)
        if best <= 0 or current <= (1 + self.threshold) * best or fresh == self.placement:
            return None
        self.placement, self._changed_at = fresh, now
        return fresh
