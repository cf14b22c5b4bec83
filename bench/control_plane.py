"""Per-iteration control-plane round trip: controller -> workers -> controller, compiled
graph against plain Ray actor calls, same workers, same plans, one run.

Each iteration sends a realistic plan (32 decoding requests with 1,024-token contexts and one
512-token prefill chunk: ~2.6k block ids and ~550 token ids) and gets sampled tokens back.
The workers run no model (``ControlPlaneWorker`` reads the plan, hands a [T, 64] activation to
the next stage and answers one token per sampled request), so what is timed is the control
path itself: serialisation, channels or the object store, scheduling of the actor tasks.
(Building a worker's tensors from this plan costs another ~0.5 ms in either mode.) Shapes:

- ``fan-out``: every worker gets the plan (tensor-parallel shape), all answer;
- ``chain``: the plan enters every stage, activations flow stage to stage (pipeline shape).

Target on this 2-core machine: with 1 and 2 workers, compiled overhead >= 3x lower than plain
calls. An idle compiled-graph actor spins on its input channel, so 4 workers oversubscribe
the 2 cores; they are reported, not targeted.

    python bench/control_plane.py [--iterations 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

from actors.engine.channel_bytes import CHANNEL_BYTES
from actors.engine.collectives import Layout
from actors.engine.ray_executor import RayExecutor
from actors.engine.step_plan import PlanEntry, StepPlan, StepResult
from actors.engine.worker import StageOutput, WorkerSpec
from bench.local_serve import local_ray

HIDDEN = 64  # activation width handed between stages (the tiny model's)


class ControlPlaneWorker:
    """``Worker``'s interface without the model: reads the plan, answers tokens."""

    def __init__(self, spec: WorkerSpec, coords: tuple[int, int, int], hooks: None = None) -> None:
        self.spec = spec
        self.tp_rank, self.stage, self.kvp_rank = coords

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        return 0

    def setup(self, init_method: str | None = None) -> tuple[int, int, int]:
        import torch  # noqa: F401 - imported before the first execute, as a real worker does

        return (self.tp_rank, self.stage, self.kvp_rank)

    def execute(self, plan: StepPlan, incoming: StageOutput | None = None):
        began = time.time()
        num_tokens = sum(e.num_tokens for e in plan.entries)
        timings = (list(incoming.timings) if incoming else []) + [(self.stage, began, time.time())]
        if self.stage < self.spec.layout.spp - 1:
            hidden = np.zeros((num_tokens, HIDDEN), dtype=np.float32)
            return StageOutput(plan.step_id, hidden, timings)
        tokens = {e.request_id: 7 for e in plan.entries if e.sample is not None}
        return StepResult(plan.step_id, tokens, timings)


def realistic_plan(step_id: int, block_size: int = 16) -> StepPlan:
    entries = []
    next_block = 0
    for i in range(32):  # decodes at position 1024
        blocks = list(range(next_block, next_block + 1024 // block_size + 1))
        next_block += len(blocks)
        entries.append(PlanEntry(f"req-{i}", 1024, [11], [(0, 0, blocks)], (0.0, 0, 1.0, i, 100)))
    blocks = list(range(next_block, next_block + 1024 // block_size))
    entries.append(PlanEntry("prefill", 512, list(range(512)), [(0, 0, blocks)], None))
    return StepPlan(step_id, entries)


def measure(executor: RayExecutor, iterations: int) -> list[float]:
    plans = [realistic_plan(i) for i in range(iterations + 20)]
    times = []
    for i, plan in enumerate(plans):
        t0 = time.perf_counter()
        result = executor.result(executor.submit(plan))
        elapsed = time.perf_counter() - t0
        assert len(result.tokens) == 32, result.tokens
        if i >= 20:  # warm-up: the first executions compile channels and import modules
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    env = {"RAY_CGRAPH_buffer_size_bytes": str(CHANNEL_BYTES)}
    with local_ray(env, num_cpus=2):
        shapes = [
            ("fan-out", 1, Layout(1, 1, 1)),
            ("fan-out", 2, Layout(2, 1, 1)),
            ("chain", 2, Layout(1, 2, 1)),
            ("fan-out", 4, Layout(4, 1, 1)),
            ("chain", 4, Layout(1, 4, 1)),
        ]
        print(f"per-iteration round trip, median of {args.iterations} (ms)")
        print(f"{'shape':8} {'workers':>7} {'plain calls':>12} {'compiled':>9} {'ratio':>6}")
        for shape, workers, layout in shapes:
            spec = WorkerSpec("-", "float32", "cpu", "torch", 16, 1, layout)
            medians = {}
            for compiled in (False, True):
                executor = RayExecutor(
                    spec, use_compiled_graph=compiled, worker_cls=ControlPlaneWorker
                )
                executor.depth = 1  # one step at a time: the round trip, not pipelining
                try:
                    medians[compiled] = statistics.median(measure(executor, args.iterations))
                finally:
                    executor.shutdown()
            plain, comp = medians[False] * 1e3, medians[True] * 1e3
            print(f"{shape:8} {workers:>7} {plain:>12.2f} {comp:>9.2f} {plain / comp:>5.1f}x")


if __name__ == "__main__":
    main()
