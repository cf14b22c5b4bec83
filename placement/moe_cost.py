"""A ``CostModel`` of one disaggregated MoE replica (a ``MoEPlan``), so the simulator can
replay a trace on the plan: an iteration of a batch of ``(new_tokens, context_tokens)``
costs what ``placement.moe_plan`` predicts for it.

The batch's ``T`` new tokens split into ``m`` micro-batches over ``n_a`` attention nodes
(``b_a = T / (m n_a)`` tokens each) and reach each expert node as ``b_e = b_a n_a K / E``.
Per layer and micro-batch:

- ``T_a``: the plan's attention line at zero context (GEMMs, router, all-reduce, fixed
  costs) plus this batch's own attention work, a ``1 / (m n_a)`` share of its causal
  (query, key) pairs (``4 h hd`` FLOPs each) and of its KV reads (every context token once);
- ``T_e``, ``T_c``: ``expert_time`` and ``comm_time`` of the plan's hardware;
- the iteration: ``iteration_time(T_a, T_e, T_c, m, L)`` (Eq. 5 with the bubble).

For a decode batch of mean context ``s`` this is ``evaluate``'s ``t_iter`` (the same terms).
Pure code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from placement.model_specs import ModelSpec
from placement.moe_plan import (
    Efficiency,
    Hardware,
    LinearTime,
    MoEPlan,
    attention_params,
    attention_time,
    comm_time,
    expert_time,
    iteration_time,
)


@dataclass
class MoEPlanCost:
    plan: MoEPlan
    model: ModelSpec
    hw_a: Hardware
    hw_e: Hardware
    eff: Efficiency = Efficiency()
    _a: LinearTime = field(init=False)
    _e: LinearTime = field(init=False)

    def __post_init__(self) -> None:
        p = self.plan
        self._a = attention_time(self.model, self.hw_a, p.tp_a, 0.0, self.eff)
        self._e = expert_time(self.model, self.hw_e, p.tp_e, self.eff)
        g, tp = self.hw_a.gpu, p.tp_a
        self._compute = tp * g.flops * self.eff.mfu
        self._bandwidth = tp * g.mem_bw * self.eff.mbu
        m = self.model
        self._pair = 4 * m.num_heads * m.head_dim / self._compute  # seconds per (q, k) pair
        self._ctx = m.kv_bytes_per_token / m.num_layers / self._bandwidth  # per context token

    def batch_time(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        p, m = self.plan, self.model
        tokens = sum(n for n, _ in batch)
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in batch)
        context = sum(n + c for n, c in batch)
        share = p.m * p.n_a
        b_a = tokens / share
        b_e = b_a * p.n_a * m.top_k / m.num_experts
        t_a = self._a(b_a) + (pairs * self._pair + context * self._ctx) / share
        t_e = self._e(b_e)
        t_c = comm_time(m, self.hw_a, p.tp_a, b_a, self.hw_e, p.tp_e, b_e, self.eff)
        return iteration_time(t_a, t_e, t_c, p.m, m.num_layers)

    def kv_capacity_tokens(self) -> int:
        """KV tokens all attention nodes hold after their weights (Eq. 8)."""
        p, m = self.plan, self.model
        free = p.tp_a * self.hw_a.gpu.mem_bytes * self.eff.mem_util
        free -= attention_params(m) * m.dtype_bytes
        return max(0, int(p.n_a * free // m.kv_bytes_per_token))
