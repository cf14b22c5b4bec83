"""Executors of a disaggregated MoE replica: the rounds of a step, in ping-pong order.

A step's rounds are ``(layer, micro-batch)``, issued layer-major: attention of micro-batch
0, 1, .., m-1 for layer 0, their experts, then layer 1 of micro-batch 0 (which needs only
micro-batch 0's experts of layer 0), and so on. Run concurrently (``RayMoEExecutor``), the
attention workers compute micro-batch j + 1 while the expert workers compute micro-batch j:
the ping-pong pipeline. ``LocalMoEExecutor`` runs the same rounds one after another in
process (the exactness reference for the message plumbing).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.step_plan import StepPlan, StepResult
from actors.engine.worker import WorkerSpec
from actors.moe.messages import AttentionResult, ExpertBatch, ExpertReply, MoESpec, StageTime
from actors.moe.workers import AttentionWorker, ExpertWorker
from models.config import ModelConfig, read_model_config
from policies.expert_balance import ExpertBalancer, ExpertPlacement, plan_placement


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


class LocalMoEExecutor(MoEExecutorBase):
    """Every attention and expert worker in this process; rounds run one at a time."""

    def __init__(self, spec: MoESpec, balancer: ExpertBalancer | None = None) -> None:
        super().__init__(spec, balancer)
        self._start()

    def _start(self) -> None:
        spec = self.spec
        self.attention = [AttentionWorker(spec, a) for a in range(spec.attention_workers)]
        self.experts = [ExpertWorker(spec, w) for w in range(spec.expert_workers)]
        for attention in self.attention:
            attention.setup()
        for expert in self.experts:
            expert.setup()

    def _apply_placement(self, placement: ExpertPlacement) -> None:
        for attention in self.attention:
            attention.set_placement(placement)
        self.experts = [ExpertWorker(self.spec, w) for w in range(self.spec.expert_workers)]
        for expert in self.experts:
            expert.setup()

    def submit(self, plan: StepPlan) -> StepResult:
        m, layers = self.spec.micro_batches, self.num_layers
        replies: dict[int, list[tuple[ExpertReply, ...]]] = {}  # micro-batch -> per expert w
        results: list[AttentionResult] = []
        for layer in range(layers + 1):
            for j in range(m):
                sent: list[tuple[ExpertBatch, ...]] = []
                for a, worker in enumerate(self.attention):
                    inputs: tuple[Any, ...] = (
                        (plan,) if layer == 0 else tuple(r[a] for r in replies[j])
                    )
                    out = worker.attention_round(layer, j, *inputs)
                    if layer == layers:
                        assert isinstance(out, AttentionResult)
                        results.append(out)
                    else:
                        assert isinstance(out, tuple)
                        sent.append(out)
                if layer < layers:
                    replies[j] = [
                        expert.expert_round(layer, j, *(batches[w] for batches in sent))
                        for w, expert in enumerate(self.experts)
                    ]
        return self._record(plan.step_id, results)

    def result(self, handle: StepResult) -> StepResult:
        return handle

    def hook_info(self) -> list[Any]:
        return [None] * (len(self.attention) + len(self.experts))

    def restart(self) -> None:
        self._start()

    def on_idle(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def default_micro_batches(
    cfg: ModelConfig, attention_workers: int, tokens_per_step: int, device: str
) -> int:
    """The paper's rule ``m >= 2 (1 + T_c / T_f)`` with ``T_a``, ``T_e`` and ``T_c`` from the
    roofline of this model (``placement.moe_plan``) on the device (the ``CPU`` spec on CPU;
    messages move at the machine's memcpy speed there), for a step of ``tokens_per_step``
    decode tokens split over the attention workers in three micro-batches, each request
    holding a quarter of the model's positions of KV (an assumption, not a measurement)."""
    from placement.gpus import get_gpu
    from placement.model_specs import ModelSpec
    from placement.moe_plan import (
        Efficiency,
        Hardware,
        attention_time,
        comm_time,
        expert_time,
        min_micro_batches,
    )

    spec = ModelSpec(
        "runtime",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.num_local_experts,
        cfg.num_experts_per_tok,
        torch.empty((), dtype=cfg.torch_dtype).element_size(),
    )
    gpu = get_gpu("CPU" if device == "cpu" else "H100")
    hw = Hardware(gpu, nic_bw=gpu.link_bw, gpus_per_node=1)
    eff = Efficiency()
    b_a = max(1, tokens_per_step // (3 * attention_workers))
    b_e = b_a * attention_workers * spec.top_k / spec.num_experts
    t_a = attention_time(spec, hw, 1, cfg.max_position_embeddings / 4, eff)(b_a)
    t_e = expert_time(spec, hw, 1, eff)(b_e)
    t_c = comm_time(spec, hw, 1, b_a, hw, 1, b_e, eff)
    return min_micro_batches(t_c, max(t_a, t_e))


def build_moe_executor(
    config: EngineConfig, model_config: ModelConfig, spec: WorkerSpec
) -> LocalMoEExecutor | Any:
    """The executor of a disaggregated MoE replica from its engine options."""
    if not model_config.is_moe:
        raise ValueError(
            "attention_workers/expert_workers need a MoE model (Mixtral); this model is dense"
        )
    experts = model_config.num_local_experts
    n_e = config.expert_workers
    slots = config.expert_slots or -(-experts // n_e)
    placement = plan_placement([1.0] * experts, n_e, slots)
    m = config.micro_batches or default_micro_batches(
        model_config, config.attention_workers, config.max_num_seqs, spec.device
    )
    moe_spec = MoESpec(
        model_dir=spec.model_dir,
        dtype=spec.dtype,
        device=spec.device,
        attention_backend=spec.attention_backend,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        attention_workers=config.attention_workers,
        placement=placement,
        micro_batches=m,
    )
    balancer = None
    if config.rebalance_experts_s is not None:
        if config.rebalance_experts_s < 0:
            raise ValueError("rebalance_experts_s must be >= 0 or None")
        balancer = ExpertBalancer(
            n_e,
            slots,
            experts,
            window_s=max(10.0, 2 * config.rebalance_experts_s),
            min_interval_s=config.rebalance_experts_s,
            placement=placement,
        )
    if config.moe_in_process:
        return LocalMoEExecutor(moe_spec, balancer)
    from actors.moe.ray_executor import RayMoEExecutor

    return RayMoEExecutor(moe_spec, balancer, resources=config.worker_resources)
