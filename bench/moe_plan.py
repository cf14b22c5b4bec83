"""Simulated (performance model, not measured): MegaScale-Infer's disaggregated MoE decoding
against a colocated tensor-parallel replica, and the micro-batch ablation, next to the
paper's figures.

Both sides use ``placement/moe_plan.py``'s linear model (``T = k * b + k'`` per module and
layer, from the roofline of the GPU spec): the disaggregated plan is Algorithm 1's best under
TPOT <= 150 ms; the colocated replica runs attention and every expert sliced over the same
tp GPUs with no micro-batches (``colocated_plan``). The workload is the paper's (median
input 571, output 159: 650 tokens of KV on average while decoding).

  python bench/moe_plan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from placement.model_specs import get_model  # noqa: E402
from placement.moe_plan import (  # noqa: E402
    Hardware,
    Workload,
    colocated_plan,
    evaluate,
    search_plan,
)

WORKLOAD = Workload(avg_context=571 + 159 / 2, tpot_slo_s=0.150)
MODELS = ("mixtral-8x22b", "dbrx")


def main() -> None:
    print("per-GPU decode throughput, TPOT <= 150 ms (tokens/s per GPU)")
    for name in MODELS:
        model = get_model(name)
        for gpu in ("A800", "H20", "L40S"):
            hw = Hardware.named(gpu)
            d, c = search_plan(model, [hw], None, WORKLOAD), colocated_plan(model, hw, WORKLOAD)
            print(
                f"  {name:14s} {gpu:5s} disaggregated {d.per_gpu_throughput:7.0f} "
                f"(tp_a {d.tp_a} x {d.n_a}, tp_e {d.tp_e} x {d.n_e}, m {d.m}, B {d.batch})  "
                f"colocated {c.per_gpu_throughput:7.0f} (tp {c.tp}, B {c.batch})  "
                f"ratio {d.per_gpu_throughput / c.per_gpu_throughput:.2f}x"
            )
    print("  paper (Fig. 8, Ampere): 1.28x over TensorRT-LLM, 2.56x over vLLM")
    print("throughput per cost, H20 + L40S (heterogeneous) vs the best single-GPU colocated")
    for name in MODELS:
        model = get_model(name)
        hws = [Hardware.named("H20"), Hardware.named("L40S")]
        d = search_plan(model, hws, hws, WORKLOAD)
        best = max(
            (colocated_plan(model, hw, WORKLOAD) for hw in hws), key=lambda c: c.throughput_per_cost
        )
        print(
            f"  {name:14s} attention {d.gpu_a}, experts {d.gpu_e}: {d.throughput_per_cost:.0f} "
            f"vs colocated {best.gpu} {best.throughput_per_cost:.0f}  "
            f"ratio {d.throughput_per_cost / best.throughput_per_cost:.2f}x"
        )
    print("  paper (Fig. 9): up to 1.86x over TensorRT-LLM, 3.24x over vLLM")
    print("micro-batch ablation at a fixed micro-batch size (A800, the plan's n_a and tp)")
    for name in MODELS:
        model = get_model(name)
        hw = Hardware.named("A800")
        best = search_plan(model, [hw], None, WORKLOAD)
        thr = {}
        for m in (1, 2, 3, 4):
            plan = evaluate(
                model, hw, best.tp_a, best.n_a, hw, best.tp_e, m, best.b_a // 2, WORKLOAD
            )
            assert plan is not None
            thr[m] = plan.throughput
        steps = "  ".join(f"m {m}->{m + 1} {thr[m + 1] / thr[m]:.2f}x" for m in (1, 2, 3))
        print(f"  {name:14s} {steps}")
    print("  paper (Fig. 12): m 1->2 1.9x; m 2->3 1.10x (Mixtral), 1.28x (DBRX)")


if __name__ == "__main__":
    main()
