"""A ``ReplicaController`` served by ``EngineLoop``: a colocated replica's engine, with
its admission against a TTFT SLO and its stats for the router."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Self

from actors.engine.config import EngineConfig
from actors.engine.controller_builder import ControllerParts, build_parts
from actors.engine.executor import Executor
from actors.engine.outputs import StreamDelta
from actors.engine.replica_controller import ReplicaController
from actors.engine.step_plan import StepResult
from actors.engine.worker_hooks import HooksFactory, WorkerHooks
from errors import OverloadedError
from policies.admission import ColocatedAdmission, ColocatedLoad, QueuedPrompt, RunningDecode
from policies.pd_costs import CostFitter
from policies.replica_stats import ReplicaStats
from policies.request import Request
from policies.scheduler import ScheduledStep


class ColocatedEngine(ReplicaController):
    """A ``ReplicaController`` as a ``ServingEngine`` (its KV counted over every KV-parallel
    rank).

    ``ttft_slo`` (seconds): refuse (OverloadedError with Retry-After) a request whose
    predicted TTFT misses it: ``policies.admission.ColocatedAdmission`` on the exact queue
    (decided in ``add_request``, on the engine thread, so a burst of arrivals is judged one
    after another against the work each admission adds), with a step-cost model that a
    ``CostFitter`` refits from every measured step (its entries, decodes as one-token
    chunks, and the seconds between the ends of consecutive busy steps)."""

    def __init__(self, parts: ControllerParts, ttft_slo: float | None = None) -> None:
        super().__init__(parts)
        self.admission: ColocatedAdmission | None = None
        self.fitter: CostFitter | None = None
        if ttft_slo is not None:
            self.admission = ColocatedAdmission(ttft_slo)
            self.fitter = CostFitter(block_bytes=1, chunk_size=self.engine_config.chunk_size or 0)
        self._last_scheduled: ScheduledStep | None = None
        self._busy_since: float | None = None  # end of the last step, while work remained
        self._last_step_seconds = 0.0
        self._predicted: dict[str, tuple[float, float]] = {}  # id: (predicted TTFT, since)

    @classmethod
    def build(
        cls,
        model_dir: str | Path | None = None,
        config: EngineConfig | None = None,
        executor: Executor | None = None,
        worker_hooks: WorkerHooks | HooksFactory | None = None,
        *,
        ttft_slo: float | None = None,
        **options: Any,
    ) -> Self:
        """``ReplicaController.build`` with ``ttft_slo``."""
        return cls(build_parts(model_dir, config, executor, worker_hooks, **options), ttft_slo)

    def add_request(self, request: Request, kv_dest: Any = None) -> str:
        if self.admission is not None:
            self._admit(request)
        return super().add_request(request, kv_dest)

    def _admit(self, request: Request) -> None:
        assert self.admission is not None
        cfg = self.engine_config
        prompts, decodes = [], []
        for seq in self.scheduler.running:
            left = seq.max_tokens - len(seq.output_token_ids)
            if seq.in_prefill:
                prompts.append(
                    QueuedPrompt(seq.num_uncomputed_tokens, seq.num_computed_tokens, left, True)
                )
            else:
                decodes.append(RunningDecode(left, seq.num_tokens))
        for seq in self.scheduler.waiting:
            left = seq.max_tokens - len(seq.output_token_ids)
            prompts.append(QueuedPrompt(seq.num_uncomputed_tokens, seq.num_computed_tokens, left))
        load = ColocatedLoad(prompts, decodes, cfg.token_budget, cfg.max_num_seqs, cfg.chunk_size)
        cached = 0
        if self.kv.kvp == 1 and cfg.enable_prefix_caching:  # a hit is likely, not sure
            usable = (request.num_prompt_tokens - 1) // self.block_size
            cached = self.kv.likely_cached_blocks(request.block_hashes[:usable]) * self.block_size
        # It waited for this decision while the last step ran (at most that long).
        waited = self._last_step_seconds if self._busy_since is not None else 0.0
        judged = self.admission.judge(load, request.num_prompt_tokens - cached, cached, waited)
        if judged is not None and judged.meets_slo:
            # Measure the prediction against its first token (``step``).
            raw = judged.predicted_ttft / self.admission.correction  # the model's own
            self._predicted[request.request_id] = (raw, time.monotonic() - waited)
        if judged is not None and not judged.meets_slo:
            raise OverloadedError(
                f"predicted time to first token {judged.predicted_ttft:.2f}s is over this "
                f"group's TTFT SLO ({self.admission.ttft_slo:g}s); retry later",
                retry_after=judged.retry_after,
            )

    def step(self) -> list[StreamDelta]:
        start = time.monotonic() if self._busy_since is None else self._busy_since
        self._last_scheduled = None
        deltas = super().step()
        end = time.monotonic()
        self._busy_since = end if self.has_unfinished() else None
        self._last_step_seconds = end - start
        if self._predicted:
            assert self.admission is not None
            for d in deltas:
                guess = self._predicted.pop(d.request_id, None)
                if guess is not None:
                    self.admission.observe(guess[0], end - guess[1])
        scheduled = self._last_scheduled
        if self.fitter is not None and scheduled is not None:
            entries = zip(scheduled.entries, scheduled.starts, strict=True)
            chunks = [(n, first) for (_, n), first in entries]  # (new tokens, context)
            self.fitter.add_prefill_step(chunks, end - start)
            self.fitter.refit(self.admission)
        return deltas

    def abort(self, request_id: str) -> None:
        self._predicted.pop(request_id, None)
        super().abort(request_id)

    def _observe(self, scheduled: ScheduledStep, result: StepResult, began: float) -> None:
        self._last_scheduled = scheduled  # the step that completed: its entries, for the fit
        super()._observe(scheduled, result, began)

    def serving_stats(self) -> ReplicaStats:
        kv = self.kv
        total = kv.num_total_blocks
        return ReplicaStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            free_blocks=kv.num_free_blocks,
            total_blocks=total,
            kv_usage=kv.num_used_blocks / total,
            cache_hit_ratio=self.kv.hit_ratio,
            time=time.time(),
        )

    def cached_block_hashes(self) -> list[int]:
        return self.kv.cached_hashes()

    def drain_cache_events(self) -> list[tuple[str, int]]:
        return self.kv.drain_events()

    def check_blocks(self) -> dict[str, int]:
        return {f"kvp{rank}": n for rank, n in enumerate(self.kv.check_blocks())}
