"""A prefill worker's step hook: its KV streamed out layer by layer as it is written."""

from __future__ import annotations

from typing import Any

import torch

from actors.disagg.fault_injection import ExitAfterLayers
from actors.disagg.kv_stream import LayerStreamer, StreamReport
from actors.disagg.layer_loader import LayerLoader
from actors.engine.step_plan import StepPlan
from actors.engine.worker_hooks import KVCaches


class PrefillHook:
    """The prefill worker's ``StepHook``: streams each layer's KV as it is written, then,
    once the step's copies landed, hands the step to ``after_step`` (timing, store writes)."""

    def __init__(self, streamer: LayerStreamer, after_step: Any, loader: LayerLoader) -> None:
        self.streamer = streamer
        self.after_step = after_step
        self.loader = loader
        self.faults: ExitAfterLayers | None = None  # tests only: die mid-stream

    def begin_step(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        self.streamer.begin(plan, kv_caches)
        self.loader.begin_step({b for e in plan.entries for s in e.shards for b in s[2]})

    def before_layer(self, layer: int) -> None:
        self.loader.before_layer(layer)  # every started load holds this layer

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.loader.after_layer(layer)
        self.streamer.after_layer(layer, kv_cache)
        if self.faults is not None:
            self.faults.after_layer(self.streamer)

    def end_step(self, plan: StepPlan, kv_caches: KVCaches) -> StreamReport:
        report = self.streamer.finish()
        self.after_step(plan, kv_caches)
        return report
