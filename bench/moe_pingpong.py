"""Measured: decode step time of a disaggregated MoE replica on Ray against its micro-batch
count m (the ping-pong pipeline), with the workers on shared cores and on disjoint cores,
next to what the planner's equations predict for the same plan and shape.

A random MoE model (4 layers, hidden 512, 8 experts of intermediate 1024, top 2), one
attention worker and ``--expert-workers`` expert workers. Layouts:

- ``shared``: every worker on every core (the OS's choice, torch's default threads);
- ``pinned``: attention on the first half of this process's cores, experts on the rest
  (``attention_cores`` / ``expert_cores``: each worker process pinned, torch threads = its
  cores), the premise of ping-pong: each side computes on its own hardware.

Runs interleave (for each repetition: every layout x m, each run starting its own actors
and tearing them down); every figure is the median over ``--runs`` runs. Per run: the
median decode step, the median attention and expert round (stage) time, each worker's idle
share of the decode steps (1 - its busy time / wall time) and the overlap (the share of
expert busy time during which the attention worker was busy on another micro-batch).

Predictions beside each measurement, with the relative error (predicted / measured - 1):

- ``eq5``: ``placement.moe_plan.iteration_time(T_a, T_e, T_c, m, L)`` (Eq. 5 with the
  bubble) fed with this run's measured round times, as the paper profiles ``k1..k4``, and
  ``T_c`` (one message hop, all non-compute time included) from the same layout's m = 1
  steps: ``(step - L (T_a + T_e)) / 2L``. It checks the pipeline model, not the roofline;
- ``roofline``: the same equation with ``attention_time``, ``expert_time`` and
  ``comm_time`` from the roofline of the ``CPU`` placeholder spec (what
  ``default_micro_batches`` picks m from).

  flock /tmp/bench.lock python bench/moe_pingpong.py --runs 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.moe.executor import cost_spec
from actors.moe.messages import StageTime
from bench.local_serve import local_ray
from models import write_tiny_model
from models.config import read_model_config
from placement.gpus import get_gpu
from placement.moe_plan import (
    Efficiency,
    Hardware,
    attention_time,
    comm_time,
    expert_time,
    iteration_time,
)

MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
)
CHANNEL_ENV = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}
PROMPT = 16


@dataclass
class Run:
    step: float  # median decode step, s
    cpu: dict[str, float]  # worker -> its process's CPU seconds per wall second of decode
    t_a: float  # median attention round (one micro-batch, one layer), s
    t_e: float  # median expert round, s
    idle: dict[str, float]  # worker -> idle share of the decode steps (1 - busy share)
    overlap: float


def overlap_share(times: list[StageTime]) -> float:
    """Share of expert busy seconds overlapped by attention work on another micro-batch."""
    attention = [t for t in times if t[0] == "attention"]
    busy = covered = 0.0
    for e in (t for t in times if t[0] == "expert"):
        busy += e[5] - e[4]
        spans = sorted(
            (max(a[4], e[4]), min(a[5], e[5]))
            for a in attention
            if a[3] != e[3] and a[4] < e[5] and e[4] < a[5]
        )
        end = e[4]
        for lo, hi in spans:  # union of the overlapping spans
            lo = max(lo, end)
            if hi > lo:
                covered += hi - lo
                end = hi
    return covered / busy if busy else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def layouts(expert_workers: int) -> dict[str, dict[str, list[int]]]:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    pinned = {"attention_cores": cores[:half], "expert_cores": cores[half:] or cores}
    return {"shared": {}, "pinned": pinned}


def run(model_dir: Path, m: int, args: argparse.Namespace, cores: dict[str, list[int]]) -> Run:
    controller = ReplicaController.build(
        model_dir,
        attention_workers=1,
        expert_workers=args.expert_workers,
        micro_batches=m,
        block_size=16,
        **cores,
    )
    try:
        builder = controller.request_builder()
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for i in range(args.requests):
            prompt = [(i * 7919 + j * 104729) % 500 + 3 for j in range(PROMPT)]
            controller.add_request(builder.build(prompt, params))
        controller.step()  # every prompt in one step (16 x requests <= the token budget)
        controller.step()  # the first decode step (compiles the graph): not measured
        executor = controller.executor
        pids = {
            f"{kind}{w}": ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
            for kind, actors in (("a", executor.attention), ("e", executor.experts))
            for w, actor in enumerate(actors)
        }
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        steps = []
        while controller.has_unfinished():
            began = time.perf_counter()
            controller.step()
            steps.append(time.perf_counter() - began)
        cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in pids.items()}
        timeline = [t for _, t in list(executor.timeline)[-len(steps) :]]
    finally:
        controller.shutdown()
    layers = read_model_config(model_dir).num_hidden_layers
    stages = [t for times in timeline for t in times]
    busy: dict[str, float] = {}
    for kind, w, layer, _, lo, hi in stages:
        if kind == "expert" or layer < layers:  # layer L: sampling, not a ping-pong stage
            key = f"{kind[0]}{w}"
            busy[key] = busy.get(key, 0.0) + hi - lo
    wall = sum(steps)
    return Run(
        statistics.median(steps),
        {k: v / wall for k, v in cpu.items()},
        statistics.median(
            hi - lo for k, _, lay, _, lo, hi in stages if k[0] == "a" and lay < layers
        ),
        statistics.median(hi - lo for k, _, _, _, lo, hi in stages if k[0] == "e"),
        {k: 1.0 - v / wall for k, v in sorted(busy.items())},
        statistics.median(overlap_share(t) for t in timeline),
    )


def roofline(model_dir: Path, tokens: int, m: int, context: float) -> float:
    """Eq. 5's iteration time from the roofline of the CPU placeholder spec."""
    spec = cost_spec(read_model_config(model_dir), "bench")
    gpu = get_gpu("CPU")
    hw = Hardware(gpu, nic_bw=gpu.link_bw, gpus_per_node=1)
    eff = Efficiency()
    b_a = tokens / m
    b_e = b_a * spec.top_k / spec.num_experts
    t_a = attention_time(spec, hw, 1, context, eff)(b_a)
    t_e = expert_time(spec, hw, 1, eff)(b_e)
    t_c = comm_time(spec, hw, 1, b_a, hw, 1, b_e, eff)
    return iteration_time(t_a, t_e, t_c, m, spec.num_layers)


