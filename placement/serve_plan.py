"""From a deployment plan (``placement.moe_plan``, ``placement.dense_plan``) to a Serve
config's ``args``.

Pure data in, plain dicts out (the CLI, ``python -m sim plan`` in ``sim/plan_cli.py``, reads
files and writes YAML). A MoE plan maps onto one replica group of ``attention_workers = n_a`` and
``expert_workers = n_e`` with ``micro_batches = m``, room for the plan's global batch and the
plan's KV bytes per attention node.
The runtime runs each attention and expert worker on one device (no tensor parallelism
inside them), so only plans with ``tp_a = tp_e = 1`` become a config; the plan's GPU types
are written as comments (a group has no per-worker device type).
A dense plan maps onto one colocated group (``num_replicas`` of ``tp x spp x kvp``) or one
disaggregated group (``num_prefill`` : ``num_decode`` with ``prefill`` / ``decode``
layouts and a Conductor holding the SLOs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from placement.dense_plan import DensePlan, DenseSLO
from placement.model_specs import ModelSpec
from placement.moe_plan import MoEPlan, Workload

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def model_spec_from_hf(raw: dict[str, Any], name: str) -> ModelSpec:
    """The cost model's shapes of a Hugging Face ``config.json`` dict (Llama or Mixtral)."""
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        return ModelSpec(
            name=name,
            num_layers=int(raw["num_hidden_layers"]),
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            ffn=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]),
            num_experts=int(raw.get("num_local_experts") or 1),
            top_k=int(raw.get("num_experts_per_tok") or 1),
            dtype_bytes=_DTYPE_BYTES.get(str(raw.get("torch_dtype", "bfloat16")), 2),
        )
    except KeyError as e:
        raise ValueError(f"config.json of {name} lacks {e.args[0]!r}") from None


def decode_context(lengths: Iterable[tuple[int, int]]) -> float:
    """Mean KV tokens a decoding request holds: its prompt plus half its output, averaged
    over ``(input_len, output_len)`` pairs (the paper's ``s``)."""
    total = count = 0.0
    for input_len, output_len in lengths:
        total += input_len + output_len / 2
        count += 1
    if not count:
        raise ValueError("the trace holds no requests")
    return total / count


def serve_args(
    plan: MoEPlan,
    model: str | None,
    model_name: str,
    block_size: int = 16,
    replicas: int = 1,
) -> dict[str, Any]:
    """``args`` of a Serve application (``actors.serving.config.ServeConfig`` fields) that
    runs ``plan`` as one replica group of ``replicas`` replicas."""
    if plan.tp_a != 1 or plan.tp_e != 1:
        raise ValueError(
            f"the plan uses tp_a={plan.tp_a}, tp_e={plan.tp_e}; the runtime's attention and "
            "expert workers run on one device each: plan with --gpus-per-node 1"
        )
    return {
        "model": model,
        "model_name": model_name,
        "groups": [
            {
                "name": "moe",
                "num_replicas": replicas,
                "engine": {
                    "attention_workers": plan.n_a,
                    "expert_workers": plan.n_e,
                    "micro_batches": plan.m,
                    "block_size": block_size,
                    "max_num_seqs": plan.batch,
                    "token_budget": max(2048, plan.batch),
                    # the KV the plan holds per attention node (Eq. 8's left side)
                    "kv_cache_memory": max(1 << 20, math.ceil(plan.kv_bytes_per_node)),
                },
            }
        ],
    }


def dense_serve_args(
    plan: DensePlan,
    model: str | None,
    model_name: str,
    slo: DenseSLO,
    block_size: int = 16,
) -> dict[str, Any]:
    """``args`` of a Serve application running a dense plan as one replica group."""
    group: dict[str, Any] = {"name": "dense"}
    if plan.mode == "colocated":
        assert plan.layout is not None
        lay = plan.layout
        group.update(
            num_replicas=plan.replicas, engine={"tp": lay.tp, "spp": lay.spp, "kvp": lay.kvp}
        )
    else:
        assert plan.prefill is not None and plan.decode is not None
        group.update(
            num_replicas=1,
            num_prefill=plan.num_prefill,
            num_decode=plan.num_decode,
            prefill={"tp": plan.prefill.tp, "spp": plan.prefill.spp},
            decode={"tp": plan.decode.tp, "spp": plan.decode.spp},
            conductor={"ttft_slo": slo.ttft_s, "tbt_slo": slo.tpot_s},
        )
    group["engine"] = {**group.get("engine", {}), "block_size": block_size}
    return {"model": model, "model_name": model_name, "groups": [group]}


def describe_dense(plan: DensePlan, slo: DenseSLO, rate: float) -> list[str]:
    return [
        f"model {plan.model}: TTFT SLO {slo.ttft_s:g} s, TPOT SLO {slo.tpot_s * 1e3:g} ms, "
        f"trace rate {rate:.3g} requests/s",
        plan.describe(),
        f"predicted TTFT p90 {plan.ttft_p90:.2f} s, TPOT {plan.tpot * 1e3:.1f} ms",
    ]


def describe(plan: MoEPlan, workload: Workload) -> list[str]:
    """What the plan is and what the performance model predicts, one fact a line."""
    return [
        f"model {plan.model}: TPOT SLO {workload.tpot_slo_s * 1e3:g} ms, "
        f"mean decode context {workload.avg_context:.0f} tokens",
        f"attention: {plan.n_a} node(s) of {plan.tp_a} x {plan.gpu_a}; "
        f"experts: {plan.n_e} node(s) of {plan.tp_e} x {plan.gpu_e}",
        f"micro-batches m = {plan.m}, global batch {plan.batch} "
        f"({plan.b_a} tokens per attention node per micro-batch)",
        f"per layer and micro-batch: T_a {plan.t_a * 1e3:.3f} ms, T_e {plan.t_e * 1e3:.3f} ms, "
        f"T_c {plan.t_c * 1e3:.3f} ms",
        f"predicted TPOT {plan.t_iter * 1e3:.1f} ms, {plan.throughput:.0f} tokens/s, "
        f"{plan.per_gpu_throughput:.1f} tokens/s per GPU, "
        f"{plan.throughput_per_cost:.1f} tokens/s per unit cost ({plan.gpus} GPUs, "
        f"cost {plan.cost:g})",
    ]
