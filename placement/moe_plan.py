"""MegaScale-Infer's deployment-plan search for disaggregated MoE decoding (Algorithm 1).

A plan puts attention on ``n_a`` data-parallel attention nodes of ``tp_a`` GPUs each and one
expert on each of ``E`` expert nodes of ``tp_e`` GPUs each, and splits the global decode
batch ``B`` into ``m`` micro-batches that ping-pong between the two sides. Per layer and per
micro-batch (the paper's performance model, Section 4.2):

- ``T_a = k1 * b_a + k2`` on an attention node holding ``b_a`` tokens of the micro-batch;
- ``T_e = k3 * b_e + k4`` on an expert node receiving ``b_e`` tokens;
  ``b_a * m * n_a = b_e * m * E / K = B``;
- ``T_c = max(b_a h K / tp_a / (W_a Util), b_e h / tp_e / (W_e Util))`` (Eq. 6) with
  ``Util(bytes) = bytes / (bytes + half_bytes)``, the share of a NIC's bandwidth a message
  of that size reaches;
- KV memory: ``m b_a s kv_bytes + weights < tp_a C_a`` (Eq. 8), one expert's weights fit
  ``tp_e C_e``.

``k1..k4`` come from the roofline of a GPU spec x a model spec (``linear_times``) or from
profiling (pass ``LinearTime`` values to ``evaluate``). Each linear term is the sum of the
operators' memory and compute times (an upper bound of their roofline ``max`` within 2x),
so ``T`` stays linear in the batch as the paper models it.

The iteration time of the global batch generalises Eq. 5 to pipelines that cannot hide the
round trip: a layer's period is ``max(m T_f, T_a + T_e + 2 T_c)`` (each node computes m
micro-batches; one micro-batch needs a full round trip before its next layer), so
``T_total = (T_a + T_e + 2 T_c) + (L - 1) * period + (m - 1) * T_f``, which is Eq. 5 when
constraint 3 (``m T_f >= 2 (T_f + T_c)``) holds and ``L (T_a + T_e + 2 T_c)`` for ``m = 1``.
Every request gains one token per ``T_total``, which is what the TPOT SLO bounds.

Pure code: no torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from placement.gpus import GB, GPUSpec, get_gpu
from placement.model_specs import ModelSpec

# Per-GPU network (NIC) bandwidth, bytes/s, of the paper's testbeds (Section 7.1): Ampere
# nodes have eight 200 Gbps NICs for eight GPUs, H20 nodes four 400 Gbps NICs, L40S nodes
# two. Other GPUs default to 25 GB/s (one 200 Gbps NIC per GPU).
NIC_BW: dict[str, float] = {"H20": 25 * GB, "L40S": 12.5 * GB}
DEFAULT_NIC_BW = 25 * GB


@dataclass(frozen=True)
class Hardware:
    """A node type a module may run on: its GPU, per-GPU NIC bandwidth and GPUs per node
    (the most a tensor-parallel group may span)."""

    gpu: GPUSpec
    nic_bw: float
    gpus_per_node: int = 8

    @classmethod
    def named(cls, name: str, nic_bw: float | None = None, gpus_per_node: int = 8) -> Hardware:
        gpu = get_gpu(name)
        bw = nic_bw if nic_bw is not None else NIC_BW.get(gpu.name, DEFAULT_NIC_BW)
        return cls(gpu, bw, gpus_per_node)


@dataclass(frozen=True)
class Efficiency:
    """How close kernels and links get to their peaks, and the fixed costs."""

    mfu: float = 0.55  # share of peak FLOP/s a GEMM reaches
    mbu: float = 0.8  # share of peak HBM bandwidth a streaming read reaches
    layer_overhead_s: float = 20e-6  # kernel launches of one module's layer
    allreduce_latency_s: float = 10e-6
    msg_half_bytes: float = 64 * 1024  # message size reaching half the NIC bandwidth
    mem_util: float = 0.9  # share of HBM weights and KV may use


@dataclass(frozen=True)
class Workload:
    """``avg_context``: mean tokens of KV per decoding request (the paper's ``s``)."""

    avg_context: float
    tpot_slo_s: float = 0.150

    def __post_init__(self) -> None:
        if self.avg_context <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("avg_context and tpot_slo_s must be positive")


@dataclass(frozen=True)
class LinearTime:
    """``per_token * b + fixed`` seconds: one module's layer on one micro-batch of b tokens."""

    per_token: float
    fixed: float

    def __call__(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed


def _allreduce_per_token(model: ModelSpec, hw: Hardware, tp: int) -> float:
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * model.hidden * model.dtype_bytes / hw.gpu.link_bw


def attention_params(model: ModelSpec) -> int:
    """What an attention node holds: attention and router of every layer, embedding and
    LM head (everything but the experts)."""
    router = model.hidden * model.num_experts if model.is_moe else 0
    return (
        model.num_layers * (model.attn_params_per_layer + router) + 2 * model.vocab * model.hidden
    )


def attention_time(
    model: ModelSpec, hw: Hardware, tp: int, avg_context: float, eff: Efficiency = Efficiency()
) -> LinearTime:
    """``T_a`` per layer: QKV and output GEMMs and the router (weights read once, 2 FLOPs per
    parameter per token), the KV read of ``avg_context`` tokens per request, the attention
    FLOPs, one all-reduce of the output over ``tp`` GPUs."""
    g = hw.gpu
    compute, bandwidth = tp * g.flops * eff.mfu, tp * g.mem_bw * eff.mbu
    params = model.attn_params_per_layer + (model.hidden * model.num_experts)
    kv_layer = model.kv_bytes_per_token / model.num_layers
    per_token = (
        2 * params / compute
        + avg_context * kv_layer / bandwidth
        + 4 * model.num_heads * model.head_dim * avg_context / compute
        + _allreduce_per_token(model, hw, tp)
    )
    fixed = params * model.dtype_bytes / bandwidth + eff.layer_overhead_s
    if tp > 1:
        fixed += eff.allreduce_latency_s
    return LinearTime(per_token, fixed)


def expert_time(
    model: ModelSpec, hw: Hardware, tp: int, eff: Efficiency = Efficiency()
) -> LinearTime:
    """``T_e`` per layer: one SwiGLU expert (FFN input and output GEMMs) over ``tp`` GPUs."""
    g = hw.gpu
    compute, bandwidth = tp * g.flops * eff.mfu, tp * g.mem_bw * eff.mbu
    params = model.expert_params
    per_token = 2 * params / compute + _allreduce_per_token(model, hw, tp)
    fixed = params * model.dtype_bytes / bandwidth + eff.layer_overhead_s
    if tp > 1:
        fixed += eff.allreduce_latency_s
    return LinearTime(per_token, fixed)


def comm_time(
    model: ModelSpec,
    hw_a: Hardware,
    tp_a: int,
    b_a: float,
    hw_e: Hardware,
    tp_e: int,
    b_e: float,
    eff: Efficiency = Efficiency(),
) -> float:
    """``T_c`` (Eq. 6): the slower of an attention GPU sending its tokens' K copies and an
    expert GPU receiving its tokens (or the reverse; both directions cost the same)."""

    def one(nbytes: float, bw: float) -> float:
        if nbytes <= 0:
            return 0.0
        util = nbytes / (nbytes + eff.msg_half_bytes)
        return nbytes / (bw * util)

    h = model.hidden * model.dtype_bytes
    return max(one(b_a * h * model.top_k / tp_a, hw_a.nic_bw), one(b_e * h / tp_e, hw_e.nic_bw))


def min_micro_batches(t_c: float, t_f: float) -> int:
    """The least ``m`` with ``m >= 2 (1 + T_c / T_f)`` (constraint 3), at least 2: 3 when
    ``T_c < T_f / 2``, 4 when ``T_f / 2 < T_c < T_f``."""
    if t_f <= 0:
        raise ValueError("T_f must be positive")
    return max(2, math.ceil(2 * (1 + t_c / t_f) - 1e-12))


def iteration_time(t_a: float, t_e: float, t_c: float, m: int, num_layers: int) -> float:
    """Decoding iteration of the global batch (Eq. 5, with the bubble when constraint 3
    fails; see the module docstring)."""
    t_f = max(t_a, t_e)
    round_trip = t_a + t_e + 2 * t_c
    period = max(m * t_f, round_trip)
    return round_trip + (num_layers - 1) * period + (m - 1) * t_f


def balanced_attention_nodes(t_a: LinearTime, t_e: LinearTime, model: ModelSpec) -> list[int]:
    """``n_a = k1 E / (k3 K)`` balances ``T_a`` and ``T_e`` (constraint 1); the integers on
    either side of it (at least 1)."""
    ideal = t_a.per_token * model.num_experts / (t_e.per_token * model.top_k)
    return sorted({max(1, math.floor(ideal)), max(1, math.ceil(ideal))})


@dataclass(frozen=True)
class MoEPlan:
    """A deployment plan and what the performance model predicts for it."""

    model: str
    gpu_a: str
    tp_a: int
    n_a: int
    gpu_e: str
    tp_e: int
    n_e: int  # expert nodes (one expert each)
    m: int  # micro-batches
    batch: int  # global batch B = b_a * m * n_a
    b_a: int  # tokens of one micro-batch on one attention node
    b_e: float  # mean tokens of one micro-batch on one expert node
    t_a: float
    t_e: float
    t_c: float
    t_iter: float  # seconds per decoding iteration of the global batch (= TPOT)
    cost: float  # relative price of all GPUs
    kv_bytes_per_node: float

    @property
    def gpus(self) -> int:
        return self.tp_a * self.n_a + self.tp_e * self.n_e

    @property
    def throughput(self) -> float:
        """Decoded tokens per second."""
        return self.batch / self.t_iter

    @property
    def throughput_per_cost(self) -> float:
        return self.throughput / self.cost

    @property
    def per_gpu_throughput(self) -> float:
        return self.throughput / self.gpus


def evaluate(
    model: ModelSpec,
    hw_a: Hardware,
    tp_a: int,
    n_a: int,
    hw_e: Hardware,
    tp_e: int,
    m: int,
    b_a: int,
    workload: Workload,
    eff: Efficiency = Efficiency(),
    times: tuple[LinearTime, LinearTime] | None = None,
) -> MoEPlan | None:
    """The plan with micro-batches of ``b_a`` tokens per attention node; None when its
    weights or KV cache do not fit (Algorithm 1 line 4, Eq. 8). ``times``: measured
    ``(T_a, T_e)`` lines instead of the roofline ones."""
    if not model.is_moe:
        raise ValueError(f"{model.name} is dense; attention/expert disaggregation needs MoE")
    if min(tp_a, n_a, tp_e, m, b_a) < 1:
        raise ValueError("tp_a, n_a, tp_e, m and b_a must be at least 1")
    a_weights = attention_params(model) * model.dtype_bytes
    e_weights = model.num_layers * model.expert_params * model.dtype_bytes
    if e_weights >= tp_e * hw_e.gpu.mem_bytes * eff.mem_util:
        return None
    kv = m * b_a * workload.avg_context * model.kv_bytes_per_token
    if kv + a_weights >= tp_a * hw_a.gpu.mem_bytes * eff.mem_util:
        return None
    ta_line, te_line = times or (
        attention_time(model, hw_a, tp_a, workload.avg_context, eff),
        expert_time(model, hw_e, tp_e, eff),
    )
    b_e = b_a * n_a * model.top_k / model.num_experts
    t_a, t_e = ta_line(b_a), te_line(b_e)
    t_c = comm_time(model, hw_a, tp_a, b_a, hw_e, tp_e, b_e, eff)
    n_e = model.num_experts
    return MoEPlan(
        model=model.name,
        gpu_a=hw_a.gpu.name,
        tp_a=tp_a,
        n_a=n_a,
        gpu_e=hw_e.gpu.name,
        tp_e=tp_e,
        n_e=n_e,
        m=m,
        batch=b_a * m * n_a,
        b_a=b_a,
        b_e=b_e,
        t_a=t_a,
        t_e=t_e,
        t_c=t_c,
        t_iter=iteration_time(t_a, t_e, t_c, m, model.num_layers),
        cost=tp_a * n_a * hw_a.gpu.price + tp_e * n_e * hw_e.gpu.price,
        kv_bytes_per_node=kv,
    )


def largest_batch(
    model: ModelSpec,
    hw_a: Hardware,
    tp_a: int,
    n_a: int,
    hw_e: Hardware,
    tp_e: int,
    m: int,
    workload: Workload,
    eff: Efficiency = Efficiency(),
    max_b_a: int = 1 << 16,
) -> MoEPlan | None:
    """SIMULATE of Algorithm 1: the largest micro-batch meeting the SLO and memory, by binary
    search (iteration time and KV grow with the batch). None if even one token fails."""

    def ok(b: int) -> MoEPlan | None:
        plan = evaluate(model, hw_a, tp_a, n_a, hw_e, tp_e, m, b, workload, eff)
        return plan if plan is not None and plan.t_iter <= workload.tpot_slo_s else None

    best = ok(1)
    if best is None:
        return None
    lo, hi = 1, max_b_a
    while lo < hi:  # invariant: ok(lo); answer in [lo, hi]
        mid = (lo + hi + 1) // 2
        plan = ok(mid)
        if plan is not None:
            lo, best = mid, plan
        else:
            hi = mid - 1
    return best


def tp_choices(limit: int) -> list[int]:
    """Powers of two up to a node's GPUs (the paper's {1, 2, 4, 8})."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def search_plan(
    model: ModelSpec,
    attention_hw: Sequence[Hardware],
    expert_hw: Sequence[Hardware] | None,
    workload: Workload,
    micro_batches: Sequence[int] = (3, 4),
    eff: Efficiency = Efficiency(),
    max_gpus: int | None = None,
) -> MoEPlan:
    """Algorithm 1 over every (attention hardware, expert hardware) pair: the plan with the
    highest throughput per cost under the TPOT SLO. ``expert_hw=None``: the same types as
    attention, each used for both modules only (homogeneous). ``micro_batches``: the ``m``
    tried (the paper: 3 to N_m = 4). ``max_gpus``: the most GPUs a plan may use (beyond
    the paper: a cluster's size); the attention nodes are then capped to fit."""
    if not attention_hw:
        raise ValueError("give at least one hardware type")
    if expert_hw is None:
        pairs = [(hw, hw) for hw in attention_hw]
    else:
        pairs = [(a, e) for a in attention_hw for e in expert_hw]
    best: MoEPlan | None = None
    for hw_a, hw_e in pairs:
        for tp_e in tp_choices(hw_e.gpus_per_node):
            te_line = expert_time(model, hw_e, tp_e, eff)
            for tp_a in tp_choices(hw_a.gpus_per_node):
                ta_line = attention_time(model, hw_a, tp_a, workload.avg_context, eff)
                candidates = balanced_attention_nodes(ta_line, te_line, model)
                if max_gpus is not None:
                    cap = (max_gpus - tp_e * model.num_experts) // tp_a
                    candidates = sorted({min(n, cap) for n in candidates if cap >= 1})
                for n_a in candidates:
                    for m in micro_batches:
                        plan = largest_batch(model, hw_a, tp_a, n_a, hw_e, tp_e, m, workload, eff)
                        if plan is not None and (
                            best is None or plan.throughput_per_cost > best.throughput_per_cost
                        ):
                            best = plan
    if best is None:
        within = "" if max_gpus is None else f" within {max_gpus} GPUs"
        raise ValueError(
            f"no plan for {model.name} meets TPOT <= {workload.tpot_slo_s * 1e3:g} ms on "
            f"{', '.join(sorted({hw.gpu.name for p in pairs for hw in p}))}{within}: raise "
            "the SLO, allow more GPUs or larger ones"
        )
    return best


@dataclass(frozen=True)
class ColocatedPlan:
    """A colocated replica for comparison: attention and every expert tensor-sliced over the
    same ``tp`` GPUs (each GPU holds 1/tp of every expert), no micro-batches, per layer
    ``T_a(B) + E * T_e(B K / E)`` from the same linear model as the disaggregated plan."""

    gpu: str
    tp: int
    batch: int
    t_iter: float
    cost: float

    @property
    def throughput(self) -> float:
        return self.batch / self.t_iter

    @property
    def per_gpu_throughput(self) -> float:
        return self.throughput / self.tp

    @property
    def throughput_per_cost(self) -> float:
        return self.throughput / self.cost


def colocated_plan(
    model: ModelSpec,
    hw: Hardware,
    workload: Workload,
    eff: Efficiency = Efficiency(),
    max_batch: int = 1 << 17,
) -> ColocatedPlan:
    """The best colocated tensor-parallel replica under the same SLO and memory limits."""
    weights = model.weight_bytes
    best: ColocatedPlan | None = None
    for tp in tp_choices(hw.gpus_per_node):
        room = tp * hw.gpu.mem_bytes * eff.mem_util - weights
        if room <= 0:
            continue
        ta, te = (
            attention_time(model, hw, tp, workload.avg_context, eff),
            expert_time(model, hw, tp, eff),
        )

        def tpot(b: int, ta: LinearTime = ta, te: LinearTime = te) -> float:
            per_layer = ta(b) + model.num_experts * te(b * model.top_k / model.num_experts)
            return model.num_layers * per_layer

        cap = min(max_batch, int(room // (workload.avg_context * model.kv_bytes_per_token)))
        if cap < 1 or tpot(1) > workload.tpot_slo_s:
            continue
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tpot(mid) <= workload.tpot_slo_s else (lo, mid - 1)
        plan = ColocatedPlan(hw.gpu.name, tp, lo, tpot(lo), tp * hw.gpu.price)
        if best is None or plan.throughput_per_cost > best.throughput_per_cost:
            best = plan
    if best is None:
        raise ValueError(f"{model.name} fits no tensor-parallel group of {hw.gpu.name}")
    return best
