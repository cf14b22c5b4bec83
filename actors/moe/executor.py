"""Executors of a disaggregated MoE replica: the rounds of a step, in ping-pong order.

A step's rounds are ``(layer, micro-batch)``, issued layer-major: attention of micro-batch
0, 1, .., m-1 for layer 0, their experts, then layer 1 of micro-batch 0 (which needs only
micro-batch 0's experts of layer 0), and so on. Run concurrently (``RayMoEExecutor``), the
attention workers compute micro-batch j + 1 while the expert workers compute micro-batch j:
the ping-pong pipeline. ``LocalMoEExecutor`` runs the same rounds one after another in
process (the exactness reference for the message plumbing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.step_plan import StepPlan, StepResult
from actors.engine.worker import WorkerSpec
from actors.moe.executor_base import MoEExecutorBase
from actors.moe.messages import AttentionResult, ExpertBatch, ExpertReply, MoESpec
from actors.moe.workers import AttentionWorker, ExpertWorker
from models.config import ModelConfig
from policies.expert_balance import ExpertBalancer, ExpertPlacement, plan_placement

if TYPE_CHECKING:
    from placement.model_specs import ModelSpec


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


def cost_spec(cfg: ModelConfig, name: str) -> ModelSpec:
    """The planner's cost-model shapes of a loaded MoE model's config."""
    from placement.model_specs import ModelSpec

    return ModelSpec(
        name,
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


def default_micro_batches(
    cfg: ModelConfig, attention_workers: int, tokens_per_step: int, device: str
) -> int:
    """The paper's rule ``m >= 2 (1 + T_c / T_f)`` with ``T_a``, ``T_e`` and ``T_c`` from the
    roofline of this model (``placement.moe_plan``) on the device (the ``CPU`` spec on CPU;
    messages move at the machine's memcpy speed there), for a step of ``tokens_per_step``
    decode tokens split over the attention workers in three micro-batches, each request
    holding a quarter of the model's positions of KV (an assumption, not a measurement)."""
    from placement.gpus import get_gpu
    from placement.moe_plan import (
        Efficiency,
        Hardware,
        attention_time,
        comm_time,
        expert_time,
        min_micro_batches,
    )

    spec = cost_spec(cfg, "runtime")
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
        attention_cores=tuple(config.attention_cores or ()),
        expert_cores=tuple(config.expert_cores or ()),
        link_bytes_per_s=config.moe_link_bytes_per_s,
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

    return RayMoEExecutor(
        moe_spec,
        balancer,
        resources=config.worker_resources,
        attention_resources=config.attention_resources,
        expert_resources=config.expert_resources,
    )