def shares(x: Run) -> str:
    """Each worker's idle share of the decode wall time / its CPU seconds per wall second
    (CPU above 1 - idle: time spent polling channels or in torch's spinning threads)."""
    return ", ".join(f"{k} {x.idle[k]:.0%}/{x.cpu[k]:.2f}" for k in x.idle)


def err(pred: float, meas: float) -> str:
    return f"{pred * 1e3:.1f} ms ({pred / meas - 1:+.0%})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2, help="repetitions, interleaved")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--expert-workers", type=int, default=1)
    parser.add_argument("--m", default="1,2,3", help="micro-batch counts")
    parser.add_argument("--layouts", default="shared,pinned")
    args = parser.parse_args()
    ms = [int(x) for x in args.m.split(",")]
    wanted = args.layouts.split(",")
    sides = {k: v for k, v in layouts(args.expert_workers).items() if k in wanted}
    with local_ray(CHANNEL_ENV, num_cpus=None):
        model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "moe", kind="moe", **MODEL)
        layers = read_model_config(model_dir).num_hidden_layers
        print(f"cores {sorted(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.1f}; layouts:")
        for name, cores in sides.items():
            print(f"  {name}: {cores or 'every worker on every core'}")
        results: dict[tuple[str, int], list[Run]] = {(s, m): [] for s in sides for m in ms}
        for r in range(args.runs):
            for side, cores in sides.items():
                for m in ms:
                    res = run(model_dir, m, args, cores)
                    results[(side, m)].append(res)
                    print(
                        f"run {r} {side} m={m}: step {res.step * 1e3:.1f} ms, T_a "
                        f"{res.t_a * 1e3:.2f} ms, T_e {res.t_e * 1e3:.2f} ms, idle / CPU "
                        f"{shares(res)}, overlap {res.overlap:.2f}",
                        flush=True,
                    )
    med = {
        k: Run(
            statistics.median(x.step for x in v),
            {w: statistics.median(x.cpu[w] for x in v) for w in v[0].cpu},
            statistics.median(x.t_a for x in v),
            statistics.median(x.t_e for x in v),
            {w: statistics.median(x.idle[w] for x in v) for w in v[0].idle},
            statistics.median(x.overlap for x in v),
        )
        for k, v in results.items()
    }
    context = PROMPT + args.tokens / 2
    print(
        f"\nmedians over {args.runs} runs ({args.requests} requests, 1 attention and "
        f"{args.expert_workers} expert workers):\n"
    )
    print(
        "| layout | m | decode step | T_a | T_e | idle/CPU per worker | overlap | eq5 | roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for side in sides:
        one = med.get((side, 1))
        t_c = max(0.0, (one.step - layers * (one.t_a + one.t_e)) / (2 * layers)) if one else None
        for m in ms:
            x = med[(side, m)]
            eq5 = (
                err(iteration_time(x.t_a, x.t_e, t_c, m, layers), x.step)
                if t_c is not None
                else "-"
            )
            roof = err(roofline(model_dir, args.requests, m, context), x.step)
            print(
                f"| {side} | {m} | {x.step * 1e3:.1f} ms | {x.t_a * 1e3:.2f} ms | "
                f"{x.t_e * 1e3:.2f} ms | {shares(x)} | {x.overlap:.2f} | {eq5} | {roof} |"
            )
    summary = []
    for side in sides:
        if (side, 1) in med:
            best = min(ms, key=lambda m: med[(side, m)].step)
            ratio = med[(side, 1)].step / med[(side, best)].step
            summary.append(f"{side} best m={best} ({ratio:.2f}x over m=1)")
    print("\nmoe-pingpong: " + "; ".join(summary))


if __name__ == "__main__":
    main()
