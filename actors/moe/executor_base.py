"""What both MoE executors share: merging the attention workers' results of a step, and the
state kept between steps (stage times, rows per expert, the expert balancer's re-plans).
``LocalMoEExecutor`` (``executor.py``) and ``RayMoEExecutor`` (``ray_executor.py``) build on
``MoEExecutorBase``; neither imports the other."""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from actors.engine.step_plan import StepResult
from actors.moe.messages import AttentionResult, MoESpec, StageTime
from models.config import read_model_config
from policies.expert_balance import ExpertBalancer, ExpertPlacement


def merge_results(
    step_id: int, results: list[AttentionResult]
) -> tuple[StepResult, list[StageTime], dict[int, int]]:
    """One ``StepResult`` from every attention worker's micro-batch results, the step's
    stage times (every attention and expert round) by start time, and rows per expert."""
    merged = StepResult(step_id, {})
    times: list[StageTime] = []
    rows: dict[int, int] = {}
    for r in results:
        assert r.step_id == step_id, (r.step_id, step_id)
        merged.tokens.update(r.tokens)
        merged.logprobs.update(r.logprobs)
        times.extend(r.timings)
        for e, n in r.expert_rows.items():
            rows[e] = rows.get(e, 0) + n
    return merged, sorted(set(times), key=lambda t: (t[4], t[0], t[1])), rows


class MoEExecutorBase:
    """What both executors keep between steps: the last steps' stage times, rows per expert,
    and (with a ``balancer``) the expert placement, re-planned between steps when the
    observed rows drift (``policies.expert_balance.ExpertBalancer``)."""

    depth = 1

    def __init__(self, spec: MoESpec, balancer: ExpertBalancer | None = None) -> None:
        self.spec = spec
        self.num_layers = read_model_config(spec.model_dir).num_hidden_layers
        self.timeline: deque[tuple[int, list[StageTime]]] = deque(maxlen=64)  # last steps
        self.balancer = balancer
        if balancer is not None:
            balancer.placement = spec.placement
        self.num_replans = 0
        self._rows = [0] * spec.placement.num_experts

    def _record(self, step_id: int, results: list[AttentionResult]) -> StepResult:
        merged, times, rows = merge_results(step_id, results)
        self.timeline.append((step_id, times))
        counts = [0] * len(self._rows)
        for e, n in rows.items():
            counts[e] = n
            self._rows[e] += n
        if self.balancer is not None:
            now = time.monotonic()
            self.balancer.observe(counts, now)
            placement = self.balancer.maybe_replan(now)
            if placement is not None:
                self.num_replans += 1
                self.spec = dataclasses.replace(self.spec, placement=placement)
                self._apply_placement(placement)
        return merged

    def _apply_placement(self, placement: ExpertPlacement) -> None:
        raise NotImplementedError

    def token_counts(self) -> list[int]:
        """Rows each expert served since the last call, summed over its copies."""
        counts, self._rows = self._rows, [0] * len(self._rows)
        return counts
